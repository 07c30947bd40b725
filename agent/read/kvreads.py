"""The KV cache, Ranks and Overview pages' KV reads from the ten-second KV rollup (records/kvrollup.py).

Each gives what the raw SQL in queries.py gives (means are sum / count: floats equal to ~1e-12 relative, the
rest exactly; tests/agent/test_kvrollup.py), or None when the rollup cannot answer (no rollup or not usable
for the run, no run named, a window or bucket that is not a multiple of its 10 s cells): the caller then reads
the raw rows.
"""

from __future__ import annotations

from typing import Any

from ..records import kvrollup
from .phases import _whole, _window


def _wm(con: Any, run_id: str | None) -> int | None:
    return kvrollup.usable(con, run_id) if run_id is not None else None


def _bucketed(con: Any, run_id: str | None, bucket_s: float, since_s: float | None,
              until_s: float | None) -> tuple[str, int, int] | None:
    """(window condition, rollup watermark, bucket in whole s) when the rollup can answer a read bucketed by
    `bucket_s` over the window; None when the raw rows must (a bucket finer than a cell, or not whole cells)."""
    where = _window(since_s, until_s)
    if where is None or bucket_s < kvrollup.CELL_S or not _whole(bucket_s):
        return None
    wm = _wm(con, run_id)
    return None if wm is None else (where, wm, int(bucket_s))


# the rows' names: those of queries.py's raw reads too (one list, so the two answers cannot drift apart)
KV_TIMELINE_KEYS = ("t_s", "rank", "block_usage", "token_usage", "internal_fragmentation", "external_fragmentation",
                    "allocated_per_s", "freed_per_s", "kv_bytes", "cached_share")
KV_SUMMARY_KEYS = ("rank", "snapshots", "page_size", "total_pages", "block_usage_mean", "block_usage_max",
                   "token_usage_mean", "internal_fragmentation_mean", "external_fragmentation_mean",
                   "pages_allocated_per_s", "kv_bytes_max", "kv_dtype")
RANK_KV_KEYS = ("t_s", "rank", "kv_bytes", "imbalance")

# rank_kv's last step over r(t_s, rank, kv): per bucket and rank the mean KV bytes and the bucket's imbalance
# max_r / mean_r - 1 (raw and rollup alike)
RANK_IMBALANCE = """SELECT t_s, rank, kv, max(kv) OVER (PARTITION BY t_s) / nullif(avg(kv) OVER (PARTITION BY t_s), 0) - 1
        FROM r ORDER BY t_s, rank"""


def _bucketed_rows(con: Any, run_id: str | None, bucket_s: float, since_s: float | None, until_s: float | None,
                   sql: str, keys: tuple[str, ...], params: dict[str, Any] | None = None
                   ) -> list[dict[str, Any]] | None:
    """`sql`'s rows named by `keys` when the rollup can answer (`_bucketed`), else None. `sql` is formatted with
    {b} (the bucket, whole seconds), {cells} (the run's rollup cells) and {where} (the window over `sec`); its
    parameters are $run and `params`."""
    plan = _bucketed(con, run_id, bucket_s, since_s, until_s)
    if plan is None:
        return None
    where, wm, b = plan
    sql = sql.format(b=b, cells=kvrollup.cells("$run", wm), where=where)
    return [dict(zip(keys, r)) for r in con.execute(sql, {"run": run_id, **(params or {})}).fetchall()]


def kv_timeline(con: Any, run_id: str | None, bucket_s: float, since_s: float | None,
                until_s: float | None) -> list[dict[str, Any]] | None:
    return _bucketed_rows(con, run_id, bucket_s, since_s, until_s, """
        SELECT CAST(sec // {b} * {b} AS DOUBLE) AS t_s, rank,
               sum(block_sum) / nullif(sum(block_n), 0), sum(token_sum) / nullif(sum(token_n), 0),
               sum(int_sum) / nullif(sum(int_n), 0), sum(ext_sum) / nullif(sum(ext_n), 0),
               (max(alloc_max) - min(alloc_min)) / $bucket_s, (max(freed_max) - min(freed_min)) / $bucket_s,
               sum(kv_sum) / nullif(sum(kv_n), 0), max(cached_max)
        FROM ({cells}) WHERE {where} GROUP BY 1, 2 HAVING sum(n) > 0 ORDER BY 1, 2""", KV_TIMELINE_KEYS,
        {"bucket_s": float(bucket_s)})


def kv_summary(con: Any, run_id: str | None) -> list[dict[str, Any]] | None:
    wm = _wm(con, run_id)
    if wm is None:
        return None
    rows = con.execute(f"""
        SELECT rank, CAST(sum(n) AS BIGINT), any_value(page_size) FILTER (WHERE n > 0), max(total_pages_max),
               sum(block_sum) / nullif(sum(block_n), 0), max(block_max), sum(token_sum) / nullif(sum(token_n), 0),
               sum(int_sum) / nullif(sum(int_n), 0), sum(extu_sum) / nullif(sum(extu_n), 0),
               (max(alloc_max) - min(alloc_min)) / nullif((max(ts_max) - min(ts_min)) / 1e9, 0),
               max(kv_max), any_value(kv_dtype) FILTER (WHERE n > 0)
        FROM ({kvrollup.cells('$run', wm)}) GROUP BY rank HAVING sum(n) > 0 ORDER BY rank""",
        {"run": run_id}).fetchall()
    return [dict(zip(KV_SUMMARY_KEYS, r)) for r in rows]


def rank_kv(con: Any, run_id: str | None, bucket_s: float, since_s: float | None,
            until_s: float | None) -> list[dict[str, Any]] | None:
    return _bucketed_rows(con, run_id, bucket_s, since_s, until_s, """
        WITH r AS (SELECT CAST(sec // {b} * {b} AS DOUBLE) AS t_s, rank, sum(all_kv_sum) / nullif(sum(all_kv_n), 0) AS kv
                   FROM ({cells}) WHERE {where} GROUP BY 1, 2 HAVING sum(all_n) > 0)
        """ + RANK_IMBALANCE, RANK_KV_KEYS)
