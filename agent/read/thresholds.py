"""The one table of thresholds that the analyzers, the dashboard and the alert rules share.

It lives in the read layer so that the named queries' defaults use it too. Each value is the
default of the analyzer parameter of the same name (`diagnose --set NAME=VALUE`
overrides it for a run), the line the dashboard draws, and the number `phasescope rules` writes
into the Prometheus alerts. Units are in the names (`_s`, `_tokens`) or stated.
"""

from __future__ import annotations

from typing import NamedTuple


class Threshold(NamedTuple):
    value: float
    unit: str
    doc: str


THRESHOLDS: dict[str, Threshold] = {
    "ttft_slo_s": Threshold(2.5, "s", "TTFT service-level objective: a request's first token within this time"),
    "tpot_slo_s": Threshold(0.1, "s", "TPOT service-level objective: at most this time per output token"),
    "long_prefill_tokens": Threshold(128, "tokens", "a prefill of at least this many tokens in one step is long"),
    "host_stall_ratio": Threshold(2.0, "ratio", "an inter-token gap this many times its step's compute time (GPU "
                                  "time, else the forward's host time) is a host stall"),
    "itl_spike_ratio": Threshold(3.0, "ratio", "p99 ITL this many times the median ITL is a tail worth explaining"),
    "min_cause_share": Threshold(0.5, "fraction", "share of the ITL tail's time over the median one cause must hold "
                                 "to be named"),
    "fit_min_prefill_tokens": Threshold(32, "tokens", "steps prefilling at least this many tokens fit the ms per "
                                        "prefill token"),
    "near_cap": Threshold(0.9, "fraction", "KV block usage at which the cache counts as at its cap"),
    "max_internal_fragmentation": Threshold(0.25, "fraction", "slack inside allocated KV pages worth a finding"),
    "max_external_fragmentation": Threshold(0.25, "fraction", "scattered free KV pages worth a finding"),
    "collapse_ratio": Threshold(0.5, "ratio", "prefix hit rate below this share of its usual level has collapsed"),
    "min_window_hit_rate": Threshold(0.2, "fraction", "a prefix hit rate below this was never worth watching"),
    "max_imbalance": Threshold(0.1, "ratio", "tensor-parallel KV imbalance, max_r / mean_r - 1"),
    "max_skew": Threshold(0.15, "ratio", "tensor-parallel step skew, max_r / median_r - 1"),
    "min_straggler_share": Threshold(0.5, "fraction", "share of steps one rank is the slowest to call it a straggler"),
    "max_used_share": Threshold(0.95, "fraction", "GPU memory used share worth a finding"),
    "min_cpu_wait_ratio": Threshold(0.35, "fraction", "share of the time the server's busiest thread wants a CPU "
                                    "that it waits on the run queue (starved of CPU)"),
    "min_throttled_ratio": Threshold(0.25, "fraction", "share of CFS periods in which the container is CPU-throttled"),
    "min_rss_growth_mib_per_min": Threshold(8.0, "MiB/min", "steady server RSS growth worth a leak suspicion"),
    "telemetry_stale_s": Threshold(10, "s", "steps flowing this long without KV snapshots / prefix counter "
                                   "movement / GPU-timed steps: that telemetry has stopped being true"),
    "prefix_miss_min_tokens": Threshold(256, "tokens", "missed prompt tokens a run needs before their causes are judged"),
    "prefix_miss_cause_share": Threshold(0.05, "fraction", "share of the missed prompt tokens one avoidable cause "
                                         "(sub-page, evicted, in-flight, re-admission, cache off) must explain"),
    "min_sub_page_tokens": Threshold(4, "tokens", "mean shared tokens lost inside a partly shared page, per lookup "
                                     "that loses any, worth a smaller page"),
    "max_no_prefix_hit_rate": Threshold(0.1, "fraction", "first-admission hit rate below which misses with no "
                                        "shared prefix at all are reported"),
    "evicted_reuse_share": Threshold(0.05, "fraction", "share of the queried prompt tokens missed because their "
                                     "pages were evicted before reuse, worth a larger cache"),
    "max_clock_skew_s": Threshold(1.0, "s", "a probe's wall clock this far from the sidecar's at connect is skewed"),
}


def value(name: str) -> float:
    """The default of threshold `name` (KeyError for an unknown one)."""
    return THRESHOLDS[name].value


T = {name: t.value for name, t in THRESHOLDS.items()}  # name -> default, for signatures
