"""Skew across data-parallel engines as a load-sweep constraint (issue 28): its figures, verdict and change.

The figures are the read layer's (agent/read/dp.py `dp_balance`: time-weighted per-engine KV usage and waiting
requests from vLLM's per-engine gauges, their `max/mean - 1` indexes, the share of the time the hottest engine was
at its cap or queueing while another had headroom). An engine of the run's `dp` that sent no gauge sample
because it never stepped counts as idle (0 KV, 0 waiting); one missing for any other reason (a gap) leaves no
figure, and the skew is then not claimed: its figures say which engine and why. The skew binds when either
index is >= `max_dp_imbalance` and that stranded share is >= `min_dp_stranded_share`: an uneven spread that
never left one engine waiting while another idled does not limit the load.

vLLM's API server spreads requests over its engines itself (vllm/v1/engine/core_client.py, the DP client's
`get_core_engine_for_request`: the engine with the lowest waiting + running score, waiting weighted by KV usage)
unless a request names one with the `X-data-parallel-rank` header (vllm/entrypoints/generate/base/serving.py) or
an external router places them (`--data-parallel-external-lb`, `--data-parallel-hybrid-lb`): a skew is pinned
routing or an outside router's, and the change says which to stop or fix (vLLM 0.32.0's flags).
"""

from __future__ import annotations

from typing import Any

from phasescope.agent.read.dp import dp_balance


def dp_skew(con: Any, run_id: str, runtime: str, near_cap: float, max_dp_imbalance: float,
            min_dp_stranded_share: float) -> tuple[bool, dict[str, Any], str]:
    """(binds, figures, change) of the DP skew of one run; figures' shares are fractions of the time, usage 0..1."""
    b = dp_balance(con, run_id, near_cap)
    figs: dict[str, Any] = {"engines": b["engines"]}
    if b["gaps"]:  # an expected engine's gauges are missing for a reason other than idleness: no claim
        figs.update(expected_engines=b["expected_engines"], engines_without_figures=b["gaps"])
        return False, figs, ""
    if b["engines"] < 2 or b["kv_imbalance"] is None:
        return False, figs, ""
    e = b["by_engine"]
    figs.update(expected_engines=b["expected_engines"], idle_engines=b["idle_engines"],
                kv_imbalance=b["kv_imbalance"], waiting_imbalance=b["waiting_imbalance"], hot_engine=b["hot_engine"],
                stranded_share=b["stranded_share"], span_s=b["span_s"], samples=b["samples"], source=b["source"],
                kv_usage_mean_by_engine={k: v["usage_mean"] for k, v in e.items()},
                waiting_mean_by_engine={k: v["waiting_mean"] for k, v in e.items()},
                busy_share_by_engine={k: v["busy_share"] for k, v in e.items()},
                headroom_share_by_engine={k: v["headroom_share"] for k, v in e.items()})
    imb = max(b["kv_imbalance"], b["waiting_imbalance"])
    binds = imb >= max_dp_imbalance and (b["stranded_share"] or 0) >= min_dp_stranded_share
    hot, n = b["hot_engine"], b["engines"]
    usage = [v["usage_mean"] for v in e.values()]
    facts = (f"engine {hot} held a mean KV usage of {e[hot]['usage_mean']:.0%} and {e[hot]['waiting_mean']:.2f} "
             f"waiting requests against {sum(usage) / n:.0%} and {sum(v['waiting_mean'] for v in e.values()) / n:.2f} "
             f"over the {n} engines, and was at its cap or queueing while another had headroom "
             f"{b['stranded_share']:.0%} of the time")
    if b["idle_engines"]:
        facts += (f"; engine{'s' if len(b['idle_engines']) > 1 else ''} "
                  f"{', '.join(map(str, b['idle_engines']))} sent no sample: never stepped (its probe recorded no "
                  "step or request), counted idle at 0% KV and 0 waiting")
    if runtime == "vllm":
        change = (f"spread requests over the {n} engines: stop pinning them with the X-data-parallel-rank request "
                  "header (vLLM's API server then sends each request to its least loaded engine); behind an external "
                  "router (--data-parallel-external-lb or --data-parallel-hybrid-lb) route by each engine's "
                  f"vllm:num_requests_waiting and vllm:kv_cache_usage_perc. Now {facts}; balanced, each engine "
                  f"would hold ~{sum(usage) / n:.0%}")
    else:
        change = f"route requests to the least loaded engine (by waiting requests and KV usage); now {facts}"
    return binds, figs, change
