"""Ten-second KV rollups: what the KV cache and Ranks pages read instead of every snapshot, kept by the
snapshots' rowid watermark.

`kv_rollup` holds, per run, CELL_S seconds since the run's first step (the same start as the step rollup's,
`step_rollup_run`, and as the raw reads' `_window`: snapshots before it count in cell 0) and rank, the sums,
counts, least and greatest values the KV reads aggregate (kv_timeline, kv_summary, rank_kv). Everything read
from it is exact: means are sum / count (floats add in another order: equal to ~1e-12 relative), maxima,
minima and counts are the raw ones. Columns named `*_sum` / `*_n` hold the sum and count of the non-NULL
values of an expression over the snapshots with `total_pages > 0`; `all_*` over every snapshot (rank_kv reads
every one).

Kept by `refresh(con)` (records/derived.py's fold calls it after the step rollup, in its transaction):
snapshots past the watermark are added to their cells; a run whose start moved (or that had no start: no steps
yet) and any deletion below the watermark (a retention roll) make it rebuilt from the raw rows. `usable(con,
run_id)` says whether a read may use it (with the run's snapshots past the watermark binned at read time).

Pure SQL over a connection the caller passes; imports nothing of ours but the step rollup (its run starts).
"""

from __future__ import annotations

from typing import Any

from . import steprollup
from .columns import Tables, table_ddl

CELL_S = steprollup.CELL_S
STATE = "kv_rollup"  # its row in derived_state
KEY = ("run_id", "sec", "rank")

_OK = "k.total_pages > 0"
# (column, type, SQL over kv_snapshots k (and the start r), doc)
_COLS: list[tuple[str, str, str, str]] = [
    ("all_n", "BIGINT", "count(*)", "snapshots"),
    ("all_kv_sum", "HUGEINT", "sum(k.kv_bytes)", "their kv_bytes"),
    ("all_kv_n", "BIGINT", "count(k.kv_bytes)", "those with kv_bytes"),
    ("n", "BIGINT", f"count(*) FILTER (WHERE {_OK})", "snapshots with total_pages > 0 (the rest below: of these)"),
    ("block_sum", "DOUBLE", "sum(k.used_pages / k.total_pages)", "block usage"),
    ("block_n", "BIGINT", "count(k.used_pages / k.total_pages)", ""),
    ("block_max", "DOUBLE", "max(k.used_pages / k.total_pages)", ""),
    ("token_sum", "DOUBLE", "sum(k.live_tokens / (k.total_pages * k.page_size_tokens))", "token usage"),
    ("token_n", "BIGINT", "count(k.live_tokens / (k.total_pages * k.page_size_tokens))", ""),
    ("int_sum", "DOUBLE", "sum(CASE WHEN k.used_pages > 0 THEN 1 - k.live_tokens / (k.used_pages * k.page_size_tokens) END)",
     "internal fragmentation"),
    ("int_n", "BIGINT", "count(CASE WHEN k.used_pages > 0 THEN 1 - k.live_tokens / (k.used_pages * k.page_size_tokens) END)", ""),
    ("ext_sum", "DOUBLE", "sum(CASE WHEN k.free_pages > 0 THEN 1 - least(k.largest_free_run, k.free_pages) / k.free_pages END)",
     "external fragmentation (largest run clamped to the free pages, as kv_timeline)"),
    ("ext_n", "BIGINT", "count(CASE WHEN k.free_pages > 0 THEN 1 - least(k.largest_free_run, k.free_pages) / k.free_pages END)", ""),
    ("extu_sum", "DOUBLE", "sum(CASE WHEN k.free_pages > 0 THEN 1 - k.largest_free_run / k.free_pages END)",
     "external fragmentation (unclamped, as kv_summary)"),
    ("extu_n", "BIGINT", "count(CASE WHEN k.free_pages > 0 THEN 1 - k.largest_free_run / k.free_pages END)", ""),
    ("alloc_min", "BIGINT", "min(k.pages_allocated_total)", ""),
    ("alloc_max", "BIGINT", "max(k.pages_allocated_total)", ""),
    ("freed_min", "BIGINT", "min(k.pages_freed_total)", ""),
    ("freed_max", "BIGINT", "max(k.pages_freed_total)", ""),
    ("kv_sum", "HUGEINT", "sum(k.kv_bytes)", "kv_bytes"),
    ("kv_n", "BIGINT", "count(k.kv_bytes)", ""),
    ("kv_max", "BIGINT", "max(k.kv_bytes)", ""),
    ("cached_max", "DOUBLE", "max(k.cached_pages / k.total_pages)", "greatest cached share"),
    ("total_pages_max", "BIGINT", "max(k.total_pages)", ""),
    ("page_size", "INTEGER", "any_value(k.page_size_tokens)", "a page size seen"),
    ("kv_dtype", "VARCHAR", "any_value(k.kv_dtype)", "a KV dtype seen"),
    ("ts_min", "BIGINT", "min(k.ts_ns)", "monotonic ns"),
    ("ts_max", "BIGINT", "max(k.ts_ns)", "monotonic ns"),
]
# how cells merge: sums and counts add, the rest by their own aggregate
_MERGE = {"min": "min", "max": "max", "any_value": "any_value"}

TABLES: Tables = {
    "kv_rollup": [("run_id", "VARCHAR", "sources.run_id"),
                  ("sec", "BIGINT", "seconds since the run's first step (wall time), clamped at 0, rounded down to "
                                    "a multiple of CELL_S (10)"),
                  ("rank", "SMALLINT", "kv_snapshots.rank")]
                 + [(c, t, doc) for c, t, _, doc in _COLS],
    "kv_rollup_run": [("run_id", "VARCHAR", "sources.run_id"),
                      ("start_ns", "BIGINT", "the step rollup's start of the run the cells count from")],
}


def _agg(col: str, sql: str) -> str:
    """The aggregate that merges cells of column `col` (whose SQL is `sql`)."""
    for fn, merge in _MERGE.items():
        if sql.startswith(fn + "("):
            return f"{merge}({col})"
    return f"sum({col})"


def merge_sql() -> str:
    """Aggregates merging cells (sums add, extremes by their own function), each named as its column."""
    return ", ".join(f"CAST({_agg(c, s)} AS {t}) AS {c}" for c, t, s, _ in _COLS)


def cells_sql(where: str, starts: str) -> str:
    """Cells of the snapshots `k` matching `where` (over kv_snapshots k JOIN sources s), against the run starts
    in the relation `starts` (run_id, start_ns)."""
    # every aggregate but the plain row counts is over the snapshots with total_pages > 0
    parts = [f"{sql} AS {c}" if c.startswith("all_") or c == "n" else f"{sql} FILTER (WHERE {_OK}) AS {c}"
             for c, _, sql, _ in _COLS]
    return f"""SELECT s.run_id,
               greatest((k.ts_ns + s.wall_minus_mono_ns - r.start_ns) // {CELL_S * 10**9}, 0) * {CELL_S} AS sec,
               k.rank, {', '.join(parts)}
        FROM kv_snapshots k JOIN sources s USING (source_id) JOIN {starts} r ON r.run_id = s.run_id
        WHERE {where} GROUP BY ALL"""


def ddl() -> list[str]:
    return table_ddl(TABLES)


def _state(con: Any) -> tuple[int, int] | None:
    return steprollup.state(con, STATE)


def _cols() -> str:
    return ", ".join(c for c, _, _ in TABLES["kv_rollup"])


def _rebuild(con: Any, runs: str | None, top: int) -> None:
    """Cells of the runs in the SQL relation `runs` (run_id) (None: every run the step rollup has) from their
    snapshots <= top, against the step rollup's starts."""
    only = "" if runs is None else f" AND run_id IN (SELECT run_id FROM {runs})"
    con.execute(f"DELETE FROM kv_rollup WHERE true{only}")
    con.execute(f"DELETE FROM kv_rollup_run WHERE true{only}")
    con.execute(f"INSERT INTO kv_rollup_run SELECT run_id, start_ns FROM step_rollup_run WHERE true{only}")
    con.execute(f"INSERT INTO kv_rollup ({_cols()}) "
                + cells_sql(f"k.rowid <= {top}" + ("" if runs is None else
                                                   f" AND s.run_id IN (SELECT run_id FROM {runs})"), "kv_rollup_run"))


def refresh(con: Any) -> None:
    """Fold the snapshots written since the last refresh into the rollup (rebuild it after a deletion, and a
    run whose start moved), in the caller's transaction. Call after steprollup.refresh."""
    st, wm, n, top, total, below = steprollup.progress(con, TABLES, STATE, "kv_snapshots")
    if st is None or below != n:  # first time, or rows deleted (a retention roll): from the rows left
        _rebuild(con, None, top)
    else:
        # runs the step rollup starts elsewhere than the cells do (a new run, or an earlier first step)
        stale = con.execute("""SELECT count(*) FROM step_rollup_run r LEFT JOIN kv_rollup_run k USING (run_id)
                               WHERE k.start_ns IS DISTINCT FROM r.start_ns""").fetchone()[0]
        if stale:
            con.execute("""CREATE OR REPLACE TEMP TABLE _kr_stale AS SELECT r.run_id FROM step_rollup_run r
                           LEFT JOIN kv_rollup_run k USING (run_id) WHERE k.start_ns IS DISTINCT FROM r.start_ns""")
            _rebuild(con, "_kr_stale", top)
        if total > below:
            new = (f"k.rowid > {wm} AND k.rowid <= {top}"
                   + (" AND s.run_id NOT IN (SELECT run_id FROM _kr_stale)" if stale else ""))
            con.execute("CREATE OR REPLACE TEMP TABLE _kr_cells AS " + cells_sql(new, "kv_rollup_run"))
            on = " AND ".join(f"c.{k} = q.{k}" for k in KEY)
            con.execute(f"""CREATE OR REPLACE TEMP TABLE _kr_merged AS
                SELECT {', '.join(KEY)}, {merge_sql()}
                FROM (SELECT q.* FROM kv_rollup q WHERE EXISTS (SELECT 1 FROM _kr_cells c WHERE {on})
                      UNION ALL BY NAME SELECT * FROM _kr_cells) GROUP BY ALL""")
            con.execute(f"DELETE FROM kv_rollup q USING _kr_cells c WHERE {on}")
            con.execute(f"INSERT INTO kv_rollup ({_cols()}) SELECT {_cols()} FROM _kr_merged")
        for t in ("_kr_stale", "_kr_cells", "_kr_merged"):
            con.execute(f"DROP TABLE IF EXISTS temp.{t}")
    if st != (top, total):
        con.execute("INSERT OR REPLACE INTO derived_state VALUES (?, ?, ?)", [STATE, top, total])


def usable(con: Any, run_id: str) -> int | None:
    """The watermark when the rollup plus the run's snapshots past it (`cells`) describe every snapshot of
    `run_id` in the store now, against the run's true start, else None (read the raw rows): the step rollup is
    usable for the run (so its start is the least step's), the cells count from that start, `kv_snapshots` is a
    table of this store, and nothing was deleted below the watermark."""
    if steprollup.usable(con, run_id) is None:
        return None
    names = {n for (n,) in con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE table_name IN ('kv_rollup', 'kv_rollup_run', 'kv_snapshots') "
        "AND NOT temporary AND database_name = current_database()").fetchall()}
    if len(names) != 3:
        return None
    st = _state(con)
    if st is None:
        return None
    wm, n = st
    same = con.execute("SELECT count(*) FROM kv_rollup_run k JOIN step_rollup_run r USING (run_id) "
                       "WHERE run_id = ? AND k.start_ns = r.start_ns", [run_id]).fetchone()[0]
    if not same:
        return None
    below = con.execute(f"SELECT count(*) FROM kv_snapshots WHERE rowid <= {int(wm)}").fetchone()[0]
    return wm if below == n else None


def cells(run_id_param: str, wm: int) -> str:
    """SQL of the cells of the run named by the parameter `run_id_param` (e.g. '$run'): the rollup's and those of
    its snapshots past the watermark `wm` (as `usable` allows)."""
    return (f"SELECT {_cols()} FROM kv_rollup WHERE run_id = {run_id_param} UNION ALL BY NAME "
            + cells_sql(f"k.rowid > {int(wm)} AND s.run_id = {run_id_param}", "kv_rollup_run"))
