"""The reads in flight on the live store (named queries, retention rolls, the derived tables' fold).

DuckDB has one memory limit per database instance and no other process may open the file while the
sidecar writes, so reads share the writer's instance: while any read runs the limit is raised to
`read_memory_limit` (exact quantiles cannot spill: a p99 over 10M steps needs ~250 MB), and lowered back
to the writer's `memory_limit` when the last one ends (DuckDB then frees what it held). Each read runs on
a cursor of its own, is interrupted after `read_timeout_s`, and all of them at shutdown.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import duckdb

log = logging.getLogger("phasescope.store")


class Reads:
    """Counts the reads in flight and sets DuckDB's memory limit for them (through `set_limit`)."""

    def __init__(self, cursor: Callable[[], duckdb.DuckDBPyConnection], set_limit: Callable[[str], None],
                 memory_limit: str | None, read_memory_limit: str | None, read_timeout_s: float) -> None:
        """`cursor()`: a new cursor on the store's database; `set_limit(limit)`: sets its memory limit;
        `memory_limit`: the writer's (None: DuckDB's default); `read_memory_limit`: while a read runs (None:
        no change); `read_timeout_s` (> 0): a read still running after this long is interrupted."""
        if read_timeout_s <= 0:
            raise ValueError("read_timeout_s must be > 0")
        self._cursor, self._set_limit = cursor, set_limit
        self.memory_limit, self.read_memory_limit, self.read_timeout_s = memory_limit, read_memory_limit, read_timeout_s
        self._count = 0  # reads in flight; guarded by _lock
        self._cons: set[duckdb.DuckDBPyConnection] = set()  # their cursors (interrupted at close)
        self._lock = threading.Lock()

    def limit(self) -> str | None:
        """The memory limit the database should have now (what a reopened connection is set to)."""
        return self.read_memory_limit if self._count and self.read_memory_limit else self.memory_limit

    @contextmanager
    def reading(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A cursor for one read, under the read memory limit and the read time limit."""
        self._counted(+1)
        try:
            con = self._cursor()
            with self._lock:
                self._cons.add(con)
            try:
                with interrupt_after(con, self.read_timeout_s):
                    yield con
            finally:
                with self._lock:
                    self._cons.discard(con)
                con.close()
        finally:
            self._counted(-1)

    def interrupt(self) -> int:
        """Interrupt every read in flight; returns how many."""
        with self._lock:
            cons = list(self._cons)
        for con in cons:
            try:
                con.interrupt()
            except Exception:  # noqa: BLE001 - it may have just closed
                pass
        return len(cons)

    def _counted(self, delta: int) -> None:
        with self._lock:
            before, self._count = self._count, self._count + delta
            if not (self.memory_limit and self.read_memory_limit) or (before and self._count):
                return
            limit = self.read_memory_limit if self._count else self.memory_limit
            try:
                self._set_limit(limit)
            except Exception as exc:  # noqa: BLE001 - a broken connection: the writer reopens it
                log.warning("could not set DuckDB memory_limit to %s: %r", limit, exc)


# how often a read past its time limit is interrupted again, s
REINTERRUPT_EVERY_S = 0.05


@contextmanager
def interrupt_after(con: duckdb.DuckDBPyConnection, timeout_s: float) -> Iterator[None]:
    """Interrupt `con` once `timeout_s` (s) has passed, and again every REINTERRUPT_EVERY_S until the block ends.
    Once is not enough: DuckDB's interrupt stops the statement running at that moment, and one that lands between
    two statements of a read (the fold's, or Python work between them on a busy host) is lost, so the next
    statement ran unbounded: an endless read held the read API for 30 s at load ~10 (tests/agent/test_zero_loss)."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(timeout_s):
            return
        while not done.is_set():
            try:
                con.interrupt()
            except Exception:  # noqa: BLE001 - it may have just closed
                return
            done.wait(REINTERRUPT_EVERY_S)

    watcher = threading.Thread(target=watch, name="phasescope-read-limit", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
