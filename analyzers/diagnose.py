"""The façade: run every analyzer over one run and return its findings, most severe first.

    con = duckdb.connect("run.duckdb", read_only=True)
    findings = diagnose(con)                       # latest run, default thresholds
    findings = diagnose(con, run_id, stall_ratio=4.0, model=load_config("config.json"), gpu="H100-SXM")

Model geometry and the GPU come from the run's labels (`run_info`) unless given.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import duckdb

from phasescope.agent.read.queries import latest_run
from phasescope.agent.records import derived

from .decode import decode_roofline
from .findings import Finding, sort_findings, weigh
from .geometry import ModelGeometry, geometry_from_labels
from .gpus import GpuSpec, lookup
from .history import history_rolled
from .host import host_bound, process_memory_growth
from .itl import itl_spikes
from .kvcache import kv_external_fragmentation, kv_headroom_low, kv_internal_fragmentation, kv_near_cap
from .memory import gpu_memory_near_full, gpu_xid_errors, kv_budget_oom_risk
from .prefill import prefill_stalls_decode
from .prefix import prefix_hit_collapse
from .prefix_miss import prefix_miss_causes
from .residency import kv_evicted_before_reuse
from .queueing import ttft_queueing
from .telemetry import telemetry_degraded
from .reliability import preemption_recompute, probe_dropping, survival_rate
from .runinfo import read_run_info, with_flag_values
from .sql import OnceConnection, probe_share, probe_share_sentence
from .tp import tp_kv_head_replication, tp_kv_imbalance, tp_straggler

Analyzer = Callable[..., list[Finding]]

ANALYZERS: tuple[Analyzer, ...] = (
    prefill_stalls_decode, itl_spikes, ttft_queueing, decode_roofline,
    kv_near_cap, kv_headroom_low, kv_budget_oom_risk, kv_internal_fragmentation, kv_external_fragmentation,
    prefix_hit_collapse, tp_kv_imbalance, tp_straggler, tp_kv_head_replication,
    preemption_recompute, survival_rate, probe_dropping, gpu_memory_near_full, gpu_xid_errors,
    host_bound, process_memory_growth, telemetry_degraded, prefix_miss_causes, kv_evicted_before_reuse,
    history_rolled,
)
CONTEXT = ("model", "gpu", "labels", "now_ns")


def thresholds() -> dict[str, dict[str, Any]]:
    """Every analyzer's named thresholds and their defaults."""
    out = {}
    for fn in ANALYZERS:
        sig = inspect.signature(fn)
        out[fn.__name__] = {n: p.default for n, p in sig.parameters.items()
                            if p.kind is p.KEYWORD_ONLY and n not in CONTEXT}
    return out


def diagnose(con: Any, run_id: str | None = None, *, model: ModelGeometry | None = None,
             gpu: GpuSpec | str | None = None, now_ns: int | None = None, **overrides: Any) -> list[Finding]:
    """Findings of one run (default: the latest), most severe first. `overrides` set named thresholds
    (an unknown name raises ValueError); `model` / `gpu` override the run's labels. `now_ns`: the wall
    clock (Unix ns) of a live reader, whose runs may still be going (requests in flight are not failures);
    None for a file no agent writes, whose data is complete."""
    known = {n for params in thresholds().values() for n in params}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown threshold(s) {sorted(unknown)}; known: {sorted(known)}")
    run_id = run_id or latest_run(con)
    if run_id is None:
        return []
    labels = read_run_info(con, run_id)
    if not labels.get("runtime"):  # the probes say which runtime they measured: advice is phrased for it
        row = con.execute("SELECT any_value(runtime) FROM sources WHERE run_id = ? AND runtime != 'sidecar'",
                          [run_id]).fetchone()
        if row and row[0]:
            labels = {**labels, "runtime": row[0]}
    model = model or geometry_from_labels(labels)
    if isinstance(gpu, str):
        name = gpu
        gpu = lookup(gpu)
        if gpu is None:
            raise ValueError(f"unknown GPU {name!r}")
    gpu = gpu or lookup(labels.get("gpu_name"))
    context = {"model": model, "gpu": gpu, "labels": labels, "now_ns": now_ns}
    findings: list[Finding] = []
    once = OnceConnection(con, stored_views(con))  # a figure several rules read is read once
    for fn in ANALYZERS:
        params = inspect.signature(fn).parameters
        kw = {k: v for k, v in {**overrides, **context}.items() if k in params}
        findings.extend(fn(once, run_id, **kw))
    findings = with_probe_share([weigh(f) for f in reconcile(findings)], probe_share(once, run_id))
    if labels.get("runtime") == "vllm":  # name vLLM's flags with this run's values
        findings = [dataclasses.replace(f, suggestion=with_flag_values(f.suggestion, labels)) for f in findings]
    return sort_findings(findings)


# findings about step, token or request time: each states the probe's own share of the engine's time, so a reader
# can tell the server's figure from what measuring it added
TIMING = ("host-bound", "decode-launch-bound", "decode-below-roofline", "prefill-stalls-decode", "itl-spikes-",
          "ttft-queueing")


def with_probe_share(findings: list[Finding], share: float | None) -> list[Finding]:
    """Each timing finding (`TIMING`, by id or id prefix) with the probe's own share of the engine's time in its
    evidence (`probe_cost_share`) and as the last sentence of its expected effect; unchanged where the run has no
    self-measurement (`share` None) or the finding says it already."""
    if share is None:
        return findings
    line = probe_share_sentence(share)
    out = []
    for f in findings:
        if f.id.startswith(TIMING) and "probe's own share" not in f.expected_effect:
            f = dataclasses.replace(f, expected_effect=f.expected_effect.rstrip() + line,
                                    evidence={**f.evidence, "probe_cost_share": share})
        out.append(f)
    return out


def stored_views(con: Any) -> dict[str, str] | None:
    """SQL of the `requests` and `itl` views' rows from the stored tables, when they hold everything
    (records/derived.py's `stored`); None otherwise, or on a store without the derived tables."""
    try:
        return derived.stored(con)
    except duckdb.Error:  # an older build's store, Parquet exports
        return None


def diagnose_live(con: Any, run_id: str | None = None) -> list[Finding]:
    """diagnose() as a live reader (the agent's read API) runs it: with the wall clock now, so a run still
    going is judged as one (its running requests are in flight)."""
    import time

    return diagnose(con, run_id, now_ns=time.time_ns())


def reconcile(findings: list[Finding]) -> list[Finding]:
    """Make one report's advice agree: where two findings pull one knob opposite ways, the one that
    protects stability wins and the other's suggestion says so instead.

    - decode stalled by long prefills, or the ITL tail made of them (lower the per-step token budget) vs
      TTFT queueing (raise it): queueing gets capacity without larger steps;
    - KV memory at risk (lower the KV budget) vs a KV cache at its cap or a batch too small for the
      bandwidth roofline (more KV): neither may ask for more KV memory; fp8 KV and admission control do.
    """
    by_id = {f.id: f for f in findings}
    out = []
    memory_tight = bool({"kv-budget-oom-risk", "gpu-memory-near-full"} & set(by_id))
    kv_full = bool({"kv-near-cap", "kv-headroom-low"} & set(by_id))
    for f in findings:
        if f.id == "ttft-queueing" and {"prefill-stalls-decode", "itl-spikes-prefill"} & set(by_id):
            from .queueing import queueing_suggestion

            old = queueing_suggestion(f.evidence, raise_budget=True)
            if f.suggestion.startswith(old):
                f = dataclasses.replace(f, suggestion=queueing_suggestion(f.evidence, raise_budget=False)
                                        + f.suggestion[len(old):])
        elif f.id == "decode-below-roofline" and (kv_full or memory_tight) and "Raise the batch" in f.suggestion:
            f = dataclasses.replace(f, suggestion=f.suggestion.replace(
                "Raise the batch", "Raise the batch only once KV memory allows it (the KV findings here say it "
                "does not yet: quantize the KV cache first)", 1))
        out.append(f)
    return out