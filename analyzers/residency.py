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
from phasescope.agent.read.queries import (CAPACITY_SQL, EVICTED_REUSE_SQL, RESIDENCY_SQL,  # noqa: F401
                                           extra_pages_needed, kv_residency)
from .findings import Finding, ref


def residency(con: Any, run_id: str) -> dict[str, Any]:
    """Page-lifecycle distributions and the evicted-then-reused figures of a run (`page_events` 0: no data)."""
    out = kv_residency(con, run_id)
    out["query"] = RESIDENCY_SQL + ";\n" + EVICTED_REUSE_SQL + ";\n" + CAPACITY_SQL
    return out


def kv_evicted_before_reuse(con, run_id: str, *, evicted_reuse_share: float = T["evicted_reuse_share"],
                            labels: dict | None = None, **_: object) -> list[Finding]:
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
    blocks = (labels or {}).get("num_gpu_blocks")  # vLLM's pool as it ran (its null block included)
    override = f" {int(float(blocks)) + extra}" if blocks and str(blocks).replace(".", "", 1).isdigit() else ""
    return [Finding(
        summary=(f"{r['evicted_reuse_tokens']} prompt tokens ({share:.1%} of those queried) missed because their "
                 "pages were evicted before they were asked for again."),
        action=f"Add {extra} KV pages{grow}: those tokens come from the cache instead of a prefill.",
        id="kv-evicted-before-reuse",
        title="Cached prefixes are evicted before they are reused",
        severity="warning",
        evidence={**r, "evicted_reuse_share": share},
        suggestion=(f"{r['evicted_reuse_tokens']} prompt tokens ({share:.1%} of those queried) missed because their "
                    f"pages were evicted {r['evict_to_reuse_gap_ms_min']:.0f}-{r['evict_to_reuse_gap_ms_max']:.0f} ms "
                    "before they were asked for again"
                    + (f", while evicted pages sat idle a median {idle:.0f} ms in the cache" if idle is not None else "")
                    + f". Keeping them needs {extra} more KV pages{grow}: raise --gpu-memory-utilization or "
                    f"--num-gpu-blocks-override{override} (vLLM), num_blocks (HF), or use an eviction policy that keeps "
                    "reused prefixes (HF continuous batching evicts every cached page at once under pressure)."),
        expected_effect=f"{r['evicted_reuse_tokens']} prompt tokens served from the cache instead of prefilled.",
        reference=ref("KV residency"),
        run_id=run_id,
        thresholds={"evicted_reuse_share": evicted_reuse_share},
    )]
