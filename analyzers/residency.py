"""KV residency: how long pages live, idle and wait for reuse, and whether a bigger cache would have hit.

From `page_events` (one page id in `sample_every` followed by the adapter, under a per-second cap):
- lifetime = age at eviction or free (ms since the page was allocated);
- idle before eviction = time an evicted page sat unreferenced in the cache (the current residency);
- reuse gap = time a cached page sat unreferenced before a prefix hit took it.
From `prefix_lookups`: the lookups that missed shared whole pages because they had been evicted, each
with its eviction-to-reuse gap g and its evicted pages n = evicted_tokens / P. A cache that had kept
those pages until they were asked for again turns them into hits; it needs, at any instant t,
the pages of every such lookup whose interval [ts - g, ts] holds t:

    extra_pages = max_t sum(n_i : ts_i - g_i <= t <= ts_i)
"""

from __future__ import annotations

from typing import Any

from phasescope.agent.read.thresholds import T
from .findings import Finding, ref
from .queries import one

RESIDENCY_SQL = """SELECT count(*) AS page_events, max(sample_every) AS sample_every, max(dropped_total) AS dropped_events,
           count(*) FILTER (WHERE event = 'evicted') AS evictions,
           count(*) FILTER (WHERE event = 'reused') AS reuses,
           count(*) FILTER (WHERE event = 'freed') AS frees,
           quantile_cont(age_ms, 0.5) FILTER (WHERE event IN ('evicted', 'freed')) AS lifetime_ms_p50,
           quantile_cont(age_ms, 0.9) FILTER (WHERE event IN ('evicted', 'freed')) AS lifetime_ms_p90,
           quantile_cont(idle_ms, 0.5) FILTER (WHERE event = 'evicted' AND NOT isnan(idle_ms)) AS idle_before_evict_ms_p50,
           quantile_cont(idle_ms, 0.9) FILTER (WHERE event = 'evicted' AND NOT isnan(idle_ms)) AS idle_before_evict_ms_p90,
           quantile_cont(idle_ms, 0.5) FILTER (WHERE event = 'reused') AS reuse_gap_ms_p50,
           quantile_cont(idle_ms, 0.9) FILTER (WHERE event = 'reused') AS reuse_gap_ms_p90,
           max(idle_ms) FILTER (WHERE event = 'reused') AS reuse_gap_ms_max
    FROM page_events e JOIN sources s USING (source_id) WHERE s.run_id = $run"""

EVICTED_REUSE_SQL = """SELECT l.ts_ns, l.evict_gap_ms, l.evicted_tokens, l.page_size_tokens
    FROM prefix_lookups l JOIN sources s USING (source_id)
    WHERE s.run_id = $run AND l.kind = 'first' AND l.evicted_tokens > 0 AND NOT isnan(l.evict_gap_ms)
    ORDER BY l.ts_ns"""

CAPACITY_SQL = """SELECT max(k.total_pages) AS total_pages, max(k.page_size_tokens) AS page_size_tokens,
           (SELECT sum(prompt_tokens) FROM prefix_lookups l JOIN sources s2 USING (source_id)
            WHERE s2.run_id = $run AND l.kind = 'first') AS queried_tokens
    FROM kv_snapshots k JOIN sources s USING (source_id) WHERE s.run_id = $run"""


def extra_pages_needed(intervals: list[tuple[int, int, int]]) -> int:
    """Most pages held at once by intervals (start_ns, end_ns, pages), ends inclusive."""
    points = sorted([(a, 0, n) for a, _, n in intervals] + [(b, 1, -n) for _, b, n in intervals])
    best = cur = 0
    for _, _, n in points:
        cur += n
        best = max(best, cur)
    return best


def residency(con: Any, run_id: str) -> dict[str, Any]:
    """Page-lifecycle distributions and the evicted-then-reused figures of a run (`page_events` 0: no data)."""
    out = one(con, RESIDENCY_SQL, run_id)
    rows = con.execute(EVICTED_REUSE_SQL, {"run": run_id}).fetchall()
    intervals = [(ts - int(gap * 1e6), ts, tokens // max(page, 1)) for ts, gap, tokens, page in rows]
    gaps = sorted(r[1] for r in rows)
    cap = one(con, CAPACITY_SQL, run_id)
    out.update({
        "evicted_reuse_lookups": len(rows),
        "evicted_reuse_tokens": sum(r[2] for r in rows),
        "evicted_reuse_pages": sum(n for _, _, n in intervals),
        "evict_to_reuse_gap_ms_min": gaps[0] if gaps else None,
        "evict_to_reuse_gap_ms_max": gaps[-1] if gaps else None,
        "extra_pages_needed": extra_pages_needed(intervals),
        "total_pages": cap["total_pages"], "page_size_tokens": cap["page_size_tokens"],
        "queried_tokens": cap["queried_tokens"] or 0,
        "query": RESIDENCY_SQL + ";\n" + EVICTED_REUSE_SQL + ";\n" + CAPACITY_SQL,
    })
    return out


def kv_evicted_before_reuse(con, run_id: str, *, evicted_reuse_share: float = T["evicted_reuse_share"],
                            **_: object) -> list[Finding]:
    """Fires when the prompt tokens missed because their pages were evicted before another prompt asked for
    them are at least `evicted_reuse_share` of the queried prompt tokens: those reuse gaps outlived the
    cache's residency, and `extra_pages_needed` more pages would have kept them."""
    r = residency(con, run_id)
    if not r["evicted_reuse_tokens"] or not r["queried_tokens"]:
        return []
    share = r["evicted_reuse_tokens"] / r["queried_tokens"]
    if share < evicted_reuse_share:
        return []
    extra, total = r["extra_pages_needed"], r["total_pages"]
    grow = f" (+{extra / total:.0%} of its {total} pages)" if total else ""
    idle = r["idle_before_evict_ms_p50"]
    return [Finding(
        id="kv-evicted-before-reuse",
        title="Cached prefixes are evicted before they are reused",
        severity="warning",
        evidence={**r, "evicted_reuse_share": share},
        suggestion=(f"{r['evicted_reuse_tokens']} prompt tokens ({share:.1%} of those queried) missed because their "
                    f"pages were evicted {r['evict_to_reuse_gap_ms_min']:.0f}-{r['evict_to_reuse_gap_ms_max']:.0f} ms "
                    "before they were asked for again"
                    + (f", while evicted pages sat idle a median {idle:.0f} ms in the cache" if idle is not None else "")
                    + f". Keeping them needs {extra} more KV pages{grow}: raise --gpu-memory-utilization or "
                    "--num-gpu-blocks-override (vLLM), num_blocks (HF), or use an eviction policy that keeps "
                    "reused prefixes (HF continuous batching evicts every cached page at once under pressure)."),
        expected_effect=f"{r['evicted_reuse_tokens']} prompt tokens served from the cache instead of prefilled.",
        reference=ref("KV residency"),
        run_id=run_id,
        thresholds={"evicted_reuse_share": evicted_reuse_share},
    )]
