"""Decode against its rooflines: memory-bandwidth utilisation (MBU) and GPU busy fraction.

Needs GPU-timed decode steps, the model's geometry and the GPU's peaks; on CPU runs (no CUDA-event
times) or without geometry / GPU the rules stay silent.
"""

from __future__ import annotations

from .findings import Finding, ref
from .geometry import ModelGeometry
from .gpus import GpuSpec
from .kvplan import kv_bytes_per_token_per_rank
from .memory import GPU_SQL
from .sql import model_parallel_size, one, probe_share, probe_share_sentence
from .roofline import attention_flops, mfu

DECODE_SQL = """WITH st AS (
        SELECT t.* FROM steps t JOIN sources s USING (source_id)
        WHERE s.run_id = $run AND t.rank = 0 AND NOT isnan(t.gpu_ms)),
    d AS (SELECT gpu_ms, num_seqs, context_tokens,
                 ($weight_bytes + context_tokens * $kv_per_token) / (gpu_ms / 1e3) / $peak_bw AS mbu
          FROM st WHERE phase = 'decode')
    SELECT count(*) AS decode_steps, quantile_cont(mbu, 0.5) AS mbu_p50, quantile_cont(mbu, 0.95) AS mbu_p95,
           quantile_cont(gpu_ms, 0.5) AS decode_ms_p50, avg(num_seqs) AS batch_mean,
           quantile_cont(context_tokens, 0.5) AS context_tokens_p50,
           (SELECT sum(gpu_ms) FROM st) / nullif((SELECT (max(ts_ns) - min(ts_ns)) / 1e6 + arg_max(host_ms, ts_ns)
                                                  FROM st), 0) AS busy_fraction_events
    FROM d"""

# NVML utilisation while the engine decodes: the samples whose second and the one before it are full of the run's
# steps (their first-to-last span >= `$active_span` of the second) and mostly decode steps. A run's NVML average over
# its whole span also counts engine start-up, warm-up and the pauses between a client's waves, when no step runs
# (two H200 runs of ~2 ms decode steps read 2-5% busy that way); a sample needs its window inside activity
ACTIVE_GPU_SQL = """WITH st AS (SELECT t.ts_ns, t.phase FROM steps t JOIN sources s USING (source_id)
                            WHERE s.run_id = $run AND t.rank = 0),
    sec AS (SELECT ts_ns // 1000000000 AS sec, count(*) AS n, count(*) FILTER (WHERE phase = 'decode') AS d,
                   max(ts_ns) - min(ts_ns) AS span_ns FROM st GROUP BY sec),
    act AS (SELECT sec FROM sec WHERE span_ns >= $active_span * 1e9 AND d >= 0.5 * n),
    g AS (SELECT g.util_pct, g.ts_ns // 1000000000 AS sec FROM gpu_samples g JOIN sources s USING (source_id)
          WHERE (s.run_id = $run OR s.runtime = 'sidecar') AND NOT isnan(g.util_pct))
    SELECT count(*) AS active_samples, avg(util_pct) AS active_util_pct_mean,
           (SELECT count(*) FROM act) AS active_seconds
    FROM g WHERE sec IN (SELECT sec FROM act) AND sec - 1 IN (SELECT sec FROM act)"""

PREFILL_SQL = """SELECT t.gpu_ms, t.prefill_tokens, t.context_tokens FROM steps t JOIN sources s USING (source_id)
    WHERE s.run_id = $run AND t.rank = 0 AND NOT isnan(t.gpu_ms) AND t.phase = 'prefill'"""


def _kv_dtype(con, run_id: str, labels: dict) -> str:
    r = con.execute("SELECT any_value(kv_dtype) FROM kv_snapshots k JOIN sources s USING (source_id) "
                    "WHERE s.run_id = ?", [run_id]).fetchone()[0]
    from .geometry import DTYPE_BYTES

    for cand in (labels.get("kv_dtype"), r):
        if cand and str(cand).lower() in DTYPE_BYTES:
            return str(cand).lower()
    return "bf16"


def _measure(con, run_id: str, model: ModelGeometry, gpu: GpuSpec, labels: dict) -> dict:
    tp = model_parallel_size(con, run_id)  # a DP engine holds whole weights
    kv_dt = _kv_dtype(con, run_id, labels)
    wb = model.weight_bytes / tp
    kvpt = kv_bytes_per_token_per_rank(model, tp, kv_dt)
    sql = DECODE_SQL.replace("$weight_bytes", repr(wb)).replace("$kv_per_token", repr(kvpt)) \
        .replace("$peak_bw", repr(gpu.mem_bw_bytes_s))
    e = one(con, sql, run_id)
    g = one(con, GPU_SQL, run_id)
    a = one(con, ACTIVE_GPU_SQL.replace("$active_span", "0.9"), run_id)
    e["util_pct_mean"] = g["util_pct_mean"]
    e.update(a)
    # NVML only over seconds of decoding; without such samples (a run of short bursts, none sampled within them),
    # the CUDA events' time over the timed steps' span
    e["busy_fraction"] = a["active_util_pct_mean"] / 100 if a["active_samples"] else e["busy_fraction_events"]
    e["busy_source"] = (f"NVML, {a['active_samples']} samples within decoding" if a["active_samples"]
                        else "CUDA events over the timed steps' span")
    e.update({"gpu": gpu.name, "peak_bw_bytes_s": gpu.mem_bw_bytes_s, "weight_bytes_per_rank": wb,
              "kv_bytes_per_token_per_rank": kvpt, "kv_dtype": kv_dt, "tp": tp})
    if e["decode_steps"]:
        floor_s = (wb + (e["context_tokens_p50"] or 0) * kvpt) / gpu.mem_bw_bytes_s
        e["decode_floor_ms"] = floor_s * 1e3
        # CUDA events bracket the whole step on the stream, host gaps inside it included (vLLM prepares inputs
        # between its events): where NVML measured the GPU busy while decoding, the kernels' share of the
        # step is that; MBU is then read on the kernels' time, not on the GPU waiting for the host
        kernel = e["decode_ms_p50"] * min(e["busy_fraction"], 1.0) if e["active_samples"] else None
        e["decode_kernel_ms_p50"] = kernel
        e["mbu_p50_events"] = e["mbu_p50"]
        if kernel:
            e["mbu_p50"] = floor_s * 1e3 / kernel
        e["step_ms_source"] = (f"GPU time of {e['decode_steps']} CUDA-event-timed decode steps"
                               + (f" x NVML busy {e['busy_fraction']:.0%} while decoding (the kernels' time)"
                                  if kernel else ""))
    mfus = [mfu(model.params, n, ms / 1e3, gpu.flops(model.dtype), attention_flops(model, n, c), tp)
            for ms, n, c in con.execute(PREFILL_SQL, {"run": run_id}).fetchall() if ms > 0 and n > 0]
    mfus.sort()
    e["prefill_mfu_p50"] = mfus[len(mfus) // 2] if mfus else None
    e["query"] = sql + ";\n" + GPU_SQL + ";\n" + ACTIVE_GPU_SQL.replace("$active_span", "0.9") + ";\n" + PREFILL_SQL
    return e


def decode_roofline(con, run_id: str, *, min_mbu: float = 0.3, min_busy: float = 0.6, target_mbu: float = 0.6,
                    min_steps: int = 10, model: ModelGeometry | None = None, gpu: GpuSpec | None = None,
                    labels: dict | None = None, **_: object) -> list[Finding]:
    """`decode-below-roofline` when the median decode MBU is < `min_mbu`; `decode-launch-bound` when the
    GPU busy fraction (NVML utilisation, else CUDA-event time over wall time) is < `min_busy`."""
    if model is None or gpu is None:
        return []
    e = _measure(con, run_id, model, gpu, labels or {})
    if (e["decode_steps"] or 0) < min_steps:
        return []
    out = []
    th = {"min_mbu": min_mbu, "min_busy": min_busy, "target_mbu": target_mbu, "min_steps": min_steps}
    busy = e["busy_fraction"]
    graphs_on = (labels or {}).get("runtime") == "vllm" and str((labels or {}).get("enforce_eager", "")) == "False"
    # with CUDA graphs on, a decode step is one graph launch: the GPU does not idle between its kernels, it waits
    # on the host between steps, which `host-bound` measures and names (one H100 run with graphs on was told to
    # capture graphs); this rule speaks only of runs that launch kernel by kernel
    if busy is not None and busy < min_busy and not graphs_on:
        e["probe_cost_share"] = own = probe_share(con, run_id)
        mine = probe_share_sentence(own)
        out.append(Finding(
            summary=(f"The GPU is busy {busy:.0%} of decode time; a decode step's median GPU time is "
                     f"{e['decode_ms_p50']:.2f} ms ({e['decode_steps']} CUDA-event-timed steps), mean batch "
                     f"{e['batch_mean']:.1f}." + mine),
            action=(("CUDA graphs are on: cut the host work between steps (see host-bound)" if graphs_on else
                     "Capture decode in CUDA graphs and batch more sequences per step")
                    + f": the step falls toward ~{e['decode_ms_p50'] * busy:.2f} ms."),
            id="decode-launch-bound",
            title="Decode is launch-bound: the GPU idles between kernels",
            severity="warning",
            evidence=e,
            suggestion=((f"CUDA graphs are on (--enforce-eager is off), so the GPU waits on the host between steps: "
                         "scheduling, sampling, detokenization and the probe's own hooks. Find which (see host-bound; "
                         "vLLM --async-scheduling overlaps the host's work with the GPU) and batch more sequences per "
                         f"step (mean batch now {e['batch_mean']:.1f})." if graphs_on else
                         "Capture decode in CUDA graphs (vLLM does by default unless --enforce-eager; torch.compile "
                         "mode='reduce-overhead'; HF static cache + compile) to remove per-kernel launch cost, and "
                         f"batch more sequences per step (mean batch now {e['batch_mean']:.1f}).") + mine),
            expected_effect=(f"The GPU is busy {busy:.0%} of the time during decode; removing launch gaps brings a "
                             f"{e['decode_ms_p50']:.2f} ms decode step toward ~{e['decode_ms_p50'] * busy:.2f} ms."),
            reference=ref("Decode"),
            run_id=run_id, thresholds=th))
    if e["mbu_p50"] < min_mbu:
        target_ms = e["decode_floor_ms"] / target_mbu
        step_ms = e["decode_kernel_ms_p50"] or e["decode_ms_p50"]
        out.append(Finding(
            summary=(f"A decode step's median GPU time is {step_ms:.2f} ms ({e['step_ms_source']}) against a "
                     f"bandwidth floor of {e['decode_floor_ms']:.2f} ms (MBU {e['mbu_p50']:.0%})."),
            action=(f"Batch more sequences per step so one weight read serves more tokens: at {target_mbu:.0%} MBU "
                    f"the step takes ~{target_ms:.2f} ms."),
            id="decode-below-roofline",
            title=f"Decode runs at {e['mbu_p50']:.0%} of {gpu.name} memory bandwidth",
            severity="warning",
            evidence=e,
            suggestion=("Decode is memory-bound: each step must read the weights and the KV. Raise the batch "
                        f"(mean {e['batch_mean']:.1f} sequences per step; vLLM --max-num-seqs) so one weight read "
                        "serves more tokens, use CUDA graphs if launch-bound, and fused / paged attention kernels."),
            expected_effect=(f"Median decode step {step_ms:.2f} ms ({e['step_ms_source']}) against a bandwidth floor "
                             f"of {e['decode_floor_ms']:.2f} ms (MBU {e['mbu_p50']:.0%}); at {target_mbu:.0%} MBU the "
                             f"step takes ~{target_ms:.2f} ms, i.e. TPOT ~{step_ms / target_ms:.1f}x lower."),
            reference=ref("Decode"),
            run_id=run_id, thresholds=th))
    return out
