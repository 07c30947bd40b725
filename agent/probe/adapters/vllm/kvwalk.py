"""The KV cross-check walk of one vLLM block pool (EngineCore process): every page figure recomputed from the block
tables, O(used pages). `kvaccount.KvAccount.walk` runs it at most every few dozen steps, inside the adapter's
budget; nothing here runs per step.
"""

from __future__ import annotations

from typing import Any

from ....records.kvmath import PageStats, largest_gap


def pool_stats(pool: Any, tables: dict[str, list], reqs: dict[str, Any], P: int, cached: int) -> PageStats:
    """Page statistics of vLLM's block pool: `tables` (request id -> its blocks, the null block skipped),
    `reqs` (request id -> request: its computed tokens are the live ones), `P` tokens per page, `cached`
    hashed pages no request references. O(used pages)."""
    total = pool.num_gpu_blocks - 1  # block 0 is the null block
    free = int(pool.free_block_queue.num_free_blocks)
    used_ids: set[int] = set()
    shared: dict[int, int] = {}
    live = seqs = 0
    for rid, blocks in tables.items():
        if not blocks:
            continue
        seqs += 1
        n_real = 0
        for b in blocks:
            if b.is_null:
                continue
            n_real += 1
            used_ids.add(b.block_id)
            if b.ref_cnt > 1:
                shared[b.block_id] = b.ref_cnt
        req = reqs.get(rid)
        ncomp = int(req.num_computed_tokens) if req is not None else n_real * P
        live += min(ncomp, n_real * P)
    live -= sum((refs - 1) * P for refs in shared.values())
    run = largest_gap(used_ids, 0, pool.num_gpu_blocks) if free else 0  # block 0 (null) is never free
    return PageStats(P, total, total - free, free, cached, len(shared), sum(shared.values()), seqs, max(live, 0), run)


def cached_pages(pool: Any) -> int:
    """Hashed pages no request references (evictable prefix-cache pages), counted from the hash map."""
    cache = getattr(pool.cached_block_hash_to_block, "_cache", None)
    if cache is None:
        return 0
    n = 0
    for v in cache.values():
        if isinstance(v, dict):
            n += sum(1 for b in v.values() if b.ref_cnt == 0)
        elif v.ref_cnt == 0:
            n += 1
    return n
