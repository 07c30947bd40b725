"""Prefix cache: a hit rate far below what the shared prefix allows, or one that collapses."""

from __future__ import annotations

from phasescope.agent.read.thresholds import T
from .findings import Finding, ref
from .sql import PREFIX_TOTALS, one, page_size, prefill_cost
from .runinfo import as_number

# (p inlined where it is read, not materialized: DuckDB would write the run's every counter row to read it twice)
WINDOWS_SQL = """WITH p AS NOT MATERIALIZED (
        SELECT p.ts_ns, p.queried_tokens_total AS q, p.hit_tokens_total AS h, p.evicted_blocks_total AS e
        FROM prefix_counters p JOIN sources s USING (source_id)
        WHERE s.run_id = $run AND p.rank = (SELECT min(p2.rank) FROM prefix_counters p2 JOIN sources s2
                                            USING (source_id) WHERE s2.run_id = $run)),
    b AS (SELECT min(ts_ns) AS t0, max(ts_ns) AS t1 FROM p),
    w AS (SELECT CASE WHEN ts_ns < (t0 + t1) / 2 THEN 0 ELSE 1 END AS half, q, h, e FROM p, b)
    SELECT half, max(q) - min(q) AS queried, max(h) - min(h) AS hit, max(e) - min(e) AS evicted
    FROM w GROUP BY half ORDER BY half"""

# request-level: prompt tokens admitted and served from the cache at (first) admission
REQ_SQL = """SELECT count(*) AS requests, sum(prompt_tokens) AS prompt_tokens,
           coalesce(sum(cached_tokens), 0) AS cached_tokens
    FROM requests WHERE run_id = $run AND prompt_tokens > 0"""


def prefix_hit_collapse(con, run_id: str, *, min_achievable_hit_rate: float = 0.1, max_hit_ratio: float = 0.5,
                        collapse_ratio: float = T["collapse_ratio"], min_window_hit_rate: float = T["min_window_hit_rate"],
                        labels: dict | None = None, **_: object) -> list[Finding]:
    """Fires when the hit rate is below `max_hit_ratio` x what the prompts' shared prefix allows (the run
    label `shared_prefix_tokens`; whole pages only, the first request misses; both rates per request,
    cached / prompt tokens at admission, from the `requests` view), or when the hit rate of
    the second half of the run is below `collapse_ratio` x the first half's (>= `min_window_hit_rate`)."""
    labels = labels or {}
    tot = one(con, PREFIX_TOTALS, run_id)
    if not tot["queried_tokens"]:
        return []
    hit_rate = tot["hit_tokens"] / tot["queried_tokens"]
    e = {**tot, "hit_rate": hit_rate}
    page = page_size(con, run_id) or 1
    shared = as_number(labels.get("shared_prefix_tokens"))
    reasons = []
    achievable = None
    if shared:
        cacheable = int(shared) // page * page
        r = one(con, REQ_SQL, run_id)
        achievable = (r["requests"] - 1) * cacheable / r["prompt_tokens"] if r["requests"] else 0.0
        request_hit_rate = r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
        e.update({"shared_prefix_tokens": int(shared), "cacheable_prefix_tokens": cacheable,
                  "achievable_hit_rate": achievable, "request_hit_rate": request_hit_rate, **r})
        if achievable >= min_achievable_hit_rate and request_hit_rate < max_hit_ratio * achievable:
            reasons.append("shared")
    win = [dict(zip(("half", "queried", "hit", "evicted"), w)) for w in
           con.execute(WINDOWS_SQL, {"run": run_id}).fetchall()]
    if len(win) == 2 and win[0]["queried"] and win[1]["queried"]:
        r0, r1 = win[0]["hit"] / win[0]["queried"], win[1]["hit"] / win[1]["queried"]
        e.update({"hit_rate_first_half": r0, "hit_rate_second_half": r1, "evicted_blocks_second_half": win[1]["evicted"]})
        if r0 >= min_window_hit_rate and r1 < collapse_ratio * r0:
            reasons.append("collapse")
    if not reasons:
        return []
    e["query"] = PREFIX_TOTALS + ";\n" + REQ_SQL + ";\n" + WINDOWS_SQL
    advice = []
    position = labels.get("prefix_position")
    if position == "last" or ("shared" in reasons and hit_rate < 0.05):
        advice.append("put the fixed part of every prompt (system prompt, shared documents, tool definitions) "
                      "first and the variable part last: the cache only matches a common leading run of whole pages")
    if (tot["evicted_blocks"] or 0) > 0:
        advice.append(f"give the prefix cache more capacity or make eviction less eager ({tot['evicted_blocks']} "
                      "cached pages were evicted; eviction churn throws away prefixes before they are reused)")
    advice.append("check that prompts are byte-identical up to the shared part (timestamps or request ids early "
                  "in a prompt defeat the cache)")
    cost = prefill_cost(con, run_id)
    slope = cost["ms_per_prefill_token"] or 0.0
    if achievable is not None:
        saved = max(0.0, achievable - request_hit_rate) * r["prompt_tokens"]
        e["prefill_tokens_saved"] = int(saved)
        effect = (f"Hit rate {request_hit_rate:.1%} where the {int(shared)}-token shared prefix allows {achievable:.1%}: "
                  f"reaching it skips ~{int(saved)} prefill tokens "
                  + (f"(~{saved * slope / max(e.get('requests') or 1, 1):.0f} ms of prefill per request at "
                     f"{slope:.3f} ms per token)" if slope > 0 else "") + ", lowering TTFT.")
    else:
        effect = (f"Hit rate fell from {e['hit_rate_first_half']:.1%} to {e['hit_rate_second_half']:.1%} between the "
                  "halves of the run; restoring it saves the re-prefill of the lost prefixes.")
    short = [t for t, on in (("put the fixed part of every prompt first", position == "last" or (
        "shared" in reasons and hit_rate < 0.05)), ("give the prefix cache more room", (tot["evicted_blocks"] or 0) > 0),
        ("keep prompts byte-identical up to the shared part", True)) if on]
    return [Finding(
        summary=(f"Prefix hit rate is {request_hit_rate:.1%} where the {int(shared)}-token shared prefix allows "
                 f"{achievable:.1%}." if achievable is not None else
                 f"Prefix hit rate fell from {e['hit_rate_first_half']:.1%} to {e['hit_rate_second_half']:.1%} "
                 "between the halves of the run."),
        action=("; ".join(short)[:1].upper() + "; ".join(short)[1:]
                + (f": ~{e['prefill_tokens_saved']} prefill tokens skipped, lower TTFT." if achievable is not None
                   else ": the lost prefixes are not prefilled again.")),
        id="prefix-hit-collapse",
        title="Prefix cache hit rate far below what the prompts allow",
        severity="warning",
        evidence=e,
        suggestion="; ".join(advice).capitalize() + ".",
        expected_effect=effect,
        reference=ref("Prefix cache"),
        run_id=run_id,
        thresholds={"min_achievable_hit_rate": min_achievable_hit_rate, "max_hit_ratio": max_hit_ratio,
                    "collapse_ratio": collapse_ratio, "min_window_hit_rate": min_window_hit_rate},
    )]
