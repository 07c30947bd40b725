"""The DuckDB store: the sidecar is its only writer; readers open files no agent holds.

DuckDB lets one process hold a file read-write, and then no other process can
open it at all. So: the sidecar owns the file (`Store(path)`), appends in
columnar batches (numpy arrays, one insert per table per batch) and checkpoints;
offline readers use `Store.open_readonly`. The file and its WAL are private (0600).
A write that fails because the file system is full or the connection was
invalidated leaves the store `broken`; `reopen()` opens the file again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import defaultdict
from typing import ContextManager, Iterable, Sequence

import duckdb
import numpy as np

from ..records.events import Hello, Record, RunLabel
from . import columnar
from ..records import derived
from ..records.schema import SCHEMA_VERSION, TABLES, ddl
from ..read.storefile import check_writable
from .reads import Reads, interrupt_after

log = logging.getLogger("phasescope.store")

# DuckDB's row group (rows). A transaction that appends at least this many rows to a table writes them
# straight to the file at commit; a smaller one goes through the WAL first, and its COMMIT costs ~25x
# more (measured: 2M Step rows in transactions of 75,000 rows: 1.71 s of COMMIT; of 122,880: 0.07 s;
# benchmarks/duckdb_commit.py). The sidecar's writer waits for this many queued records when it can.
ROW_GROUP_ROWS = 122_880


class SchemaError(RuntimeError):
    """The file was written by an incompatible schema version."""


@dataclasses.dataclass
class Part:
    """Rows of one source to write, and (on the last part of a frame) its delivery accounting."""

    source_id: int
    arrays: dict[int, list[np.ndarray]]  # record type code -> structured arrays (agent/sidecar/columnar.py)
    labels: list[RunLabel] = dataclasses.field(default_factory=list)
    nonce: int | None = None  # v2 sender; None for v1 senders and the sidecar's own collectors
    seq: int | None = None  # set on the last part of a frame: the frame is then fully accounted for
    accepted: int = 0  # records of the frame counted as stored when this part commits
    rejected: int = 0  # records of the frame refused (at decode, or alone in a failed write)

    def rows(self) -> int:
        return sum(len(a) for parts in self.arrays.values() for a in parts) + len(self.labels)


def is_store_failure(exc: BaseException) -> bool:
    """A failure of the file or the connection (disk full, I/O error, invalidated database), not of the data."""
    if isinstance(exc, (duckdb.IOException, duckdb.FatalException, duckdb.InternalException, OSError,
                        duckdb.ConnectionException, duckdb.TransactionException)):
        return True
    text = str(exc).lower()
    return any(w in text for w in ("invalidated", "no space left", "i/o error", "io error", "connection already closed"))


def is_checkpoint_deferred(exc: BaseException) -> bool:
    """DuckDB refused a CHECKPOINT because another connection has a write transaction open: nothing is
    wrong with the file (a TransactionException, which `is_store_failure` would otherwise count)."""
    return isinstance(exc, duckdb.TransactionException) and "cannot checkpoint" in str(exc).lower()


def _private(path: str) -> None:
    for p in (path, path + ".wal"):
        try:
            if os.stat(p).st_mode & 0o077:
                os.chmod(p, 0o600)
        except OSError:
            pass


class Store:
    """A DuckDB file opened read-write, with the phasescope schema."""

    def __init__(self, path: str, memory_limit: str | None = "48MB", read_memory_limit: str | None = "512MB",
                 read_timeout_s: float = 60.0, temp_limit: str = "2GiB", threads: int | None = None,
                 fold_slice_rows: int = 200_000) -> None:
        """`memory_limit`: DuckDB's buffer pool in this process while only the writer works (it spills
        beyond it); None: DuckDB's default (80% of RAM), which lets the sidecar's RSS grow with the data it
        has written. `read_memory_limit`: the pool while a read (`reading()`) runs; None: no change.

        48 MB keeps the sidecar within 300 MiB RSS however much it has stored (measured with
        benchmarks/ingest.py at 10M steps: ~90 MiB of mapped libraries + ~80 MiB of interpreter, numpy,
        pyarrow and DuckDB at rest + the 32 MiB ingest budget + one transaction's columns + this pool,
        which DuckDB fills with cached table blocks as the file grows). Appends need little of it: a
        transaction of whole row groups is written straight to the file.

        Reads cannot live in 48 MB: DuckDB's exact quantiles hold every value of a group and cannot
        spill, so a p99 over 10M steps needs ~250 MB. DuckDB has one limit per database instance and
        no other process may open the file while this one writes, so `reading()` raises the limit while
        any read runs and lowers it when the last one ends (DuckDB then frees what it held: measured
        RSS back from 400 to 202 MiB in 12 ms at 10M steps).

        `read_timeout_s`: a read still running after this long is interrupted (duckdb.InterruptException);
        `threads`: DuckDB's worker threads (None: one per core, DuckDB's default). The sidecar shares its node
        with the inference server, whose engine loop is one busy thread per process; a cap keeps the store's
        inserts and folds off the server's cores, at the price of slower folds. Not capped by default (one
        H100 run capped at 2 was too noisy to tell: benchmarks/results/vllm_gpu_ab.md).
        `temp_limit`: what DuckDB may spill to its temp folder (`<file>.tmp`) at most, for all reads
        together (past it a read fails with duckdb.OutOfMemoryException). No data, however odd, can make
        a read of the live store run or spill without bound.
        `fold_slice_rows`: request events per transaction at most when `refresh_derived` folds (at close too)."""
        if fold_slice_rows < 1 or (threads is not None and threads < 1):
            raise ValueError(f"fold_slice_rows >= 1 and threads >= 1 or None, got {fold_slice_rows}, {threads}")
        self.fold_slice_rows, self.threads = fold_slice_rows, threads
        self.path = path
        self.reads = Reads(self.cursor, self._set_memory_limit, memory_limit, read_memory_limit, read_timeout_s)
        self.temp_limit = temp_limit
        self._lock = threading.Lock()  # the sidecar's writer thread and its control calls
        self._src_lock = threading.Lock()  # ids and pending rows of new sources
        self.rows_written = 0
        self.duplicate_frames = 0  # frames skipped because the store had committed them already
        self.broken: str | None = None  # why the last write failed on the file/connection; None when fine
        self._pending_sources: list[list] = []
        self.defer_sources = False  # the sidecar sets this: sources rows go with the next batch
        self._open()

    def _open(self) -> None:
        path = self.path
        check_writable(path)  # a foreign, damaged or other-version file is refused untouched
        old = os.umask(0o077)  # the file and its WAL: 0600
        try:
            self.con = duckdb.connect(path)
            self._ctl = self.con.cursor()  # for SET memory_limit from readers' threads (never self.con)
            limit = self.reads.limit()
            if limit:
                self._set_memory_limit(limit)
            if self.threads is not None:
                self._ctl.execute(f"SET threads = {int(self.threads)}")
            self._ctl.execute(f"SET temp_directory = '{path}.tmp'")
            self._ctl.execute(f"SET max_temp_directory_size = '{self.temp_limit}'")
            self._init_schema()
        finally:
            os.umask(old)
        _private(path)
        if _pa is not None:  # the first Arrow scan of a process takes ~0.7 s: pay it before any probe waits
            warm = _pa.table({"x": _pa.array([], _pa.int64())})  # noqa: F841 - found by name
            self.con.execute("SELECT count(*) FROM warm").fetchone()

    def _init_schema(self) -> None:
        path = self.path
        self._add_missing_columns()
        for stmt in ddl():
            self.con.execute(stmt)
        derived.install(self.con)  # the views over the derived tables, with their state written in
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
        self._next_source = max(getattr(self, "_next_source", 1),
                                self.con.execute("SELECT coalesce(max(source_id), 0) FROM sources").fetchone()[0] + 1)
        run_of = dict(self.con.execute("SELECT source_id, run_id FROM sources").fetchall())
        self._run_of: dict[int, str] = {**getattr(self, "_run_of", {}), **run_of}
        self.progress: dict[int, tuple[int, int, int]] = {
            n: (q, s, r) for n, q, s, r in self.con.execute("SELECT * FROM ingest_progress").fetchall()}

    def _add_missing_columns(self) -> None:
        """An existing store of this schema version written by an older build: add the columns it lacks
        (NULL for its old rows). Columns are only ever added within a schema version; check_writable refused
        any other version before the file was opened."""
        have = set(self.con.execute("SELECT table_name, column_name FROM duckdb_columns() "
                                    "WHERE database_name = current_database()").fetchall())
        tables = {t for t, _ in have}
        for table, cols in TABLES.items():
            if table in tables:
                for name, typ, _ in cols:
                    if (table, name) not in have:
                        self.con.execute(f"ALTER TABLE {table} ADD COLUMN {name} {typ}")

    @staticmethod
    def open_readonly(path: str) -> duckdb.DuckDBPyConnection:
        """A read-only connection to a file no agent holds open."""
        return duckdb.connect(path, read_only=True)

    def register_source(self, hello: Hello) -> int:
        """A source_id for a new connection; its sources row is written with the next batch."""
        with self._src_lock:  # not the write lock: the network loop must never wait for a commit
            sid = self._next_source
            self._next_source += 1
            self._run_of[sid] = hello.run_id
            self._pending_sources.append(
                [sid, time.time_ns(), hello.ts_ns, hello.wall_minus_mono_ns, hello.pid, hello.rank,
                 hello.world_size, hello.run_id, hello.model, hello.runtime])
        if not self.defer_sources:
            self.write([])  # used directly (offline builders, tests): write it now
        return sid

    @property
    def quarantine_path(self) -> str:
        """Where rows the store refused for reasons no single record explains are set aside (JSON lines)."""
        return self.path + ".quarantine.jsonl"

    def quarantine(self, kind: str, rows: Sequence[dict], reason: str) -> None:
        """Append `rows` (JSON-able dicts) to the quarantine file (0600), one line each."""
        import json

        # the mode on open, not a umask flip: the umask is the whole process's, and this is the writer thread
        fd = os.open(self.quarantine_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with open(fd, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"kind": kind, "reason": reason, "row": row}, default=str) + "\n")

    def quarantine_sources(self, reason: str) -> int:
        """A write failed on the pending sources rows alone: write each in a transaction of its own and set
        aside (quarantine file) those the store refuses; returns how many were set aside."""
        with self._src_lock:
            rows = list(self._pending_sources)
        cols = [c for c, _, _ in TABLES["sources"]]
        bad = []
        with self._lock:
            for r in rows:
                try:
                    self.con.execute("INSERT INTO sources VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", r)
                except Exception as exc:  # noqa: BLE001 - what the store refuses is set aside below
                    if is_store_failure(exc):
                        raise
                    bad.append(dict(zip(cols, r)))
        with self._src_lock:
            del self._pending_sources[: len(rows)]
        if bad:
            self.quarantine("sources", bad, reason)
        return len(bad)

    def append(self, batches: Iterable[tuple[int, Sequence[Record]]]) -> int:
        """Append records of many sources in one transaction; returns rows written."""
        parts = []
        for source_id, records in batches:
            arrays, control = columnar.split_records(list(records))
            parts.append(Part(source_id, arrays, [r for r in control if type(r) is RunLabel]))
        return self.write(parts)

    def write(self, parts: Sequence[Part]) -> int:
        """Write `parts` (and sources rows registered since the last write) in one transaction; returns
        the rows written. On a store failure (see `is_store_failure`) sets `broken` and re-raises."""
        by_code: dict[int, tuple[list, list]] = defaultdict(lambda: ([], []))
        labels: dict[tuple[str, str], str] = {}
        progress: dict[int, list[int]] = {}
        dup = 0
        for p in parts:
            if p.nonce is not None and p.seq and p.seq <= self.progress.get(p.nonce, (0, 0, 0))[0]:
                dup += 1  # committed before (a probe sent it again after a reconnect): stored once
                continue
            for code, arrs in p.arrays.items():
                for a in arrs:
                    if len(a):
                        by_code[code][0].append(a)
                        by_code[code][1].append((p.source_id, len(a)))
            for r in p.labels:
                labels[(self._run_of.get(p.source_id, ""), r.key)] = r.value
            if p.nonce is not None:
                q, s_, r_ = progress.get(p.nonce) or self.progress.get(p.nonce, (0, 0, 0))
                progress[p.nonce] = [max(q, p.seq or 0), s_ + p.accepted, r_ + p.rejected]
        n = 0
        with self._src_lock:
            new_sources = list(self._pending_sources)
        with self._lock:
            try:
                self.con.execute("BEGIN")
                try:
                    if new_sources:
                        self.con.executemany("INSERT INTO sources VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                             new_sources)
                    for code, (arrs, sids) in by_code.items():
                        ids, lens = zip(*sids)
                        sid = np.repeat(np.array(ids, dtype=np.int32), lens)
                        table, cols, select = columnar.columns(code, sid, arrs, _pa)
                        _insert(self.con, table, cols, select)
                        n += len(sid)
                    # one statement per table, not per row: each costs ~1.5 ms, and a transaction of 16
                    # probes' frames spent 27 ms on 16 progress rows (3.8 ms as one statement)
                    if labels:
                        _upsert(self.con, "run_info", [[r, k, v] for (r, k), v in labels.items()])
                        n += len(labels)
                    if progress:
                        _upsert(self.con, "ingest_progress", [[nonce, *v] for nonce, v in progress.items()])
                    self.con.execute("COMMIT")
                except BaseException:
                    try:
                        self.con.execute("ROLLBACK")
                    except Exception:  # noqa: BLE001 - an invalidated connection cannot roll back
                        pass
                    raise
            except Exception as exc:
                if is_store_failure(exc):
                    self.broken = f"{type(exc).__name__}: {exc}"
                raise
            with self._src_lock:
                del self._pending_sources[: len(new_sources)]
            for nonce, v in progress.items():
                self.progress[nonce] = tuple(v)  # type: ignore[assignment]
        self.duplicate_frames += dup
        self.rows_written += n
        return n

    def reopen(self) -> None:
        """Close the (invalidated) connection and open the file again. Raises if it cannot."""
        with self._lock:
            try:
                self.con.close()
            except Exception:  # noqa: BLE001 - it is broken already
                pass
            self._open()
            self.broken = None

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A connection of this process to the same database, for small reads on other threads (the
        writer's memory limit applies: use `reading()` for queries over whole tables)."""
        with self._lock:
            return self.con.cursor()

    def reading(self) -> ContextManager[duckdb.DuckDBPyConnection]:
        """A cursor for one read (a named query, a retention roll), with DuckDB's memory limit raised to
        `read_memory_limit` until the last concurrent read ends (`reads.Reads`). A read that needs more still
        raises duckdb.OutOfMemoryException: the read API answers 503 and names the flag."""
        return self.reads.reading()

    def interrupt_reads(self) -> int:
        """Interrupt every read in flight (before the final checkpoint at shutdown); returns how many."""
        return self.reads.interrupt()

    def _set_memory_limit(self, limit: str) -> None:
        self._ctl.execute(f"SET memory_limit = '{limit}'")

    def refresh_derived(self, timeout_s: float | None = None) -> int:
        """Fold the request events and steps written since the last refresh into the derived tables
        (`derived.refresh_slices`: `fold_slice_rows` events per transaction, memory bounded by the slice), under
        the read memory limit, until done or `timeout_s` (None: the read time limit); returns the events folded.
        A failure or a timeout is logged, never raised: the views stay exact without the rest, only slower."""
        try:
            with self.reading() as con:
                if not timeout_s:
                    return derived.refresh_slices(con, self.fold_slice_rows)
                with interrupt_after(con, timeout_s):
                    return derived.refresh_slices(con, self.fold_slice_rows)
        except Exception as exc:  # noqa: BLE001 - an optimisation; the raw rows are what counts
            log.warning("could not refresh the derived tables (the slices before stay folded): %r", exc)
            return 0

    def checkpoint(self) -> bool:
        """Checkpoint the WAL into the file; False when DuckDB defers it because another cursor of this
        process has a write transaction open (a read folding the derived tables, a retention roll): the
        store is fine and the next checkpoint runs it. A failure of the file or connection raises."""
        with self._lock:
            try:
                self.con.execute("CHECKPOINT")
            except Exception as exc:
                if is_checkpoint_deferred(exc):
                    return False
                if is_store_failure(exc):
                    self.broken = f"{type(exc).__name__}: {exc}"
                raise
        _private(self.path)
        return True

    def close(self, wait_reads_s: float = 5.0) -> None:
        """Interrupt reads in flight, wait for them to end (up to `wait_reads_s`), checkpoint and close."""
        deadline = time.monotonic() + wait_reads_s
        while self.interrupt_reads() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.refresh_derived(timeout_s=10.0)  # a file at rest reads fast; never holds a shutdown long
        with self._lock:
            try:
                self.con.execute("CHECKPOINT")
            finally:
                self.con.close()


try:  # Arrow is DuckDB's fastest way in; a dict of numpy arrays works without it
    import pyarrow as _pa
except ImportError:  # pragma: no cover - pyarrow comes with the dashboard and test extras
    _pa = None


def _upsert(con: duckdb.DuckDBPyConnection, table: str, rows: list[list]) -> None:
    """INSERT OR REPLACE `rows` (each a full row of `table`, distinct keys) in one statement."""
    one = "(" + ", ".join("?" * len(rows[0])) + ")"
    con.execute(f"INSERT OR REPLACE INTO {table} VALUES " + ", ".join([one] * len(rows)),
                [v for r in rows for v in r])


def _insert(con: duckdb.DuckDBPyConnection, table: str, cols: dict[str, np.ndarray], select: str) -> None:
    """One INSERT of whole columns (DuckDB scans the Arrow table / numpy dict in place)."""
    batch = _pa.table(cols) if _pa is not None else cols  # noqa: F841 - DuckDB finds it by name
    con.execute(f"INSERT INTO {table} SELECT {select} FROM batch")
