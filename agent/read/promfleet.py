"""The fleet's figures as PromQL over the series every sidecar's /metrics serves (issue 51).

One table, two users: the recording rules shipped beside the alert rules (`exporters/fleet_rules.yml`,
`phasescope rules --fleet`: per model, deployment and pod over 5 minutes) and `phasescope diagnose --prometheus`
(per pod over the range asked for, from the raw series, so it works on a Prometheus without the rules). Each
expression is a template: `BY` the grouping labels, `RANGE` the window, `SEL` the extra label matchers (a
selector's inside, `namespace="prod"`).

Figures match the Parquet path's (`analyzers/fleet.py` HOST_SQL) where a series allows it; quantiles come from
the histograms' buckets (Prometheus interpolates inside a bucket, the Parquet path takes the exact quantile), so
the two paths agree on which pod stands out, not to the last digit. The prefill time per 1000 tokens has no
series (the step histograms do not split by prefill size) and is the Parquet path's alone.
"""

from __future__ import annotations

from typing import NamedTuple

from .thresholds import T

RECORD_BY = "model, deployment, pod"  # the recording rules' grouping: labels the scrape config attaches
RECORD_RANGE = "5m"


class Figure(NamedTuple):
    name: str  # the Parquet path's figure name where it has one (analyzers/fleet.py HOST_SQL)
    record: str  # the recording rule's name
    expr: str  # PromQL template: {by}, {range}, {sel}
    unit: str
    what: str
    scale: float = 1.0  # the query's value (base units, as recorded) x this = the figure in `unit`


def _hq(q: float, metric: str, matcher: str = "") -> str:
    return f"histogram_quantile({q}, sum by (BY, le) (rate({metric}_bucket{{{matcher}SEL}}[RANGE])))"


# the figures an outlier is named on: more is worse for each
FIGURES: tuple[Figure, ...] = (
    Figure("decode_step_ms_p50", "phasescope_fleet:decode_step_seconds:p50",
           _hq(0.5, "phasescope_step_host_seconds", 'phase="decode"'), "ms",
           "median decode step time (host)", 1000.0),
    Figure("ttft_s_p90", "phasescope_fleet:ttft_seconds:p90",
           _hq(0.9, "gen_ai_server_time_to_first_token_seconds"), "s", "90th percentile time to first token"),
    Figure("tpot_s_p50", "phasescope_fleet:tpot_seconds:p50",
           _hq(0.5, "gen_ai_server_time_per_output_token_seconds"), "s", "median time per output token"),
    Figure("kv_block_usage_mean", "phasescope_fleet:kv_block_usage:avg",
           "avg by (BY) (avg_over_time(phasescope_kv_block_usage_ratio{SEL}[RANGE]))",
           "fraction", "mean KV block usage"),
    Figure("dropped_record_fraction", "phasescope_fleet:probe_dropped:ratio",
           "sum by (BY) (increase(phasescope_probe_dropped_records_total{SEL}[RANGE]))"
           " / sum by (BY) (increase(phasescope_probe_records_total{SEL}[RANGE]))",
           "fraction", "records the probes dropped"),
)

# the figures a cause is read from (per pod); recorded too, for dashboards
SIGNALS: tuple[Figure, ...] = (
    Figure("kv_block_usage_max", "phasescope_fleet:kv_block_usage:max",
           "max by (BY) (max_over_time(phasescope_kv_block_usage_ratio{SEL}[RANGE]))",
           "fraction", "peak KV block usage"),
    Figure("kv_external_fragmentation_mean", "phasescope_fleet:kv_external_fragmentation:avg",
           "avg by (BY) (avg_over_time(phasescope_kv_external_fragmentation_ratio{SEL}[RANGE]))",
           "fraction", "mean KV external fragmentation"),
    Figure("preemptions", "phasescope_fleet:preemptions:increase",
           "sum by (BY) (increase(phasescope_request_preemptions_total{SEL}[RANGE]))",
           "preemptions", "preemptions in the window"),
    # the host-bound analyzer's figure (analyzers/host.py PROCESS_SQL), over the same samples: of the time the
    # busiest thread wanted a CPU (ran or waited) in the samples where it wanted one at least half the time, the
    # share it waited. And the share of samples in which it wanted one at least half the time (an engine idle most
    # of the range is not limited by its host)
    Figure("cpu_wait_ratio", "phasescope_fleet:busiest_thread_cpu_wait:ratio",
           "max by (BY) (sum_over_time((phasescope_process_busiest_thread_cpu_wait_ratio{SEL}"
           " and (phasescope_process_busiest_thread_cpu_ratio{SEL}"
           " + phasescope_process_busiest_thread_cpu_wait_ratio{SEL} >= 0.5))[RANGE:])"
           " / sum_over_time((phasescope_process_busiest_thread_cpu_ratio{SEL}"
           " + phasescope_process_busiest_thread_cpu_wait_ratio{SEL} >= 0.5)[RANGE:]))",
           "fraction", "of the time the server's busiest thread wanted a CPU (its busy samples), the share it waited"),
    Figure("busy_share", "phasescope_fleet:busiest_thread_busy:share",
           "max by (BY) (avg_over_time(((phasescope_process_busiest_thread_cpu_ratio{SEL}"
           " + phasescope_process_busiest_thread_cpu_wait_ratio{SEL}) >= bool 0.5)[RANGE:]))",
           "fraction", "share of samples in which the busiest thread wanted a CPU at least half the time"),
    Figure("long_prefill_itl_share", "phasescope_fleet:itl_long_prefill:share",
           "sum by (BY) (rate(phasescope_inter_token_latency_long_prefill_seconds_count{SEL}[RANGE]))"
           " / sum by (BY) (rate(phasescope_inter_token_latency_seconds_count{SEL}[RANGE]))",
           "fraction", "share of inter-token gaps ended by a step with a long prefill"),
    Figure("long_prefill_itl_p90", "phasescope_fleet:itl_long_prefill_seconds:p90",
           _hq(0.9, "phasescope_inter_token_latency_long_prefill_seconds"), "s",
           "90th percentile of the gaps ended by a long prefill"),
    Figure("itl_p50", "phasescope_fleet:itl_seconds:p50", _hq(0.5, "phasescope_inter_token_latency_seconds"), "s",
           "median inter-token latency"),
    Figure("ttft_p90_first_quarter", "", _hq(0.9, "gen_ai_server_time_to_first_token_seconds"), "s",
           "TTFT p90 over the first quarter of the range (the window offset to its start)"),
    Figure("ttft_p90_last_quarter", "", _hq(0.9, "gen_ai_server_time_to_first_token_seconds"), "s",
           "TTFT p90 over the last quarter of the range"),
    Figure("probe_cost_ratio", "phasescope_fleet:probe_cost:avg",
           "max by (BY) (avg_over_time(phasescope_probe_cost_ratio{SEL}[RANGE]))",
           "fraction", "the probe's own share of the engine's time"),
    Figure("dp_kv_imbalance", "phasescope_fleet:dp_kv_imbalance:ratio",
           "max by (BY) (vllm:kv_cache_usage_perc{SEL}) / clamp_min(avg by (BY) "
           "(vllm:kv_cache_usage_perc{SEL}), 1e-9) - 1", "ratio",
           "data-parallel engines' KV usage, max / mean - 1 (vLLM's own gauge)"),
)

# cause -> what shows it (thresholds: agent/read/thresholds.py, the analyzers' own)
CAUSE_TEXT = {
    "kv-bound": f"KV cache at its cap (peak usage >= {T['near_cap']:g}) or requests preempted",
    "host-bound": f"the server's busiest thread waited for a CPU >= {T['min_cpu_wait_ratio']:.0%} of the time it "
                  "wanted one, busy in >= 25% of the samples",
    "prefill-interference": "long prefills end a share of the inter-token gaps, and those gaps are "
                            f">= {T['itl_spike_ratio']:g}x the median",
    "degrading": "TTFT p90 over the last quarter of the range is >= 1.5x the first quarter's",
}


def render(expr: str, by: str, range_: str, selector: str = "") -> str:
    """`expr` with its grouping, window and extra matchers filled in (`selector`: `{a="b"}` or `a="b"` or '')."""
    inner = selector.strip()
    if inner.startswith("{") and inner.endswith("}"):
        inner = inner[1:-1].strip()
    text = expr.replace("BY", by).replace("RANGE", range_)
    text = text.replace('"SEL}', f'", {inner}}}' if inner else '"}')  # after a matcher of the expression's own
    return text.replace("{SEL}", f"{{{inner}}}" if inner else "")


def offset(expr: str, by: str, range_: str, offset_: str, selector: str = "") -> str:
    """`expr` rendered over `range_` ending `offset_` ago (every range vector selector offset)."""
    text = render(expr, by, range_, selector)
    return text.replace(f"[{range_}])", f"[{range_}] offset {offset_})")


def recording_rules() -> str:
    """The fleet recording rules (a Prometheus rule file's text), per `RECORD_BY` over `RECORD_RANGE`."""
    lines = ["# phasescope fleet recording rules (Prometheus 2.x rule file; `phasescope rules --fleet` prints it).",
             "# Generated from agent/read/promfleet.py: the same PromQL `phasescope diagnose --prometheus` reads.",
             f"# Per {RECORD_BY} (labels your scrape config attaches: a pod's own name, its Deployment's)",
             f"# over {RECORD_RANGE}. Keep label cardinality bounded: pod, model, rank, engine, phase; the",
             "# sidecar's own top-N guard caps the rest.",
             "groups:", "  - name: phasescope-fleet-recording", "    rules:"]
    for f in FIGURES + SIGNALS:
        if not f.record:
            continue
        lines.append(f"      - record: {f.record}")
        lines.append(f"        expr: {render(f.expr, RECORD_BY, RECORD_RANGE)}")
    # step-time quantiles by phase (every phase, not only decode)
    for q, tag in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
        lines.append(f"      - record: phasescope_fleet:step_seconds:{tag}")
        lines.append("        expr: " + render(_hq(q, "phasescope_step_host_seconds"), RECORD_BY + ", phase",
                                               RECORD_RANGE))
    recorded = {f.record for f in FIGURES + SIGNALS}
    for q, tag in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99")):
        for what, metric in (("ttft", "gen_ai_server_time_to_first_token_seconds"),
                             ("tpot", "gen_ai_server_time_per_output_token_seconds")):
            record = f"phasescope_fleet:{what}_seconds:{tag}"
            if record not in recorded:
                lines.append(f"      - record: {record}")
                lines.append("        expr: " + render(_hq(q, metric), RECORD_BY, RECORD_RANGE))
    lines.append("      - record: phasescope_fleet:prefix_hit:ratio")
    lines.append(f"        expr: sum by ({RECORD_BY}) (rate(phasescope_prefix_hit_tokens_total[{RECORD_RANGE}]))"
                 f" / sum by ({RECORD_BY}) (rate(phasescope_prefix_queried_tokens_total[{RECORD_RANGE}]))")
    return "\n".join(lines) + "\n"
