"""What a DuckDB file is, before anyone reads or writes it: a phasescope store of this schema version,
an empty file, or something else.

Readers (`reader.connect_readonly`) and the store's writer (`sidecar.store.Store`) both ask here, so a
file is judged one way: a reader says in one line what it found and what it reads; the writer refuses,
untouched, any file that is not its own store of this version (a foreign DuckDB file, another schema
version, a store missing columns, a file that is not DuckDB at all) and never creates one by accident.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import duckdb

from ..records.errors import ReadError
from ..records.schema import SCHEMA_VERSION, TABLES


class StoreFileError(ReadError):
    """The file is not a phasescope store this build can read or write; the message says what it is."""


@dataclass(frozen=True)
class StoreInfo:
    """What a DuckDB file holds. `kind`: "store" (phasescope's meta table with a schema version), "empty"
    (no table at all), "foreign" (tables, but no phasescope meta)."""

    kind: str
    version: int | None = None
    missing: dict[str, list[str]] = field(default_factory=dict)  # table -> columns this build needs it lacks

    def problem(self, path: str, writing: bool = False) -> str | None:
        """One line saying why this build cannot use the file, or None when it can (a store of this version
        with every column, or an empty file). `writing`: the store's writer adds the columns a store of this
        version lacks (columns only ever get added), so only a reader is stopped by them."""
        if self.kind == "foreign":
            return (f"{path} is a DuckDB file of something else (no phasescope meta table); phasescope leaves it "
                    "untouched: give a new path or a file phasescope agent or demo wrote")
        if self.kind == "store" and self.version != SCHEMA_VERSION:
            newer = self.version is not None and self.version > SCHEMA_VERSION
            return (f"{path} is a phasescope store of schema version {self.version}; this phasescope reads and "
                    f"writes version {SCHEMA_VERSION}"
                    + ("; upgrade phasescope to read it" if newer else "; record a new store with this version"))
        if self.missing and not writing:
            what = "; ".join(f"{t}: {', '.join(c)}" for t, c in sorted(self.missing.items()))
            return (f"{path} is a phasescope store (schema version {self.version}) without columns this build "
                    f"needs ({what}); it was written by an older build: open it once with phasescope agent --db "
                    f"{path} (it adds the columns, empty for the old rows; nothing else is rewritten)")
        return None


def inspect(con: duckdb.DuckDBPyConnection, catalog: str | None = None) -> StoreInfo:
    """What the database of `con` (or its attached `catalog`) holds."""
    where = "database_name = current_database()" if catalog is None else "database_name = ?"
    args = [] if catalog is None else [catalog]
    tables = {n for (n,) in con.execute(f"SELECT table_name FROM duckdb_tables() WHERE {where}", args).fetchall()}
    if not tables:
        return StoreInfo("empty")
    if "meta" not in tables:
        return StoreInfo("foreign")
    prefix = "" if catalog is None else f"{catalog}."
    try:
        row = con.execute(f"SELECT value FROM {prefix}meta WHERE key = 'schema_version'").fetchone()
    except duckdb.Error:
        return StoreInfo("foreign")
    if row is None:
        return StoreInfo("foreign")
    try:
        version = int(row[0])
    except (TypeError, ValueError):
        return StoreInfo("foreign")
    cols: dict[str, set[str]] = {}
    for t, c in con.execute(f"SELECT table_name, column_name FROM duckdb_columns() WHERE {where}", args).fetchall():
        cols.setdefault(t, set()).add(c)
    missing = {t: [c for c, _, _ in spec if c not in cols.get(t, set())] for t, spec in TABLES.items()}
    return StoreInfo("store", version, {t: c for t, c in missing.items() if c})


def check_readable(con: duckdb.DuckDBPyConnection, path: str) -> None:
    """Raise StoreFileError (one line) unless `con` reads a phasescope store this build can read."""
    info = inspect(con)
    if info.kind == "empty":
        raise StoreFileError(f"{path} holds no phasescope data (an empty DuckDB file); record a run into it with "
                             "phasescope agent --db FILE or phasescope demo --db FILE")
    problem = info.problem(path)
    if problem:
        raise StoreFileError(problem)


def open_failure(exc: duckdb.Error) -> str:
    """Why DuckDB could not open a file, for readers and the writer alike: "held" (another process holds it
    read-write: its lock), "open here" (this process has it open with another configuration), "not duckdb"
    (damaged, or another format) or "other"."""
    text = str(exc).lower()
    if "lock" in text:
        return "held"
    if "different configuration" in text:
        return "open here"
    if "not a valid duckdb" in text or "unable to open" in text or "corrupt" in text:
        return "not duckdb"
    return "other"


def one_line(exc: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(exc).split())


def check_writable(path: str) -> None:
    """Before the store's writer opens `path` read-write: raise StoreFileError, leaving the file untouched,
    unless it is absent, empty (0 bytes or a DuckDB file with no table) or a phasescope store of this version
    with every column. Opens it read-only (a file another process holds raises StoreFileError too)."""
    if not os.path.exists(path) or (os.path.isfile(path) and os.path.getsize(path) == 0):
        return
    if os.path.isdir(path):
        raise StoreFileError(f"{path} is a directory; give a file path")
    try:
        con = duckdb.connect(path, read_only=True)
    except duckdb.Error as exc:
        why = open_failure(exc)
        if why == "open here":  # this process has it open already (a test, a notebook)
            return
        raise StoreFileError({
            "held": f"{path} is held by another process (a running agent or demo); stop it or give another --db "
                    "path",
            "not duckdb": f"{path} is not a DuckDB file (damaged, or another format); phasescope leaves it "
                          "untouched: give a new path",
        }.get(why, f"cannot open {path}: {one_line(exc)}")) from None
    try:
        info = inspect(con)
    finally:
        con.close()
    problem = info.problem(path, writing=True)
    if problem:
        raise StoreFileError(problem)
