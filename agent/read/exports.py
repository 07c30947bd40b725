"""The Parquet export layout, and store-like connections over exported files.

Retention writes raw rows it removes from the store as hive-partitioned Parquet:

    <export_dir>/host=<host>/date=<YYYY-MM-DD>/table=<table>/part-<uuid>.parquet

(`sources` and `run_info` are written with every roll, so each day's folder can be
read on its own). `open_host` turns any glob of such files (local, or `s3://...`
through DuckDB's httpfs extension where reachable) into an in-memory DuckDB
connection with the store's tables and views, so every named query and analyzer
runs on exports exactly as on a live store. DuckDB reads the files in place and
never writes them. `export_glob` says which targets are exports (a folder, a glob
of .parquet files, an s3:// prefix) for `open_reader`.
"""

from __future__ import annotations

import os
import re
from typing import Any

import duckdb

from ..records import derived
from ..records.schema import RUN_INFO_DDL, TABLES, VIEWS

HIVE = re.compile(r"(?:^|/)host=(?P<host>[^/]+)/date=(?P<date>[^/]+)/table=(?P<table>[^/]+)/[^/]+\.parquet$")


def export_glob(target: str) -> str | None:
    """The glob of export files `target` names, or None when it names no exports (a DuckDB file, a URL).

    A local folder (the export_dir, or a host=/date= folder inside one) or an s3:// prefix: every
    .parquet file under it; a glob or s3:// path ending in .parquet: itself."""
    if target.startswith("s3://"):
        return target if target.endswith(".parquet") else target.rstrip("/") + "/**/*.parquet"
    if os.path.isdir(target):
        return os.path.join(target, "**", "*.parquet")
    if target.endswith(".parquet") and any(c in target for c in "*?["):
        return target
    return None


def list_files(pattern: str, con: Any | None = None) -> list[tuple[str, str, str, str]]:
    """(host, date, table, path) of every export file the glob matches, sorted."""
    own = con is None
    con = con or duckdb.connect()
    try:
        if pattern.startswith("s3://"):
            con.execute("INSTALL httpfs; LOAD httpfs")
        paths = [r[0] for r in con.execute("SELECT file FROM glob(?)", [pattern]).fetchall()]
    finally:
        if own:
            con.close()
    out = []
    for p in paths:
        m = HIVE.search(p.replace("\\", "/"))
        if m:
            out.append((m["host"], m["date"], m["table"], p))
    return sorted(out)


def hosts(pattern: str) -> list[str]:
    """Hosts that have export files under the glob."""
    return sorted({h for h, _, _, _ in list_files(pattern)})


def open_host(pattern: str, host: str) -> duckdb.DuckDBPyConnection:
    """An in-memory connection whose tables are views over `host`'s export files (read in place)."""
    files = [f for f in list_files(pattern) if f[0] == host]
    if not files:
        raise FileNotFoundError(f"no export files of host {host!r} under {pattern!r}")
    con = duckdb.connect()
    if pattern.startswith("s3://"):
        con.execute("LOAD httpfs")
    by_table: dict[str, list[str]] = {}
    for _, _, table, path in files:
        by_table.setdefault(table, []).append(path)
    for table, cols in TABLES.items():
        names = ", ".join(name for name, _, _ in cols)
        paths = by_table.get(table)
        if paths:
            distinct = "DISTINCT " if table == "sources" else ""
            con.execute(f"CREATE VIEW {table} AS SELECT {distinct}{names} FROM read_parquet({_list(paths)}, "
                        f"hive_partitioning = false, union_by_name = true)")
        else:
            body = ", ".join(f"{name} {typ}" for name, typ, _ in cols)
            con.execute(f"CREATE TABLE {table} ({body})")
    if by_table.get("run_info"):
        con.execute(f"CREATE VIEW run_info AS SELECT DISTINCT run_id, key, value FROM "
                    f"read_parquet({_list(by_table['run_info'])}, hive_partitioning = false)")
    else:
        con.execute(RUN_INFO_DDL)
    for view, sql in VIEWS.items():
        con.execute(f"CREATE VIEW {view} AS {sql}")
    for stmt in derived.ddl(rowids=False):  # no row ids in files: the views derive every request from them
        con.execute(stmt)
    return con


def _list(paths: list[str]) -> str:
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"
