"""Ten-second step rollups: what the Phases page reads instead of every step, kept by the steps' rowid watermark.

`step_rollup` holds, per run, CELL_S seconds since the run's first step (wall time), phase, interference class
and step-time bin: the steps, their prefill and decode tokens, the GPU-timed ones, and the least and greatest
step time. Counts and token sums read from it are exact. Step-time quantiles read from it are not: each bin
spans a factor BIN_RATIO = 2^(1/64), and a quantile is read as the geometric middle of the bin of each order
statistic it interpolates (clamped to the least and greatest time in that bin), so it is within
REL_ERROR = 2^(1/128) - 1 (0.55 %) of the exact `quantile_cont` for positive step times (tests/agent/
test_steprollup.py pins it against the exact SQL).

The class is what `interference` groups by at the default long-prefill threshold (thresholds.T, 128 tokens):
0 no decode tokens, 1 decode only, 2 with a short prefill, 3 with a long one.

Kept by `refresh(con)` (records/derived.py's refresh calls it in its transaction): steps past the watermark are
added to their cells; a run whose first step moved (a step older than its start arrived) and any deletion below
the watermark (a retention roll) make it rebuilt from the raw rows. `usable(con, run_id)` says whether a read
may use it (with the run's steps past the watermark, binned at read time); else reads take the raw rows.

Pure SQL over a connection the caller passes; imports nothing of ours.
"""

from __future__ import annotations

import math
from typing import Any

from .columns import Tables, table_ddl

LONG_PREFILL_TOKENS = 128  # agent/read/thresholds.py's long_prefill_tokens default (the floor cannot import it)
BINS_PER_DOUBLING = 64
BIN_RATIO = 2.0 ** (1 / BINS_PER_DOUBLING)
REL_ERROR = 2.0 ** (1 / (2 * BINS_PER_DOUBLING)) - 1  # 0.543 %
ZERO_BIN = -32768  # step times <= 0 (and NaN): read as their least value
# seconds per cell: buckets and windows that are multiples of it are read from the rollup. Ten, not one: at a few
# steps a second a one-second rollup is as large as the steps (retention's size cap counts it); at ten seconds it
# holds a few rows per 10 s per phase and bin, and runs shorter than ten minutes (whose 60 buckets are shorter)
# are small enough to read whole
CELL_S = 10

TABLES: Tables = {  # records/columns.py
    "step_rollup": [
        ("run_id", "VARCHAR", "sources.run_id"),
        ("sec", "BIGINT", "seconds since the run's first step (wall time: ts_ns + wall_minus_mono_ns), "
                          "rounded down to a multiple of CELL_S (10)"),
        ("phase", "VARCHAR", "steps.phase"),
        ("cls", "TINYINT", "0 no decode tokens, 1 decode only, 2 short prefill, 3 long prefill (>= 128 tokens)"),
        ("bin", "SMALLINT", "floor(64 * log2(step ms)); -32768: step ms <= 0 or NaN"),
        ("steps", "BIGINT", "steps in the cell"),
        ("prefill_tokens", "HUGEINT", "their prefill tokens"),
        ("decode_tokens", "HUGEINT", "their decode tokens"),
        ("gpu_timed", "BIGINT", "those with a CUDA-event time"),
        ("ms_min", "DOUBLE", "least step time, ms (GPU time when timed, else host time)"),
        ("ms_max", "DOUBLE", "greatest step time, ms"),
    ],
    "step_rollup_run": [
        ("run_id", "VARCHAR", "sources.run_id"),
        ("start_ns", "BIGINT", "wall ns of the run's first step: `sec` counts from it"),
    ],
}
STATE = "step_rollup"  # its row in derived_state
KEY = ("run_id", "sec", "phase", "cls", "bin")

MS = "CASE WHEN isnan(t.gpu_ms) THEN t.host_ms ELSE t.gpu_ms END"
CLS = (f"CASE WHEN t.decode_tokens > 0 THEN CASE WHEN t.prefill_tokens = 0 THEN 1 "
       f"WHEN t.prefill_tokens < {LONG_PREFILL_TOKENS} THEN 2 ELSE 3 END ELSE 0 END")
BIN = (f"CASE WHEN {MS} > 0 AND NOT isnan({MS}) AND NOT isinf({MS}) "
       f"THEN CAST(floor(log2({MS}) * {BINS_PER_DOUBLING}) AS SMALLINT) ELSE {ZERO_BIN} END")


def cells_sql(where: str, starts: str) -> str:
    """Cells of the steps `t` matching `where` (over steps t JOIN sources s), against the run starts in the
    relation `starts` (run_id, start_ns)."""
    return f"""SELECT s.run_id, (t.ts_ns + s.wall_minus_mono_ns - r.start_ns) // {CELL_S * 10**9} * {CELL_S} AS sec,
               t.phase,
               CAST({CLS} AS TINYINT) AS cls, {BIN} AS bin, count(*) AS steps,
               CAST(sum(t.prefill_tokens) AS HUGEINT) AS prefill_tokens,
               CAST(sum(t.decode_tokens) AS HUGEINT) AS decode_tokens,
               count(*) FILTER (WHERE NOT isnan(t.gpu_ms)) AS gpu_timed, min({MS}) AS ms_min, max({MS}) AS ms_max
        FROM steps t JOIN sources s USING (source_id) JOIN {starts} r ON r.run_id = s.run_id
        WHERE {where} GROUP BY ALL"""


def ddl() -> list[str]:
    return table_ddl(TABLES)


def progress(con: Any, tables: Tables, name: str, source: str) -> tuple[tuple[int, int] | None, int, int, int, int, int]:
    """Make the rollup `tables` once (a refresh with nothing new writes nothing; their column docs stay in the
    declaration, no COMMENT is written inside a read's fold), then where rollup `name` stands on its `source`
    table: (state, watermark rowid, rows folded, top rowid, rows now, rows now at or below the watermark)."""
    names = ", ".join(f"'{t}'" for t in tables)
    if con.execute(f"SELECT count(*) FROM duckdb_tables() WHERE table_name IN ({names}) "
                   "AND NOT temporary AND database_name = current_database()").fetchone()[0] < len(tables):
        for stmt in table_ddl(tables):
            if not stmt.startswith("COMMENT"):
                con.execute(stmt)
    st = state(con, name)
    wm, n = st or (-1, 0)
    top, total, below = con.execute(f"SELECT coalesce(max(rowid), -1), count(*), count(*) FILTER (WHERE rowid <= {wm}) "
                                    f"FROM {source}").fetchone()
    return st, wm, n, int(top), int(total), int(below)


def state(con: Any, name: str = STATE) -> tuple[int, int] | None:
    """(watermark rowid, rows folded) of the rollup `name` in derived_state (this one's by default), None before
    its first fold."""
    row = con.execute("SELECT wm, n FROM derived_state WHERE name = ?", [name]).fetchone()
    return (int(row[0]), int(row[1])) if row else None


def _rebuild(con: Any, runs: str | None, top: int) -> None:
    """Cells and start of the runs in the SQL relation `runs` (run_id) (None: every run) from their rows <= top."""
    only = "" if runs is None else f" AND s.run_id IN (SELECT run_id FROM {runs})"
    if runs is None:
        con.execute("DELETE FROM step_rollup")
        con.execute("DELETE FROM step_rollup_run")
    else:
        con.execute(f"DELETE FROM step_rollup WHERE run_id IN (SELECT run_id FROM {runs})")
        con.execute(f"DELETE FROM step_rollup_run WHERE run_id IN (SELECT run_id FROM {runs})")
    con.execute(f"""INSERT INTO step_rollup_run SELECT s.run_id, min(t.ts_ns + s.wall_minus_mono_ns)
                    FROM steps t JOIN sources s USING (source_id) WHERE t.rowid <= {top}{only} GROUP BY s.run_id""")
    cols = ", ".join(c for c, _, _ in TABLES["step_rollup"])
    con.execute(f"INSERT INTO step_rollup ({cols}) "
                + cells_sql(f"t.rowid <= {top}{only}", "step_rollup_run"))


def refresh(con: Any) -> None:
    """Fold the steps written since the last refresh into the rollup (rebuild it after a deletion), in the
    caller's transaction."""
    st, wm, n, top, total, below = progress(con, TABLES, STATE, "steps")
    if st is None or below != n:  # first time, or rows deleted (a retention roll): from the rows left
        _rebuild(con, None, top)
    elif total > below:
        new = f"t.rowid > {wm} AND t.rowid <= {top}"
        con.execute(f"""CREATE OR REPLACE TEMP TABLE _sr_new AS SELECT s.run_id, min(t.ts_ns + s.wall_minus_mono_ns)
                        AS start_ns FROM steps t JOIN sources s USING (source_id) WHERE {new} GROUP BY s.run_id""")
        # runs whose first step moved earlier: every cell changes (seconds count from the start)
        con.execute("""CREATE OR REPLACE TEMP TABLE _sr_moved AS SELECT n.run_id FROM _sr_new n
                       JOIN step_rollup_run r USING (run_id) WHERE n.start_ns < r.start_ns""")
        _rebuild(con, "_sr_moved", top)
        con.execute("""INSERT INTO step_rollup_run SELECT run_id, start_ns FROM _sr_new
                       WHERE run_id NOT IN (SELECT run_id FROM step_rollup_run)""")
        con.execute(f"CREATE OR REPLACE TEMP TABLE _sr_cells AS "
                    + cells_sql(f"{new} AND s.run_id NOT IN (SELECT run_id FROM _sr_moved)", "step_rollup_run"))
        on = " AND ".join(f"c.{k} = q.{k}" for k in KEY)
        con.execute(f"""CREATE OR REPLACE TEMP TABLE _sr_merged AS
            SELECT {', '.join(KEY)}, sum(steps) AS steps, CAST(sum(prefill_tokens) AS HUGEINT) AS prefill_tokens,
                   CAST(sum(decode_tokens) AS HUGEINT) AS decode_tokens, sum(gpu_timed) AS gpu_timed,
                   min(ms_min) AS ms_min, max(ms_max) AS ms_max
            FROM (SELECT q.* FROM step_rollup q WHERE EXISTS (SELECT 1 FROM _sr_cells c WHERE {on})
                  UNION ALL BY NAME SELECT * FROM _sr_cells) GROUP BY ALL""")
        con.execute(f"DELETE FROM step_rollup q USING _sr_cells c WHERE {on}")
        cols = ", ".join(c for c, _, _ in TABLES["step_rollup"])
        con.execute(f"INSERT INTO step_rollup ({cols}) SELECT {cols} FROM _sr_merged")
        for t in ("_sr_new", "_sr_moved", "_sr_cells", "_sr_merged"):
            con.execute(f"DROP TABLE IF EXISTS temp.{t}")
    if st != (top, total):
        con.execute("INSERT OR REPLACE INTO derived_state VALUES (?, ?, ?)", [STATE, top, total])


def usable(con: Any, run_id: str) -> int | None:
    """The watermark when the rollup plus the run's steps past it (`cells(con, run_id, wm)`) describe every
    step of `run_id` in the store now, else None (read the raw rows): the rollup exists, `steps` is a table of
    this store (not a view over exports), nothing was deleted below the watermark, the run is in the rollup
    and none of its steps past the watermark started before its first one."""
    names = {n for (n,) in con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE table_name IN ('step_rollup', 'step_rollup_run', "
        "'derived_state', 'steps') AND NOT temporary AND database_name = current_database()").fetchall()}
    if len(names) != 4 or con.execute("SELECT count(*) FROM duckdb_views() WHERE view_name = 'steps'").fetchone()[0]:
        return None
    st = state(con)
    if st is None:
        return None
    wm, n = st
    start = con.execute("SELECT start_ns FROM step_rollup_run WHERE run_id = ?", [run_id]).fetchone()
    if start is None:
        return None
    # two statements with the watermark written in: DuckDB then counts row ids without reading the rows
    below = con.execute(f"SELECT count(*) FROM steps WHERE rowid <= {int(wm)}").fetchone()[0]
    early = con.execute(f"SELECT count(*) FROM steps t JOIN sources s USING (source_id) WHERE t.rowid > {int(wm)} "
                        "AND s.run_id = $run AND t.ts_ns + s.wall_minus_mono_ns < $start",
                        {"run": run_id, "start": start[0]}).fetchone()[0]
    return wm if below == n and early == 0 else None


def cells(run_id_param: str, wm: int) -> str:
    """SQL of the cells of the run named by the parameter `run_id_param` (e.g. '$run_id'): the rollup's and those
    of its steps past the watermark `wm` (as `usable` allows)."""
    cols = ", ".join(c for c, _, _ in TABLES["step_rollup"])
    return (f"SELECT {cols} FROM step_rollup WHERE run_id = {run_id_param} UNION ALL "
            + cells_sql(f"t.rowid > {int(wm)} AND s.run_id = {run_id_param}", "step_rollup_run"))


def quantiles(hist: list[tuple[int, int, float, float]], ps: list[float]) -> list[float | None]:
    """`quantile_cont(ms, p)` for each p, read from a histogram [(bin, steps, ms_min, ms_max)] sorted by bin:
    within REL_ERROR of the exact value for positive step times (module doc)."""
    n = sum(c for _, c, _, _ in hist)
    if n == 0:
        return [None for _ in ps]

    def value(rank: int) -> float:  # the rank-th smallest (0-based), estimated
        seen = 0
        for b, c, lo, hi in hist:
            seen += c
            if rank < seen:
                if b == ZERO_BIN or lo == hi:
                    return lo
                return min(max(2.0 ** ((b + 0.5) / BINS_PER_DOUBLING), lo), hi)
        return hist[-1][3]

    out = []
    for p in ps:
        h = (n - 1) * p
        lo, hi = math.floor(h), math.ceil(h)
        a = value(lo)
        out.append(a if hi == lo else a + (h - lo) * (value(hi) - a))
    return out
