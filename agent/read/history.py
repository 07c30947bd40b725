"""One history: a store whose old raw rows retention rolled out is read together with their Parquet exports.

Retention (agent/sidecar/retention.py) notes in the store's `meta` where it put what it rolled
(`export_dir`, `export_host`; an empty `export_dir` when it rolled without an export, so the raw
rows are gone and only the per-minute rollups remain). `open_with_history` gives a connection whose
raw tables are the store's rows followed by that host's exported rows of the store's own sources,
so every named query and analyzer reads a rolled run as it read it before the roll. A view
`phasescope_read_from` (source, location) says what a connection reads; `rolled_history` says what
a reader could not read back (the analyzers turn it into a finding that names where the rows are).
"""

from __future__ import annotations

import os
from typing import Any

import duckdb

from ..records import derived
from ..records.schema import TABLES, VIEWS
from .exports import list_files

READ_FROM = "phasescope_read_from"
ROLLED_STEPS = "rollup_steps_1m"
ROLLED_EVENTS = "rollup_request_events_1m"


def _has(con: Any, name: str) -> bool:
    """Whether a table or view `name` exists (asked, not tried: a failed query would abort a read transaction,
    and every later query of a snapshot with it)."""
    return bool(con.execute("SELECT count(*) FROM (SELECT table_name AS n FROM duckdb_tables() UNION ALL "
                            "SELECT view_name FROM duckdb_views()) WHERE n = ?", [name]).fetchone()[0])


def rolled_to(con: Any) -> tuple[str, str] | None:
    """(export folder, host) when retention rolled raw rows out of this store ('' as folder: no export), or
    None when it never did (or the store predates the note)."""
    if not _has(con, "meta"):
        return None
    meta = dict(con.execute("SELECT key, value FROM meta WHERE key IN ('export_dir', 'export_host')").fetchall())
    if "export_dir" not in meta:
        return None
    return meta["export_dir"], meta.get("export_host", "")


def export_files(export_dir: str, host: str) -> dict[str, list[str]]:
    """Raw table -> the export files of `host` under `export_dir` ({} when the folder is not here)."""
    if not export_dir or not host or not os.path.isdir(export_dir):
        return {}
    out: dict[str, list[str]] = {}
    for h, _, table, path in list_files(os.path.join(export_dir, f"host={host}", "**", "*.parquet")):
        if h == host and table in TABLES and table != "sources":
            out.setdefault(table, []).append(path)
    return out


def open_with_history(path: str, export_dir: str, host: str) -> duckdb.DuckDBPyConnection | None:
    """An in-memory connection over the store at `path` (attached read-only) whose raw tables also hold the
    exported rows of the store's sources; None when no export file of `host` is under `export_dir`."""
    files = export_files(export_dir, host)
    if not files:
        return None
    con = duckdb.connect()
    try:
        con.execute(f"ATTACH {_quote(path)} AS store (READ_ONLY)")
        tables = [n for (n,) in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = 'store'").fetchall()]
        for t in tables:
            if t in derived.TABLES:  # made from the store's rows alone: made again below from the whole history
                continue
            paths = files.get(t)
            if paths:
                names = ", ".join(n for n, _, _ in TABLES[t])
                con.execute(f"CREATE VIEW {t} AS SELECT {names} FROM store.main.{t} UNION ALL "
                            f"SELECT {names} FROM read_parquet([{', '.join(map(_quote, paths))}], "
                            f"hive_partitioning = false, union_by_name = true) "
                            f"WHERE source_id IN (SELECT source_id FROM store.main.sources)")
            else:
                con.execute(f"CREATE VIEW {t} AS SELECT * FROM store.main.{t}")
        for view, sql in VIEWS.items():
            con.execute(f"CREATE VIEW {view} AS {sql}")
        for stmt in derived.ddl(rowids=False):  # requests and gaps of the whole history, from its raw rows
            con.execute(stmt)
        con.execute(f"CREATE VIEW {READ_FROM} AS SELECT * FROM (VALUES ('store', {_quote(path)}), "
                    f"('exports', {_quote(os.path.join(export_dir, f'host={host}'))})) AS t(source, location)")
    except BaseException:
        con.close()
        raise
    return con


def rolled_history(con: Any, run_id: str) -> dict[str, Any] | None:
    """What retention rolled out of `run_id` that `con` does not read back: rolled steps and request events
    (from the rollups), where they went (`export_dir`, '' none, `host`) and the rolled minutes (UTC); None when
    nothing of the run was rolled, or the connection reads the exports too."""
    if _has(con, READ_FROM) and "exports" in {s for (s,) in con.execute(f"SELECT source FROM {READ_FROM}").fetchall()}:
        return None
    where = rolled_to(con)
    if where is None or not (_has(con, ROLLED_STEPS) and _has(con, ROLLED_EVENTS)):
        return None
    steps, first, last = con.execute(
        f"SELECT coalesce(sum(steps), 0), min(minute), max(minute) FROM {ROLLED_STEPS} WHERE run_id = ?",
        [run_id]).fetchone()
    events = con.execute(f"SELECT coalesce(sum(events), 0) FROM {ROLLED_EVENTS} WHERE run_id = ?",
                         [run_id]).fetchone()[0]
    if not steps and not events:
        return None
    return {"rolled_steps": int(steps), "rolled_request_events": int(events), "export_dir": where[0],
            "host": where[1], "first_minute": str(first) if first is not None else None,
            "last_minute": str(last) if last is not None else None}


def read_line(con: Any, path: str) -> str:
    """One line saying what a reader of `path` read: the store and its schema version, and the exports it read
    with it (or where rolled rows went that it could not read)."""
    row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() if _has(con, "meta") else None
    text = f"read {path}: phasescope store, schema version {row[0] if row else '?'}"
    exports = ([loc for src, loc in con.execute(f"SELECT source, location FROM {READ_FROM}").fetchall()
                if src == "exports"] if _has(con, READ_FROM) else [])
    if exports:
        return text + f", with the rows retention rolled out, from {exports[0]}"
    where = rolled_to(con)
    if where is not None:
        return text + (f"; rows retention rolled out to {where[0]} are not here" if where[0] else
                       "; rows retention rolled out were not exported")
    return text


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
