"""GPU memory: the KV budget against what the weights leave (OOM risk), the budget split, near-full
memory, XID errors.

GPU samples come from the sidecar's NVML sampler (source 0, run 'sidecar'), so a run's samples are
those of its own sources plus the sidecar's taken while the run's steps ran (one host, one clock).
"""

from __future__ import annotations

from phasescope.agent.read.thresholds import T
from .findings import Finding, ref
from .geometry import ModelGeometry
from .gpus import GIB, GpuSpec
from .sql import model_parallel_size, one
from .runinfo import as_number

RUN_GPU = """SELECT g.* FROM gpu_samples g JOIN sources s USING (source_id)
    WHERE s.run_id = $run OR (s.runtime = 'sidecar' AND g.ts_ns BETWEEN
        (SELECT min(t.ts_ns) FROM steps t JOIN sources s2 USING (source_id) WHERE s2.run_id = $run) AND
        (SELECT max(t.ts_ns) FROM steps t JOIN sources s2 USING (source_id) WHERE s2.run_id = $run))"""

GPU_SQL = f"""WITH g AS ({RUN_GPU})
    SELECT count(*) AS samples, max(mem_total_bytes) AS mem_total_bytes, max(mem_used_bytes) AS mem_used_max_bytes,
           max(mem_used_bytes / mem_total_bytes) AS mem_used_share_max,
           arg_max(gpu_index, mem_used_bytes / mem_total_bytes) AS fullest_gpu,
           avg(util_pct) AS util_pct_mean, max(xid_errors_total) AS xid_errors_max,
           max(xid_errors_total) - min(xid_errors_total) AS xid_errors_delta,
           arg_max(gpu_index, xid_errors_total) AS xid_gpu
    FROM g"""

KV_BUDGET_SQL = """SELECT max(total_pages * (kv_bytes / nullif(used_pages, 0))) AS kv_budget_bytes,
           max(total_pages) AS total_pages, any_value(kv_dtype) AS kv_dtype
    FROM kv_snapshots k JOIN sources s USING (source_id) WHERE s.run_id = $run AND total_pages > 0"""

SPLIT = {"weights": 0.30, "activations": 0.20, "kv": 0.45, "margin": 0.05}


def gpu_memory_near_full(con, run_id: str, *, max_used_share: float = T["max_used_share"], critical_used_share: float = 0.98,
                         **_: object) -> list[Finding]:
    """Fires when a GPU's used memory reaches `max_used_share` of its total."""
    e = one(con, GPU_SQL, run_id)
    if not e["samples"] or e["mem_used_share_max"] is None or e["mem_used_share_max"] < max_used_share:
        return []
    e["query"] = GPU_SQL
    free = (e["mem_total_bytes"] - e["mem_used_max_bytes"]) / GIB
    return [Finding(
        summary=(f"Peak use is {e['mem_used_share_max']:.1%} of {e['mem_total_bytes'] / GIB:.1f} GiB, leaving "
                 f"{free:.2f} GiB for activation spikes."),
        action="Lower the KV budget or the batch / context limits, keeping ~5% free: an activation spike is no OOM.",
        id="gpu-memory-near-full",
        title=f"GPU {e['fullest_gpu']} memory near full",
        severity="critical" if e["mem_used_share_max"] >= critical_used_share else "warning",
        evidence=e,
        suggestion=("Lower the KV budget (vLLM --gpu-memory-utilization or --num-gpu-blocks-override, HF num_blocks) "
                    "or the batch / context limits so activation peaks during long prefills have room; keep ~5% "
                    "margin."),
        expected_effect=(f"Peak use {e['mem_used_share_max']:.1%} of {e['mem_total_bytes'] / GIB:.1f} GiB leaves "
                         f"{free:.2f} GiB; an activation spike beyond that is an OOM, the most expensive "
                         "recomputation there is."),
        reference=ref("Memory budget"),
        run_id=run_id,
        thresholds={"max_used_share": max_used_share, "critical_used_share": critical_used_share},
    )]


def gpu_xid_errors(con, run_id: str, *, max_xid_errors: int = 0, **_: object) -> list[Finding]:
    """Fires when NVML reported more than `max_xid_errors` XID errors during the run."""
    e = one(con, GPU_SQL, run_id)
    if not e["samples"] or (e["xid_errors_max"] or 0) <= max_xid_errors:
        return []
    e["query"] = GPU_SQL
    return [Finding(
        summary=f"GPU {e['xid_gpu']} reported {e['xid_errors_max']} XID errors ({e['xid_errors_delta']} during the run).",
        action="Read the XID codes (dmesg | grep -i xid) and drain the node if they repeat: a failing GPU crashes and "
               "straggles.",
        id="gpu-xid-errors",
        title=f"GPU {e['xid_gpu']} reported XID errors",
        severity="critical",
        evidence=e,
        suggestion=("Read the XID codes in the kernel log (dmesg | grep -i xid) and the GPU's health (nvidia-smi -q); "
                    "drain the node if they repeat (memory ECC, fallen off the bus, NVLink errors)."),
        expected_effect=(f"{e['xid_errors_max']} XID errors on GPU {e['xid_gpu']} ({e['xid_errors_delta']} during the "
                         "run); crashes, stragglers and silent slowdowns follow from a failing GPU."),
        reference=ref("GPU health"),
        run_id=run_id,
        thresholds={"max_xid_errors": max_xid_errors},
    )]


def kv_budget_oom_risk(con, run_id: str, *, max_kv_share_of_remaining: float = 0.8, min_margin: float = 0.05,
                       model: ModelGeometry | None = None, gpu: GpuSpec | None = None, labels: dict | None = None,
                       **_: object) -> list[Finding]:
    """Fires when the KV budget per GPU exceeds `max_kv_share_of_remaining` of the memory the weights
    leave, or the peak leaves less than `min_margin` of GPU memory free. Reports the split
    (weights / activations / KV / margin) against the 30/20/45/5 starting split."""
    labels = labels or {}
    g = one(con, GPU_SQL, run_id)
    tp = model_parallel_size(con, run_id)  # a DP engine holds whole weights
    total = g["mem_total_bytes"] or as_number(labels.get("gpu_mem_bytes")) or (gpu.mem_bytes if gpu else None)
    weights = (model.weight_bytes / tp if model is not None else None) or as_number(labels.get("weight_bytes"))
    if not total or weights is None:  # silent whatever the KV budget: its pass over the snapshots is not read
        return []
    kv = one(con, KV_BUDGET_SQL, run_id)
    budget = as_number(labels.get("kv_budget_bytes")) or kv["kv_budget_bytes"]
    if not budget:
        return []
    remaining = total - weights
    share = budget / remaining if remaining > 0 else float("inf")
    used = g["mem_used_max_bytes"]
    split = {"weights": weights / total, "kv": budget / total}
    if used:
        split["activations"] = max(0.0, used - weights - budget) / total
        split["margin"] = (total - used) / total
    margin = split.get("margin")
    if share <= max_kv_share_of_remaining and (margin is None or margin >= min_margin):
        return []
    target = max_kv_share_of_remaining * remaining
    e = {"mem_total_bytes": total, "weight_bytes_per_gpu": weights, "kv_budget_bytes": budget,
         "remaining_after_weights_bytes": remaining, "kv_share_of_remaining": share, "mem_used_max_bytes": used,
         "split": split, "starting_split": SPLIT, "tp": tp, "suggested_kv_budget_bytes": target,
         "query": GPU_SQL + ";\n" + KV_BUDGET_SQL}
    pages = kv["total_pages"]
    new_pages = int(pages * target / budget) if pages else None
    split_txt = ", ".join(f"{k} {v:.0%} (start {SPLIT[k]:.0%})" for k, v in split.items())
    return [Finding(
        summary=(f"KV takes {share:.0%} of the {remaining / GIB:.1f} GiB the weights leave on each GPU"
                 + (f", {margin:.0%} of memory stayed free." if margin is not None else ".")),
        action=(f"Cap the KV budget at {target / GIB:.1f} GiB per GPU (fp8 KV keeps its capacity): activations "
                f"get {(remaining - target) / GIB:.1f} GiB."),
        id="kv-budget-oom-risk",
        title="KV budget leaves too little memory for activations: OOM risk",
        severity="critical" if share > 0.9 or (margin is not None and margin < min_margin) else "warning",
        evidence=e,
        suggestion=(f"Cap the KV budget at <= {max_kv_share_of_remaining:.0%} of the memory left after the weights: "
                    f"{target / GIB:.1f} GiB instead of {budget / GIB:.1f} GiB per GPU"
                    + (f" (~{new_pages} pages instead of {pages})" if new_pages else "")
                    + "; activations peak during long prefills and cannot be quantized or evicted. Quantize the KV "
                    "cache (fp8) to keep capacity within the smaller budget."),
        expected_effect=(f"KV takes {share:.0%} of the {remaining / GIB:.1f} GiB the weights leave on each GPU. "
                         f"Memory split: {split_txt}. At {target / GIB:.1f} GiB the activations and margin get "
                         f"{(remaining - target) / GIB:.1f} GiB."),
        reference=ref("Memory budget"),
        run_id=run_id,
        thresholds={"max_kv_share_of_remaining": max_kv_share_of_remaining, "min_margin": min_margin},
    )]
