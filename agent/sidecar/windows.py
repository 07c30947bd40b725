"""Cut one recorded run into time windows, each a run of its own (a load sweep's points against one server).

A server started once and swept over several rates holds one run; `phasescope sweep --url` and
`phasescope explain REPORT` need one run per load point so every analyzer reads a point as it reads any run.
`split_run` copies (never moves: the source run stays whole) the run's rows of each window under a new run id
and new source ids, with labels, then folds the copies into the derived tables. Windows are Unix ns (wall
clock: a load generator's report speaks it); rows are compared through their source's `wall_minus_mono_ns`.

What a window holds (documented, tests pin it):
- a request belongs to the window its `arrival` falls in; all its events come along, whenever they happen;
- every other row of the run's sources (steps, KV snapshots, prefix counters, ...) whose time falls between the
  window's start and the end of its last request (or the window's end, if later);
- the sidecar's `process_samples` of the run's processes in that span, under the new run id (host samples are
  read by time span already and are not copied).
Needs a writable connection to a file no agent holds.
"""

from __future__ import annotations

from typing import Any, Sequence

from phasescope.agent.records import derived
from phasescope.agent.records.schema import TABLES


def _ex(con: Any, sql: str, params: dict[str, Any]) -> Any:
    """Execute with the named parameters `sql` uses (DuckDB refuses unused ones)."""
    return con.execute(sql, {k: v for k, v in params.items() if f"${k}" in sql})


def _cols(con: Any, table: str) -> list[str]:
    return [r[0] for r in con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = ? "
                                      "AND schema_name = 'main' ORDER BY column_index", [table]).fetchall()]


def window_runs(con: Any, label_key: str = "window_of") -> dict[str, dict[str, str]]:
    """Runs that `split_run` made: run_id -> its labels."""
    rows = con.execute("SELECT run_id, key, value FROM run_info WHERE run_id IN "
                       "(SELECT run_id FROM run_info WHERE key = ?)", [label_key]).fetchall()
    out: dict[str, dict[str, str]] = {}
    for r, k, v in rows:
        out.setdefault(r, {})[k] = v
    return out


def split_run(con: Any, run_id: str, windows: Sequence[tuple[int, int, str, dict[str, Any]]]) -> list[str]:
    """Copy each window (start Unix ns, end Unix ns, new run id, labels) of `run_id` into a run of its own;
    the new run carries the source run's labels, then `labels`, then window_of / window_start_ns /
    window_end_ns. Returns the new run ids. Raises ValueError on an unknown run, a reused run id or an empty
    window (start >= end)."""
    srcs = con.execute("SELECT source_id FROM sources WHERE run_id = ? ORDER BY source_id", [run_id]).fetchall()
    if not srcs:
        raise ValueError(f"no run {run_id!r} in the store")
    srcs = [s[0] for s in srcs]
    base_labels = dict(con.execute("SELECT key, value FROM run_info WHERE run_id = ?", [run_id]).fetchall())
    out = []
    con.execute("BEGIN")
    try:
        for t0, t1, new_run, labels in windows:
            if not t0 < t1:
                raise ValueError(f"window of {new_run!r} is empty: start {t0} >= end {t1}")
            if con.execute("SELECT count(*) FROM sources WHERE run_id = ?", [new_run]).fetchone()[0]:
                raise ValueError(f"run {new_run!r} exists already")
            top = con.execute("SELECT coalesce(max(source_id), 0) FROM sources").fetchone()[0]
            remap = {s: top + 1 + i for i, s in enumerate(srcs)}
            con.execute("CREATE OR REPLACE TEMP TABLE ps_remap (old INTEGER, new INTEGER)")
            con.executemany("INSERT INTO ps_remap VALUES (?, ?)", [[o, n] for o, n in remap.items()])
            # the window's requests: arrival in [t0, t1), by the runtime's request id
            con.execute("""CREATE OR REPLACE TEMP TABLE ps_reqs AS
                SELECT DISTINCT r.request_id FROM request_events r JOIN sources s USING (source_id)
                WHERE s.run_id = $run AND r.event = 'arrival'
                  AND r.ts_ns + s.wall_minus_mono_ns >= $t0 AND r.ts_ns + s.wall_minus_mono_ns < $t1""",
                        {"run": run_id, "t0": t0, "t1": t1})
            end = con.execute("""SELECT max(r.ts_ns + s.wall_minus_mono_ns) FROM request_events r
                JOIN sources s USING (source_id) WHERE s.run_id = $run AND r.request_id IN (SELECT request_id FROM ps_reqs)
                  AND r.ts_ns + s.wall_minus_mono_ns >= $t0""", {"run": run_id, "t0": t0}).fetchone()[0]
            t_end = max(t1, end or t1)
            cols = _cols(con, "sources")
            sel = ", ".join("m.new" if c == "source_id" else ("$new_run" if c == "run_id" else f"s.{c}") for c in cols)
            con.execute(f"INSERT INTO sources SELECT {sel} FROM sources s JOIN ps_remap m ON s.source_id = m.old",
                        {"new_run": new_run})
            for table in TABLES:
                if table in ("sources", "host_samples"):
                    continue
                cols = _cols(con, table)
                if "source_id" not in cols or "ts_ns" not in cols:
                    continue
                params: dict[str, Any] = {"t0": t0, "t_end": t_end, "new_run": new_run, "run": run_id}
                if table == "process_samples":  # the sidecar's samples of the run's processes, under the new id
                    sel = ", ".join("$new_run" if c == "run_id" else f"p.{c}" for c in cols)
                    _ex(con, f"""INSERT INTO process_samples SELECT {sel} FROM process_samples p
                        JOIN sources s USING (source_id)
                        WHERE (p.run_id = $run OR (p.run_id = '' AND p.pid IN
                               (SELECT pid FROM sources WHERE run_id = $run)))
                          AND p.ts_ns + s.wall_minus_mono_ns BETWEEN $t0 AND $t_end""", params)
                    continue
                sel = ", ".join("m.new" if c == "source_id" else ("$new_run" if c == "run_id" else f"x.{c}")
                                for c in cols)
                if table == "request_events":
                    where = ("x.request_id IN (SELECT request_id FROM ps_reqs) "
                             "AND x.ts_ns + s.wall_minus_mono_ns >= $t0")
                else:
                    where = "x.ts_ns + s.wall_minus_mono_ns BETWEEN $t0 AND $t_end"
                _ex(con, f"""INSERT INTO {table} SELECT {sel} FROM {table} x JOIN sources s USING (source_id)
                    JOIN ps_remap m ON x.source_id = m.old WHERE {where}""", params)
            lab = {**base_labels, **{k: str(v) for k, v in labels.items()}, "window_of": run_id,
                   "window_start_ns": str(t0), "window_end_ns": str(t_end)}
            con.executemany("INSERT OR REPLACE INTO run_info VALUES (?, ?, ?)",
                            [[new_run, k, v] for k, v in lab.items()])
            out.append(new_run)
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    if con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'derived_state'").fetchone()[0]:
        derived.refresh(con)
        derived.install(con)
    return out
