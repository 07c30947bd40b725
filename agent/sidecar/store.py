"""The DuckDB store: the sidecar is its only writer; readers open files no agent holds.

DuckDB lets one process hold a file read-write, and then no other process can
open it at all. So: the sidecar owns the file (`Store(path)`), appends in
columnar batches and checkpoints; offline readers use `Store.open_readonly`.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from typing import Iterable, Sequence

import duckdb

from ..events import PHASES, REQUEST_EVENTS, Hello, Record, RunLabel
from .schema import SCHEMA_VERSION, TABLE_OF_RECORD, TABLES, ddl


class SchemaError(RuntimeError):
    """The file was written by an incompatible schema version."""


def _rows_for(table: str, source_id: int, records: Sequence[Record]) -> list[tuple]:
    if table == "steps":
        return [(source_id, *r[:3], PHASES[r[3]], *r[4:]) for r in records]
    if table == "request_events":
        return [(source_id, r[0], r[1], REQUEST_EVENTS[r[2]], *r[3:]) for r in records]
    return [(source_id, *r) for r in records]


class Store:
    """A DuckDB file opened read-write, with the phasescope schema."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.con = duckdb.connect(path)
        for stmt in ddl():
            self.con.execute(stmt)
        version = self.con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
        if int(version) != SCHEMA_VERSION:
            self.con.close()
            raise SchemaError(f"{path} has schema version {version}; this build writes {SCHEMA_VERSION}")
        # source 0 is the sidecar itself (its collectors: NVML, psutil, scraped /metrics)
        self.con.execute(
            "INSERT INTO sources SELECT 0, ?, 0, ?, ?, 0, 1, 'sidecar', '', 'sidecar' "
            "WHERE NOT EXISTS (SELECT 1 FROM sources WHERE source_id = 0)",
            [time.time_ns(), time.time_ns() - time.monotonic_ns(), os.getpid()],
        )
        self._next_source = (self.con.execute("SELECT coalesce(max(source_id), 0) FROM sources").fetchone()[0]) + 1
        self._lock = threading.Lock()  # the sidecar's writer thread and its control calls
        self._run_of: dict[int, str] = dict(self.con.execute("SELECT source_id, run_id FROM sources").fetchall())
        self.rows_written = 0

    @staticmethod
    def open_readonly(path: str) -> duckdb.DuckDBPyConnection:
        """A read-only connection to a file no agent holds open."""
        return duckdb.connect(path, read_only=True)

    def register_source(self, hello: Hello) -> int:
        """Insert a sources row for a new connection; returns its source_id."""
        with self._lock:
            sid = self._next_source
            self._next_source += 1
            self._run_of[sid] = hello.run_id
            self.con.execute(
                "INSERT INTO sources VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [sid, time.time_ns(), hello.ts_ns, hello.wall_minus_mono_ns, hello.pid, hello.rank,
                 hello.world_size, hello.run_id, hello.model, hello.runtime],
            )
        return sid

    def append(self, batches: Iterable[tuple[int, Sequence[Record]]]) -> int:
        """Append records of many sources in one transaction; returns rows written."""
        by_table: dict[str, list[tuple]] = defaultdict(list)
        labels: dict[tuple[str, str], str] = {}
        for source_id, records in batches:
            by_type: dict[str, list[Record]] = defaultdict(list)
            for r in records:
                if type(r) is RunLabel:
                    labels[(self._run_of.get(source_id, ""), r.key)] = r.value
                    continue
                table = TABLE_OF_RECORD.get(type(r).__name__)
                if table is not None:
                    by_type[table].append(r)
            for table, recs in by_type.items():
                by_table[table].extend(_rows_for(table, source_id, recs))
        n = 0
        with self._lock:
            self.con.execute("BEGIN")
            try:
                for table, rows in by_table.items():
                    self._insert_columns(table, rows)
                    n += len(rows)
                for (run_id, key), value in labels.items():
                    self.con.execute("INSERT OR REPLACE INTO run_info VALUES (?, ?, ?)", [run_id, key, value])
                    n += 1
                self.con.execute("COMMIT")
            except Exception:
                self.con.execute("ROLLBACK")
                raise
        self.rows_written += n
        return n

    def _insert_columns(self, table: str, rows: list[tuple]) -> None:
        # Columnar insert through unnest(list) parameters: ~300x faster than
        # executemany, and needs neither pandas nor pyarrow in the sidecar.
        cols = TABLES[table]
        columns = [list(c) for c in zip(*rows)]
        select = ", ".join(f"unnest(${i + 1})::{typ}" for i, (_, typ, _) in enumerate(cols))
        self.con.execute(f"INSERT INTO {table} SELECT {select}", columns)

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A connection of this process to the same database, for readers on other threads."""
        with self._lock:
            return self.con.cursor()

    def checkpoint(self) -> None:
        with self._lock:
            self.con.execute("CHECKPOINT")

    def close(self) -> None:
        with self._lock:
            try:
                self.con.execute("CHECKPOINT")
            finally:
                self.con.close()
