"""TTFT dominated by queueing: requests wait to be scheduled longer than their prefill takes."""

from __future__ import annotations

from .findings import Finding, ref
from .runinfo import budget_knob, runtime_of
from .sql import RUN_STEPS, one

QUEUE_SQL = """SELECT count(*) AS requests,
           quantile_cont(ttft_s, 0.5) AS ttft_p50_s, quantile_cont(ttft_s, 0.95) AS ttft_p95_s,
           quantile_cont(queue_s, 0.5) AS queue_p50_s, quantile_cont(queue_s, 0.95) AS queue_p95_s,
           quantile_cont(prefill_s, 0.5) AS prefill_p50_s, quantile_cont(prefill_s, 0.95) AS prefill_p95_s,
           sum(queue_s) / sum(ttft_s) AS queue_share_of_ttft,
           count(*) / nullif((max(arrival_ns) - min(arrival_ns)) / 1e9, 0) AS arrival_rate_per_s,
           (max(arrival_ns) - min(arrival_ns)) / 1e9 AS arrival_span_s,
           -- the window the prompts had to be prefilled in: first arrival to last first token (a burst of
           -- arrivals within microseconds would otherwise give an absurd rate)
           (max(first_token_ns) - min(arrival_ns)) / 1e9 AS demand_window_s,
           sum(prompt_tokens - coalesce(cached_tokens, 0))
               / nullif((max(first_token_ns) - min(arrival_ns)) / 1e9, 0) AS prefill_demand_tokens_per_s
    FROM requests WHERE run_id = $run AND ttft_s IS NOT NULL"""

CAPACITY_SQL = f"""WITH st AS ({RUN_STEPS})
    SELECT sum(prefill_tokens) / (sum(ms) / 1e3) AS prefill_capacity_tokens_per_s,
           max(prefill_tokens) AS max_prefill_tokens_per_step,
           count(*) FILTER (WHERE prefill_tokens + decode_tokens >= 0.9 * (SELECT max(prefill_tokens + decode_tokens) FROM st))
               / count(*) AS budget_saturated_share
    FROM st WHERE prefill_tokens > 0"""


def queueing_suggestion(e: dict, raise_budget: bool) -> str:
    """The advice, in the knobs of the run's runtime (`e["runtime"]`); without raising the per-step token budget
    when a larger step would stall decode. Static-batch HF generate has no such budget: requests wait for the
    batch ahead, so the knob is continuous batching or the batch size."""
    runtime = e.get("runtime") or ""
    if runtime == "hf-generate":
        return ("Requests wait for the whole static batch ahead of them (HF generate): serve with continuous batching "
                "(model.generate_batch / init_continuous_batching, or vLLM) so a new request joins at the next step; "
                "with static batches, smaller batches shorten that wait and more replicas serve batches side by side. "
                "Reject or redirect new requests at the door when the queue grows (overload protection).")
    if raise_budget:
        first = (f"Add prefill capacity: raise the per-step token budget ({budget_knob(runtime)}; the largest step "
                 f"prefilled {e['max_prefill_tokens_per_step']} tokens), add replicas, or disaggregate")
    else:
        first = ("Add prefill capacity without larger steps (they already stall decode, see prefill-stalls-decode, "
                 "so keep the per-step token budget): add replicas, or disaggregate")
    return (first + " prefill and decode onto separate instances so prefill scales on its own. Reject or redirect "
            "new requests at the door when the queue grows (overload protection).")


def ttft_queueing(con, run_id: str, *, queue_share: float = 0.5, min_queue_p50_s: float = 0.05,
                  critical_queue_p50_s: float = 1.0, labels: dict | None = None, **_: object) -> list[Finding]:
    """Fires when queueing is >= `queue_share` of the summed TTFT and the median queue time is
    >= `min_queue_p50_s` seconds."""
    e = one(con, QUEUE_SQL, run_id)
    if not e["requests"] or e["queue_share_of_ttft"] is None:
        return []
    if e["queue_share_of_ttft"] < queue_share or e["queue_p50_s"] < min_queue_p50_s:
        return []
    cap = one(con, CAPACITY_SQL, run_id)
    e.update(cap)
    e["runtime"] = runtime_of(labels)
    util = (e["prefill_demand_tokens_per_s"] / cap["prefill_capacity_tokens_per_s"]
            if e["prefill_demand_tokens_per_s"] and cap["prefill_capacity_tokens_per_s"] else None)
    e["prefill_utilization"] = util
    e["query"] = QUEUE_SQL + ";\n" + CAPACITY_SQL
    load = (f" Offered prefill load is {e['prefill_demand_tokens_per_s']:.0f} tokens/s over the "
            f"{e['demand_window_s']:.1f} s from the first arrival to the last first token (arrivals spanned "
            f"{e['arrival_span_s']:.1f} s), against a measured prefill rate of "
            f"{cap['prefill_capacity_tokens_per_s']:.0f} tokens/s ({util:.0%})." if util else "")
    prefill_cap = "more replicas or disaggregated prefill" if e["runtime"] != "hf-generate" else \
        "continuous batching"
    return [Finding(
        summary=(f"Queueing is {e['queue_share_of_ttft']:.0%} of TTFT: a median {e['queue_p50_s'] * 1e3:.0f} ms "
                 f"wait in a {e['ttft_p50_s'] * 1e3:.0f} ms median TTFT."),
        action=(f"Add prefill capacity ({prefill_cap}) and shed load at the door: TTFT falls toward the prefill "
                f"time (median {e['prefill_p50_s'] * 1e3:.0f} ms)."),
        id="ttft-queueing",
        title="TTFT is dominated by queueing",
        severity="critical" if e["queue_p50_s"] >= critical_queue_p50_s else "warning",
        evidence=e,
        suggestion=queueing_suggestion(e, raise_budget=True) + load,
        expected_effect=(f"Queueing is {e['queue_share_of_ttft']:.0%} of TTFT (median queue "
                         f"{e['queue_p50_s'] * 1e3:.0f} ms of a {e['ttft_p50_s'] * 1e3:.0f} ms median TTFT). Removing "
                         f"it brings TTFT toward the prefill time itself: median {e['prefill_p50_s'] * 1e3:.0f} ms, "
                         f"p95 {e['prefill_p95_s'] * 1e3:.0f} ms (TTFT p95 now {e['ttft_p95_s'] * 1e3:.0f} ms)."),
        reference=ref("Queueing"),
        run_id=run_id,
        thresholds={"queue_share": queue_share, "min_queue_p50_s": min_queue_p50_s,
                    "critical_queue_p50_s": critical_queue_p50_s},
    )]
