"""Every analyzer threshold, just below and just above.

For each named threshold, on a committed fixture where its finding fires, the threshold is set to the
measured figure it is compared with (read from the finding's evidence at the defaults) and one step
past it (the next float, or +-1 for counts): the finding (or its critical severity) must appear on the
firing side and be gone on the other. A comparison written `>` for `>=`, a threshold compared with the
wrong figure, or a dropped condition fails here. The defaults themselves are pinned below, so a
changed constant fails too; `test_prefill_stall_ratio_at_its_default` checks the default boundary on a
stated store (decode steps co-scheduled with long prefills at 2.999x and 3.0x a pure decode step).
"""

from __future__ import annotations

import inspect
import math
import statistics
from typing import Any, Callable

import duckdb
import pytest

from phasescope.agent.records import events as ev
from phasescope.agent.sidecar.store import Store
from phasescope.analyzers import diagnose as dg
from phasescope.analyzers.geometry import geometry_from_labels
from phasescope.analyzers.gpus import lookup
from phasescope.analyzers.prefill import chunk_suggestion, chunked_prefill, prefill_stalls_decode, suggest_chunk
from phasescope.analyzers.runinfo import read_run_info

# every analyzer's thresholds and their defaults, as the docs and `diagnose --list-thresholds` state them
DEFAULTS = {
    "prefill_stalls_decode": {"long_prefill_tokens": 128, "stall_ratio": 3.0, "critical_ratio": 10.0, "min_steps": 5,
                              "min_cosched_share": 0.01, "min_time_share": 0.05, "target_ratio": 2.0,
                              "min_chunk_tokens": 64},
    "itl_spikes": {"long_prefill_tokens": 128, "host_stall_ratio": 2.0, "itl_spike_ratio": 3.0, "min_cause_share": 0.5,
                   "tpot_slo_s": 0.1, "fit_min_prefill_tokens": 32, "min_itl_samples": 500, "target_ratio": 2.0,
                   "min_chunk_tokens": 64},
    "ttft_queueing": {"queue_share": 0.5, "min_queue_p50_s": 0.05, "critical_queue_p50_s": 1.0},
    "decode_roofline": {"min_mbu": 0.3, "min_busy": 0.6, "target_mbu": 0.6, "min_steps": 10},
    "kv_near_cap": {"near_cap": 0.9, "min_preemptions": 1, "critical_preempt_share": 0.1},
    "kv_headroom_low": {"headroom_usage": 0.7},
    "kv_budget_oom_risk": {"max_kv_share_of_remaining": 0.8, "min_margin": 0.05},
    "kv_internal_fragmentation": {"max_internal_fragmentation": 0.25, "target_fragmentation": 0.1, "min_page_size": 16},
    "kv_external_fragmentation": {"max_external_fragmentation": 0.25, "max_blocked_share": 0.25,
                                  "min_turnover_per_s": 0.1, "min_snapshots_with_room": 20},
    "prefix_hit_collapse": {"min_achievable_hit_rate": 0.1, "max_hit_ratio": 0.5, "collapse_ratio": 0.5,
                            "min_window_hit_rate": 0.2},
    "tp_kv_imbalance": {"max_imbalance": 0.1, "critical_imbalance": 0.3},
    "tp_straggler": {"max_skew": 0.15, "min_straggler_share": 0.5, "min_steps": 10, "max_rows": 1000000},
    "tp_kv_head_replication": {"kv_dtype": "bf16"},
    "preemption_recompute": {"min_preemptions": 1, "critical_recompute_share": 0.2},
    "survival_rate": {"min_survival": 0.99, "critical_survival": 0.95, "in_flight_window_s": 60.0},
    "probe_dropping": {"max_drop_share": 0.0, "critical_drop_share": 0.01},
    "gpu_memory_near_full": {"max_used_share": 0.95, "critical_used_share": 0.98},
    "gpu_xid_errors": {"max_xid_errors": 0},
    "host_bound": {"min_host_gpu_ratio": 2.0, "min_busy_thread_cores": 0.9, "min_gpu_busy": 0.6, "min_cpu_wait_ratio": 0.35,
                   "min_throttled_ratio": 0.25, "min_busy_share": 0.25, "min_host_samples": 5},
    "process_memory_growth": {"min_rss_growth_mib_per_min": 8.0, "min_rss_growth_ratio": 0.1, "min_rss_r2": 0.8,
                              "min_rss_span_s": 60.0},
    "telemetry_degraded": {"telemetry_stale_s": 10, "max_clock_skew_s": 1.0, "min_stale_steps": 20},
    "prefix_miss_causes": {"prefix_miss_min_tokens": 256, "prefix_miss_cause_share": 0.05, "min_sub_page_tokens": 4,
                           "max_no_prefix_hit_rate": 0.1},
    "kv_evicted_before_reuse": {"evicted_reuse_share": 0.05},
    "history_rolled": {},
}


def test_threshold_defaults_are_pinned():
    assert dg.thresholds() == DEFAULTS
    for params in DEFAULTS.values():  # a default's type is what --set converts to
        for name, v in params.items():
            assert type(v) in (int, float, str), name


def _up(v: float | int, integer: bool) -> float | int:
    return v + 1 if integer else math.nextafter(v, math.inf)


def _down(v: float | int, integer: bool) -> float | int:
    return v - 1 if integer else math.nextafter(v, -math.inf)


def edges(x: float | int, op: str, integer: bool) -> tuple[Any, Any]:
    """(threshold at which the rule holds, threshold one step past it) for a rule `x <op> threshold`."""
    if op == ">=":
        return x, _up(x, integer)
    if op == ">":
        return _down(x, integer), x
    if op == "<":
        return _up(x, integer), x
    if op == "<=":
        return x, _down(x, integer)
    raise ValueError(op)


Get = Callable[[dict], Any]


def key(name: str) -> Get:
    return lambda e: e[name]


# (fixture, analyzer, finding id, threshold, measured figure, rule: the finding fires (or, with
#  severity="critical", is critical) while `figure <op> threshold`, other overrides)
CASES: list[tuple[str, str, str, str, Get, str, str | None, dict]] = [
    ("prefix-miss", "prefill_stalls_decode", "prefill-stalls-decode", "stall_ratio", key("stall_ratio"), ">=", None, {}),
    ("prefix-miss", "prefill_stalls_decode", "prefill-stalls-decode", "critical_ratio", key("stall_ratio"), ">=",
     "critical", {}),
    ("prefix-miss", "prefill_stalls_decode", "prefill-stalls-decode", "min_steps",
     lambda e: min(e["cosched_steps"], e["pure_decode_steps"]), ">=", None, {}),
    # the gate is either share: each case holds the other out of reach (a share is never above 1)
    ("prefix-miss", "prefill_stalls_decode", "prefill-stalls-decode", "min_cosched_share", key("cosched_share"), ">=",
     None, {"min_time_share": 2.0}),
    ("prefix-miss", "prefill_stalls_decode", "prefill-stalls-decode", "min_time_share", key("affected_share"), ">=",
     None, {"min_cosched_share": 2.0}),
    ("prefill-interference", "itl_spikes", "itl-spikes-prefill", "itl_spike_ratio",
     lambda e: e["itl_p99_ms"] / e["itl_p50_ms"], ">=", None, {}),
    ("kv-pressure", "itl_spikes", "itl-spikes-preemption", "min_cause_share", key("tail_preemption_share"), ">=",
     None, {}),
    ("prefill-interference", "itl_spikes", "itl-spikes-prefill", "min_itl_samples", key("itl_samples"), ">=", None, {}),
    ("queueing", "ttft_queueing", "ttft-queueing", "queue_share", key("queue_share_of_ttft"), ">=", None, {}),
    ("queueing", "ttft_queueing", "ttft-queueing", "min_queue_p50_s", key("queue_p50_s"), ">=", None, {}),
    ("queueing", "ttft_queueing", "ttft-queueing", "critical_queue_p50_s", key("queue_p50_s"), ">=", "critical", {}),
    ("decode-roofline", "decode_roofline", "decode-below-roofline", "min_mbu", key("mbu_p50"), "<", None, {}),
    ("decode-roofline", "decode_roofline", "decode-launch-bound", "min_busy", key("busy_fraction"), "<", None, {}),
    ("decode-roofline", "decode_roofline", "decode-below-roofline", "min_steps", key("decode_steps"), ">=", None, {}),
    ("prefix-miss-causes", "kv_near_cap", "kv-near-cap", "near_cap", key("block_usage_max"), ">=", None, {}),
    ("prefix-miss-causes", "kv_near_cap", "kv-near-cap", "min_preemptions", key("preemptions"), ">=", None, {}),
    ("kv-pressure", "kv_near_cap", "kv-near-cap", "critical_preempt_share", key("preempted_request_share"), ">=",
     "critical", {}),
    ("service-mix", "kv_headroom_low", "kv-headroom-low", "headroom_usage", key("block_usage_max"), ">=", None, {}),
    ("gpu-memory", "kv_budget_oom_risk", "kv-budget-oom-risk", "max_kv_share_of_remaining",
     key("kv_share_of_remaining"), ">", None, {"min_margin": 0.0}),
    ("gpu-memory", "kv_budget_oom_risk", "kv-budget-oom-risk", "min_margin", lambda e: e["split"]["margin"], "<",
     None, {"max_kv_share_of_remaining": 1.0}),
    ("internal-fragmentation", "kv_internal_fragmentation", "kv-internal-fragmentation", "max_internal_fragmentation",
     key("internal_fragmentation_mean"), ">=", None, {}),
    ("service-mix", "kv_external_fragmentation", "kv-external-fragmentation", "max_external_fragmentation",
     key("external_fragmentation_mean"), ">=", None, {}),
    ("service-mix", "kv_external_fragmentation", "kv-external-fragmentation", "max_blocked_share",
     key("blocked_share"), ">=", None, {}),
    ("service-mix", "kv_external_fragmentation", "kv-external-fragmentation", "min_turnover_per_s",
     key("turnover_per_s"), ">=", None, {}),
    # a blocked share of a handful of snapshots says nothing (the kv-pressure fixture has room 5 times in 902)
    ("service-mix", "kv_external_fragmentation", "kv-external-fragmentation", "min_snapshots_with_room",
     key("snapshots_with_room"), ">=", None, {}),
    ("prefix-miss", "prefix_hit_collapse", "prefix-hit-collapse", "min_achievable_hit_rate",
     key("achievable_hit_rate"), ">=", None, {}),
    ("tp-imbalance", "tp_kv_imbalance", "tp-kv-imbalance", "max_imbalance", key("kv_imbalance"), ">=", None, {}),
    ("tp-imbalance", "tp_kv_imbalance", "tp-kv-imbalance", "critical_imbalance", key("kv_imbalance"), ">=",
     "critical", {}),
    ("tp-imbalance", "tp_straggler", "tp-straggler", "max_skew", key("step_skew_p50"), ">=", None, {}),
    ("tp-imbalance", "tp_straggler", "tp-straggler", "min_straggler_share", key("straggler_share"), ">=", None, {}),
    ("tp-imbalance", "tp_straggler", "tp-straggler", "min_steps", key("steps"), ">=", None, {}),
    ("kv-pressure", "preemption_recompute", "preemption-recompute", "min_preemptions", key("preemptions"), ">=",
     None, {}),
    ("kv-pressure", "preemption_recompute", "preemption-recompute", "critical_recompute_share",
     key("recomputed_share_of_prefill"), ">=", "critical", {}),
    ("overload", "survival_rate", "survival-rate-low", "min_survival", key("survival_rate"), "<", None, {}),
    ("overload", "survival_rate", "survival-rate-low", "critical_survival", key("survival_rate"), "<", "critical", {}),
    ("overload", "probe_dropping", "probe-dropping", "max_drop_share", key("drop_share"), ">", None, {}),
    ("overload", "probe_dropping", "probe-dropping", "critical_drop_share", key("drop_share"), ">=", "critical", {}),
    ("gpu-memory", "gpu_memory_near_full", "gpu-memory-near-full", "max_used_share", key("mem_used_share_max"), ">=",
     None, {}),
    ("gpu-memory", "gpu_memory_near_full", "gpu-memory-near-full", "critical_used_share", key("mem_used_share_max"),
     ">=", "critical", {}),
    ("gpu-memory", "gpu_xid_errors", "gpu-xid-errors", "max_xid_errors", key("xid_errors_max"), ">", None, {}),
    ("host-bound", "host_bound", "host-bound", "min_cpu_wait_ratio", key("cpu_wait_ratio"), ">=", None, {}),
    ("host-bound", "host_bound", "host-bound", "min_busy_share", key("busy_share"), ">=", None, {}),
    ("host-bound", "host_bound", "host-bound", "min_host_samples", key("busy_samples"), ">=", None, {}),
    ("telemetry-silent", "telemetry_degraded", "telemetry-kv-snapshots-stopped", "telemetry_stale_s", key("silent_s"),
     ">=", None, {}),
    ("telemetry-silent", "telemetry_degraded", "telemetry-prefix-counters-stuck", "telemetry_stale_s",
     key("stuck_s"), ">=", None, {}),
    ("telemetry-silent", "telemetry_degraded", "telemetry-kv-snapshots-stopped", "min_stale_steps",
     key("steps_after"), ">=", None, {}),
    # the prefix counters need a quarter of min_stale_steps first admissions after their last move
    ("telemetry-silent", "telemetry_degraded", "telemetry-prefix-counters-stuck", "min_stale_steps",
     lambda e: 4 * e["admissions_after"] + 3, ">=", None, {}),
    ("prefix-miss-causes", "prefix_miss_causes", "prefix-miss-sub-page", "prefix_miss_min_tokens",
     key("total_missed_tokens"), ">=", None, {}),
    ("prefix-miss-causes", "prefix_miss_causes", "prefix-miss-sub-page", "prefix_miss_cause_share",
     key("cause_share"), ">=", None, {}),
    ("prefix-miss-causes", "prefix_miss_causes", "prefix-miss-evicted", "prefix_miss_cause_share",
     key("cause_share"), ">=", None, {}),
    ("prefix-miss-causes", "prefix_miss_causes", "prefix-miss-readmission", "prefix_miss_cause_share",
     key("cause_share"), ">=", None, {}),
    ("prefix-miss-causes", "prefix_miss_causes", "prefix-miss-sub-page", "min_sub_page_tokens",
     lambda e: e["sub-page"] / e["sub_page_lookups"], ">=", None, {}),
    ("prefix-miss-causes", "prefix_miss_causes", "prefix-miss-no-shared-prefix", "max_no_prefix_hit_rate",
     key("hit_rate"), "<", None, {}),
    ("prefix-miss-causes", "kv_evicted_before_reuse", "kv-evicted-before-reuse", "evicted_reuse_share",
     key("evicted_reuse_share"), ">=", None, {}),
]
IDS = [f"{c[2]}:{c[3]}" + (":critical" if c[6] else "") for c in CASES]


def _analyzer(name: str) -> Callable[..., list]:
    return next(fn for fn in dg.ANALYZERS if fn.__name__ == name)


def _run(con, run_id: str, name: str, **kw: Any) -> dict[str, Any]:
    """Findings of one analyzer by id, with the context diagnose gives it. On one DuckDB thread: a parallel
    float sum may differ in its last bit from call to call, and the boundaries here are one bit wide."""
    con.execute("SET threads = 1")
    fn = _analyzer(name)
    labels = read_run_info(con, run_id)
    context = {"model": geometry_from_labels(labels), "gpu": lookup(labels.get("gpu_name")), "labels": labels}
    params = inspect.signature(fn).parameters
    return {f.id: f for f in fn(con, run_id, **{k: v for k, v in {**context, **kw}.items() if k in params})}


@pytest.mark.parametrize("fixture,analyzer,fid,name,figure,op,severity,extra", CASES, ids=IDS)
def test_threshold_just_below_and_just_above(scenario, fixture, analyzer, fid, name, figure, op, severity, extra):
    con, run_id = scenario(fixture)
    base = _run(con, run_id, analyzer, **extra)
    assert fid in base, f"{fid} does not fire on {fixture} at the defaults"
    x = figure(base[fid].evidence)
    integer = isinstance(DEFAULTS[analyzer][name], int)
    holds, fails = edges(x, op, integer)
    at_holds = _run(con, run_id, analyzer, **{**extra, name: holds})
    at_fails = _run(con, run_id, analyzer, **{**extra, name: fails})
    # and well inside the firing side (a rule written `==` for `>=` holds at the boundary only)
    deep = (x - 1 if integer else x / 2) if op in (">=", ">") else (x + 1 if integer else x * 2 if x > 0 else 1.0)
    at_deep = _run(con, run_id, analyzer, **{**extra, name: deep})
    if severity is None:
        assert fid in at_holds, f"{name}={holds!r}: {fid} should fire ({x!r} {op} threshold)"
        assert fid not in at_fails, f"{name}={fails!r}: {fid} should not fire"
        assert fid in at_deep, f"{name}={deep!r}: {fid} should fire"
        assert at_holds[fid].thresholds[name] == holds  # the finding reports the threshold it was judged by
    else:
        assert at_holds[fid].severity == severity, f"{name}={holds!r}"
        assert at_deep[fid].severity == severity, f"{name}={deep!r}"
        assert fid in at_fails and at_fails[fid].severity != severity, f"{name}={fails!r}"


def test_every_gate_threshold_of_an_analyzer_that_fires_on_a_fixture_is_covered():
    """The thresholds CASES leaves out, each with the reason; a new threshold must be added to one or the other."""
    covered = {(c[1], c[3]) for c in CASES}
    untested = {  # covered elsewhere, or no committed fixture reaches the boundary
        ("prefill_stalls_decode", "long_prefill_tokens"): "test_long_prefill_tokens_filters_the_steps",
        ("prefill_stalls_decode", "target_ratio"): "test_suggest_chunk_values",
        ("prefill_stalls_decode", "min_chunk_tokens"): "test_suggest_chunk_values",
        ("itl_spikes", "long_prefill_tokens"): "attribution: tests/analyzers/test_itl.py",
        ("itl_spikes", "host_stall_ratio"): "attribution: tests/analyzers/test_itl.py",
        ("itl_spikes", "tpot_slo_s"): "severity with TPOT violations: tests/analyzers/test_itl.py",
        ("itl_spikes", "fit_min_prefill_tokens"): "the chunk fit: tests/analyzers/test_itl_chunking.py",
        ("itl_spikes", "target_ratio"): "the chunk fit: tests/analyzers/test_itl_chunking.py",
        ("itl_spikes", "min_chunk_tokens"): "the chunk fit: tests/analyzers/test_itl_chunking.py",
        ("decode_roofline", "target_mbu"): "suggestion only",
        ("kv_internal_fragmentation", "target_fragmentation"): "test_internal_fragmentation_page_choice",
        ("kv_internal_fragmentation", "min_page_size"): "test_internal_fragmentation_page_choice",
        ("prefix_hit_collapse", "max_hit_ratio"): "test_prefix_hit_ratio_boundary",
        ("prefix_hit_collapse", "collapse_ratio"): "no fixture collapses in time: not tested",
        ("prefix_hit_collapse", "min_window_hit_rate"): "no fixture collapses in time: not tested",
        ("tp_straggler", "max_rows"): "sampling: tests/analyzers (tp) not a threshold of the verdict",
        ("tp_kv_head_replication", "kv_dtype"): "a dtype, not a threshold",
        ("host_bound", "min_host_gpu_ratio"): "launch-bound host: tests/analyzers/test_host_rules.py",
        ("host_bound", "min_busy_thread_cores"): "launch-bound host: tests/analyzers/test_host_rules.py",
        ("host_bound", "min_throttled_ratio"): "throttled container: tests/analyzers/test_host_rules.py",
        ("host_bound", "min_gpu_busy"): "the H100 host-bound run: tests/analyzers/test_gpu_matrix.py",
        ("process_memory_growth", "min_rss_growth_mib_per_min"): "tests/analyzers/test_host_rules.py",
        ("process_memory_growth", "min_rss_growth_ratio"): "tests/analyzers/test_host_rules.py",
        ("process_memory_growth", "min_rss_r2"): "tests/analyzers/test_host_rules.py",
        ("process_memory_growth", "min_rss_span_s"): "tests/analyzers/test_host_rules.py",
        ("telemetry_degraded", "max_clock_skew_s"): "tests/analyzers/test_telemetry.py",
        ("survival_rate", "in_flight_window_s"): "tests/analyzers/test_in_flight.py (a live reader's clock)",
    }
    every = {(a, n) for a, params in DEFAULTS.items() for n in params}
    assert covered | set(untested) == every
    assert not covered & set(untested)


def test_suggest_chunk_values():
    # (target - 1) x pure decode ms / ms per prefill token = (2 - 1) * 10 / 0.05 = 200 -> 192 at pages of 16
    assert suggest_chunk(10.0, 0.05, 2.0, 16, 4096) == 192
    assert suggest_chunk(10.0, 0.05, 3.0, 16, 4096) == 400  # 2 * 10 / 0.05
    assert suggest_chunk(10.0, 0.05, 2.0, 32, 4096) == 192  # 200 // 32 * 32
    assert suggest_chunk(10.0, 1.0, 2.0, 16, 4096) == 64  # 10 tokens, raised to min_chunk 64
    assert suggest_chunk(10.0, 1.0, 2.0, 16, 4096, min_chunk=96) == 96
    assert suggest_chunk(10.0, 1.0, 2.0, 128, 4096) == 128  # never below one page
    assert suggest_chunk(10.0, 0.001, 2.0, 16, 1000) == 992  # capped below the largest prefill: (1000-1)//16*16
    assert suggest_chunk(10.0, 0.001, 2.0, 16, 993) == 992
    assert suggest_chunk(10.0, 0.001, 2.0, 16, 992) == 976
    assert suggest_chunk(10.0, None, 2.0, 16, 2000) == 512  # no slope: half the largest prefill, at most 512
    assert suggest_chunk(10.0, 0.0, 2.0, 16, 600) == 288  # 600 // 2 // 16 * 16
    assert suggest_chunk(10.0, -1.0, 2.0, 64, 100) == 64  # at least a page
    assert suggest_chunk(10.0, -0.5, 2.0, 16, 2000) == 512  # any slope <= 0 means no fit: the fallback
    assert suggest_chunk(10.0, 1.0, 2.0, 1, 4096) == 64  # min_chunk's default, at pages of one token
    assert type(suggest_chunk(10.0, None, 2.0, 16, 601)) is int and suggest_chunk(10.0, None, 2.0, 16, 601) == 288


def test_long_prefill_tokens_filters_the_steps(scenario):
    con, run_id = scenario("prefill-interference")
    steps = con.execute("""SELECT prefill_tokens FROM steps JOIN sources USING (source_id)
                           WHERE run_id = ? AND decode_tokens > 0 AND prefill_tokens > 0""", [run_id]).fetchall()
    values = sorted({p for (p,) in steps})
    long = values[len(values) // 3]  # a prefill size the run has, with >= 5 co-scheduled steps at or above it
    for t, want in ((long, sum(p >= long for (p,) in steps)), (long + 1, sum(p > long for (p,) in steps))):
        f = _run(con, run_id, "prefill_stalls_decode", long_prefill_tokens=t)["prefill-stalls-decode"]
        assert f.evidence["cosched_steps"] == want
    assert sum(p == long for (p,) in steps) >= 1  # the two thresholds select different steps


def test_internal_fragmentation_page_choice(scenario):
    con, run_id = scenario("internal-fragmentation")
    f = _run(con, run_id, "kv_internal_fragmentation")["kv-internal-fragmentation"]
    waste = f.evidence["predicted_waste_by_page_size"]
    assert sorted(waste) == [16, 32, 64, 128, 256]
    # the largest smaller page whose predicted waste is <= target_fragmentation
    for page in (128, 64, 32):
        at = _run(con, run_id, "kv_internal_fragmentation", target_fragmentation=waste[page])
        assert at["kv-internal-fragmentation"].evidence["suggested_page_size"] == page
        below = _run(con, run_id, "kv_internal_fragmentation", target_fragmentation=math.nextafter(waste[page], 0))
        assert below["kv-internal-fragmentation"].evidence["suggested_page_size"] < page
    # none good enough: the smallest candidate, which min_page_size bounds
    none = _run(con, run_id, "kv_internal_fragmentation", target_fragmentation=0.0, min_page_size=64)
    assert none["kv-internal-fragmentation"].evidence["suggested_page_size"] == 64
    assert set(none["kv-internal-fragmentation"].evidence["predicted_waste_by_page_size"]) == {64, 128, 256}
    only = _run(con, run_id, "kv_internal_fragmentation", target_fragmentation=0.0, min_page_size=129)
    assert only["kv-internal-fragmentation"].evidence["suggested_page_size"] == 256  # no smaller candidate


def test_prefix_hit_ratio_boundary(scenario):
    """prefix-miss: no request hit (request hit rate 0): it fires for any max_hit_ratio > 0, not at 0."""
    con, run_id = scenario("prefix-miss")
    assert _run(con, run_id, "prefix_hit_collapse")["prefix-hit-collapse"].evidence["request_hit_rate"] == 0.0
    assert "prefix-hit-collapse" in _run(con, run_id, "prefix_hit_collapse", max_hit_ratio=1e-300)
    assert "prefix-hit-collapse" not in _run(con, run_id, "prefix_hit_collapse", max_hit_ratio=0.0)


# --- the prefill-stall ratio at its default, on a stated store ---

def _stall_store(path: str, cosched_ms: float, pure: int = 20, cosched: int = 8) -> str:
    """`pure` decode steps of 10 ms, then `cosched` decode steps each next to a 256-token prefill taking `cosched_ms`."""
    store = Store(path)
    try:
        sid = store.register_source(ev.Hello(1_000_000_000, 0, 1, 0, 1, "stall", "m", "module"))
        steps = [ev.Step(1_000_000_000 + i * 20_000_000, i, 0, ev.PHASE_DECODE, 4, 0, 4, 512, 10.0, math.nan)
                 for i in range(pure)]
        steps += [ev.Step(2_000_000_000 + i * 50_000_000, pure + i, 0, ev.PHASE_MIXED, 5, 256, 4, 512, cosched_ms,
                          math.nan) for i in range(cosched)]
        store.append([(sid, steps)])
    finally:
        store.close()
    return "stall"


@pytest.mark.parametrize("cosched_ms,fires", [(29.99, False), (30.0, True), (99.99, True)])
def test_prefill_stall_ratio_at_its_default(tmp_path, cosched_ms, fires):
    path = str(tmp_path / "s.duckdb")
    run_id = _stall_store(path, cosched_ms)
    con = duckdb.connect(path, read_only=True)
    try:
        found = prefill_stalls_decode(con, run_id)
        assert bool(found) is fires
        if fires:
            (f,) = found
            assert f.evidence["stall_ratio"] == pytest.approx(cosched_ms / 10.0, rel=1e-12)
            assert (f.evidence["pure_decode_steps"], f.evidence["cosched_steps"]) == (20, 8)
            assert f.evidence["page_size"] == 16  # no KV snapshots in this store: pages of 16 are assumed
            assert "(p95 now 0.0 ms)" in f.expected_effect  # no requests in this store: no TPOT, said as 0
            assert f.severity == ("critical" if cosched_ms >= 100.0 else "warning")
    finally:
        con.close()


def test_prefill_stall_critical_at_its_default(tmp_path):
    path = str(tmp_path / "c.duckdb")
    run_id = _stall_store(path, 100.0)
    con = duckdb.connect(path, read_only=True)
    try:
        assert prefill_stalls_decode(con, run_id)[0].severity == "critical"  # 10.0x: critical_ratio 10 holds
    finally:
        con.close()


def test_chunked_prefill_from_labels():
    assert chunked_prefill(None) == (None, None) and chunked_prefill({}) == (None, None)
    assert chunked_prefill({"enable_chunked_prefill": "True", "max_num_batched_tokens": "2048"}) == (True, 2048)
    assert chunked_prefill({"enable_chunked_prefill": "false", "max_num_batched_tokens": "512.0"}) == (False, 512)
    assert chunked_prefill({"enable_chunked_prefill": "on"}) == (True, None)
    assert chunked_prefill({"runtime": "hf-cb"}) == (True, None)  # HF continuous batching always splits prompts
    assert chunked_prefill({"runtime": "cb", "max_batch_tokens": "256"}) == (True, 256)
    assert chunked_prefill({"max_batch_tokens": "96"}) == (True, 96)
    assert chunked_prefill({"runtime": "vllm", "max_num_batched_tokens": "lots"}) == (None, None)  # not a number


def test_chunk_suggestion_branches_at_the_budget():
    at = chunk_suggestion(256, True, 256)  # budget at the chunk: chunking is not the lever
    assert at.startswith("Chunked prefill is already on with a per-step budget of 256 tokens") and "disaggregation" in at
    assert chunk_suggestion(256, True, 128).startswith("Chunked prefill is already on with a per-step budget of 128")
    above = chunk_suggestion(256, True, 257)
    assert above.startswith("Chunked prefill is on") and "lower it to ~256 tokens" in above and "(now 257)" in above
    unknown = chunk_suggestion(256, True, None)
    assert "lower it to ~256 tokens" in unknown and "(now" not in unknown
    off = chunk_suggestion(256, False, 128)  # off: enable it, whatever the budget label says
    assert off.startswith("Enable chunked prefill with a chunk of ~256 tokens")
    assert chunk_suggestion(256, None, None).startswith("Enable chunked prefill")


def test_prefill_stall_effect_states_the_predicted_step(scenario):
    con, run_id = scenario("prefill-interference")
    f = _run(con, run_id, "prefill_stalls_decode")["prefill-stalls-decode"]
    e = f.evidence
    expected_ms = e["pure_decode_p50_ms"] + e["ms_per_prefill_token"] * e["suggested_chunk_tokens"]
    assert f"keeps them near {expected_ms:.1f} ms (~{expected_ms / e['pure_decode_p50_ms']:.1f}x)" in f.expected_effect
    assert f"(p95 now {e['tpot_p95_s'] * 1e3:.1f} ms)" in f.expected_effect
    # the figures behind it, from the raw steps: the co-scheduled share and the median extra ms per prefill token
    rows = con.execute("""SELECT CASE WHEN isnan(gpu_ms) THEN host_ms ELSE gpu_ms END, prefill_tokens, decode_tokens
                          FROM steps JOIN sources USING (source_id) WHERE run_id = ?""", [run_id]).fetchall()
    co = [(ms, p) for ms, p, d in rows if d > 0 and p >= 128]
    assert e["cosched_share"] == len(co) / sum(1 for _, _, d in rows if d > 0)
    median = statistics.median((ms - e["pure_decode_p50_ms"]) / p for ms, p in co)  # = quantile_cont(., 0.5)
    assert e["ms_per_prefill_token"] == pytest.approx(max(median, 0.0), rel=1e-9) and 0 < median < 1


def test_prefill_stall_needs_min_steps_of_each_kind(tmp_path):
    """Both counts gate: 5 pure decode steps against 8 co-scheduled ones, and none co-scheduled at all."""
    few_pure = _stall_store(str(tmp_path / "p.duckdb"), 40.0, pure=5, cosched=8)
    con = duckdb.connect(str(tmp_path / "p.duckdb"), read_only=True)
    try:
        assert prefill_stalls_decode(con, few_pure, min_steps=6) == []
        assert len(prefill_stalls_decode(con, few_pure, min_steps=5)) == 1
    finally:
        con.close()
    for name, pure, cosched in (("n", 20, 0), ("z", 0, 8)):  # none of one kind: silent even at min_steps 1
        run = _stall_store(str(tmp_path / f"{name}.duckdb"), 40.0, pure=pure, cosched=cosched)
        con = duckdb.connect(str(tmp_path / f"{name}.duckdb"), read_only=True)
        try:
            assert prefill_stalls_decode(con, run, min_steps=1) == []
        finally:
            con.close()
