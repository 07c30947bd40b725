"""The writer: one thread that appends what the network loop queued, in one transaction per batch.

It starts a transaction when a DuckDB row group of records is queued, when the senders pause, or every
`batch_interval_s`; acknowledges each batch (through `on_committed`) once committed; hands it to the
sinks (`FanOut`). Nothing can stop it: a batch that fails on its data is written in halves until the
record that fails is isolated (rejected as `write_error`); what no record explains is set aside to the
store's quarantine file after a bounded number of tries; a batch that fails on the store (disk full, I/O)
is kept, the store reopened with backoff, and writing resumes when it can.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

from ..records.events import Hello
from . import columnar
from .fanout import FanOut
from .limits import SidecarLimits
from .stats import Budget, SidecarStats
from .store import Part, Store, is_store_failure

log = logging.getLogger("phasescope.sidecar")

PAUSE_S = 0.01  # no frame queued for this long: the senders paused (the writer then writes what it has)
PAUSE_MIN_ROWS = 8192  # ... if at least a probe's full frame is queued (fewer wait for the batch interval)


class Item:
    __slots__ = ("conn", "part", "nbytes", "hello", "nonce", "rows")

    def __init__(self, conn: Any, part: Part, nbytes: int, hello: Hello | None = None) -> None:
        self.conn, self.part, self.nbytes, self.hello = conn, part, nbytes, hello
        self.nonce = conn.nonce if conn is not None else None
        self.rows = part.rows()


class Writer:
    """Appends queued `Item`s to `store`; `put` is called by the network loop and the collectors' sampler."""

    def __init__(self, store: Store, stats: SidecarStats, limits: SidecarLimits, budget: Budget,
                 on_committed: Callable[[list[Item]], None], fanout: FanOut | None = None) -> None:
        self.store, self.stats, self.limits, self.fanout = store, stats, limits, fanout
        self._budget = budget
        self._on_committed = on_committed
        self._items: collections.deque[Item] = collections.deque()
        self._queued_bytes = 0
        self._queued_rows = 0
        self._qlock = threading.Lock()  # the two counts above: the loop adds, the writer subtracts
        self._last_enqueue = 0.0  # time.monotonic() of the last frame queued
        self._wake = threading.Event()
        self._stop = threading.Event()  # the network side is down: write the rest and close
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="phasescope-writer", daemon=True)
        self.thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, checkpoint and close the store (within `timeout_s`)."""
        self._stop.set()
        self._wake.set()
        if self.thread is not None:
            self.thread.join(timeout_s)

    @property
    def queued(self) -> int:
        """Items queued and not yet taken by a transaction."""
        return len(self._items)

    def put(self, item: Item) -> None:
        """Queue `item`; wakes the writer once a row group (or the byte threshold) is queued."""
        self._items.append(item)
        self._last_enqueue = time.monotonic()
        with self._qlock:
            self._queued_bytes += item.nbytes
            self._queued_rows += item.rows
        self.stats.unwritten_bytes = self._budget.used
        if self._queued_rows >= self.limits.write_start_rows or self._queued_bytes >= self.limits.write_threshold_bytes:
            self._wake.set()

    def _run(self) -> None:
        store = self.store
        assert store is not None
        next_checkpoint = time.monotonic() + self.limits.checkpoint_interval_s
        held: list[Item] = []
        held_parts: list[Part] | None = None  # what of `held` is still unwritten (after a partial isolation)
        backoff = 0.1
        while True:
            stopping = self._stop.is_set()
            if not stopping:
                if held:
                    self._wake.wait(backoff)
                else:
                    self._wait_for_work()
                self._wake.clear()
            items = held
            if not held:  # new frames wait while a held batch cannot be written: order per sender is kept
                taken = 0  # at most 2x the write threshold per transaction: bounded transient memory
                while self._items and taken < 2 * self.limits.write_threshold_bytes:
                    it = self._items.popleft()
                    with self._qlock:
                        self._queued_bytes -= it.nbytes
                        self._queued_rows -= it.rows
                    taken += it.nbytes
                    items.append(it)
                if self._items:
                    self._wake.set()
            held = []
            if items or store._pending_sources:
                try:
                    remaining = self._write(items, held_parts)
                except Exception as exc:  # noqa: BLE001 - a bug must cost this batch, never the writer
                    log.error("writer error (the batch is set aside): %r", exc, exc_info=True)
                    self._quarantine(held_parts or [it.part for it in items], f"writer error: {exc!r}")
                    self._release(items)
                    remaining = None
                if remaining is None:
                    backoff, held_parts = 0.1, None
                else:
                    held, held_parts = items, remaining
                    backoff = min(backoff * 2, 5.0)
                    if stopping:
                        log.error("stopping with %d frames unwritten: the store is broken (%s)", len(held),
                                  self.stats.store_error)
            now = time.monotonic()
            if (stopping or now >= next_checkpoint) and not store.broken:
                try:
                    if stopping:
                        store.close()
                        done = True
                    else:  # deferred while a read folds the derived tables: tried again soon, not an error
                        done = store.checkpoint()
                    if done:
                        self.stats.checkpoints_total += 1
                    else:
                        self.stats.checkpoints_deferred_total += 1
                except Exception as exc:  # noqa: BLE001
                    self._store_failed(exc)
                    done = True
                next_checkpoint = now + (self.limits.checkpoint_interval_s if done else
                                         min(1.0, self.limits.checkpoint_interval_s))
            if stopping:
                return

    def _wait_for_work(self) -> None:
        """Return when a transaction is worth starting: a row group of records is queued (`_wake`), or
        `batch_interval_s` has passed, or at least one full probe frame is queued and nothing has arrived
        for `PAUSE_S` (the senders paused: their windows are full, or a burst ended), so its tail is not
        kept waiting for the interval while the probes wait for its acknowledgement."""
        deadline = time.monotonic() + self.limits.batch_interval_s
        while not self._wake.wait(min(PAUSE_S, max(deadline - time.monotonic(), 0.0))):
            now = time.monotonic()
            if now >= deadline:
                return
            if self._queued_rows >= PAUSE_MIN_ROWS and now - self._last_enqueue >= PAUSE_S:
                return

    def _store_failed(self, exc: BaseException) -> None:
        st = self.stats
        st.store_errors_total += 1
        st.store_ok = 0
        st.store_error = f"{type(exc).__name__}: {exc}"[:300]
        log.error("store failure (%s); the batch is kept and retried", st.store_error)

    def _write(self, items: list[Item], parts: list[Part] | None = None) -> list[Part] | None:
        """Write `items` (or, on a retry, the `parts` of them still unwritten). None when every record is
        accounted for (committed or rejected); else the parts still to write (the store is broken)."""
        store, st = self.store, self.stats
        assert store is not None
        if parts is None:
            parts = [it.part for it in items]
        if store.broken:
            try:
                store.reopen()
                st.store_reopens_total += 1
                log.warning("store reopened after: %s", st.store_error)
            except Exception as exc:  # noqa: BLE001 - still broken: try again later
                self._store_failed(exc)
                return parts
        rows = 0
        todo: list[list[Part]] = [parts]
        # isolating one record takes ~2 log2(n) writes; past this many the failure is not the records'
        tries_left = 8 * max(1, sum(p.rows() for p in parts).bit_length()) + 2 * len(parts) + 8
        set_aside = False
        while todo:
            ps = todo.pop(0)
            tries_left -= 1
            if tries_left < 0:  # never retried forever: set aside what is left, counted
                left = [p for group in [ps] + todo for p in group]
                if set_aside:  # even their accounting rows fail: give up on them, loudly
                    log.error("dropping the delivery accounting of %d part(s): the store refuses it", len(left))
                    break
                self._quarantine(left, "retries exhausted")
                set_aside = True
                todo = [[Part(p.source_id, {}, [], p.nonce, p.seq, p.accepted - p.rows(), p.rejected + p.rows())]
                        for p in left]
                tries_left = 2 * len(todo) + 8
                continue
            try:
                rows += store.write(ps)
                continue
            except Exception as exc:  # noqa: BLE001
                why = f"{type(exc).__name__}: {exc}"[:300]
                if is_store_failure(exc) or store.broken:
                    store.broken = store.broken or f"{type(exc).__name__}: {exc}"
                    self._store_failed(exc)
                    st.rows_written_total += rows
                    return [p for group in [ps] + todo for p in group]
                if ps is parts:
                    st.write_retries_total += 1
                    log.warning("a batch failed on its data (%r); retrying in halves", exc)
            # a data error: write in halves until what fails is one record, and reject that one
            if len(ps) > 1:
                todo[:0] = [ps[: len(ps) // 2], ps[len(ps) // 2:]]
                continue
            halves = _split(ps[0])
            if halves is not None:
                todo[:0] = [[halves[0]], [halves[1]]]
                continue
            p = ps[0]
            bad = p.rows()
            if bad == 0:  # no record left: the failure is in the rows that go with them (a sources row)
                n = store.quarantine_sources(why)
                st.sources_quarantined_total += n
                log.error("set aside %d sources row(s) the store refused (%s); see %s", n, why,
                          store.quarantine_path)
                todo.insert(0, [p])  # without sources rows, it writes only its progress row (tries bound it)
                continue
            st.reject("write_error", bad)
            log.warning("rejected %d record(s) the store refused (source %d)", bad, p.source_id)
            todo.insert(0, [Part(p.source_id, {}, [], p.nonce, p.seq, p.accepted - bad, p.rejected + bad)])
        st.store_ok, st.store_error = 1, ""
        st.rows_written_total += rows
        st.batches_written_total += 1
        self._release(items)
        if self.fanout is not None:
            self.fanout.offer(items)
        return None

    def _release(self, items: list[Item]) -> None:
        """A batch is done with: its bytes leave the budget, and the loop acknowledges it."""
        self._budget.give(sum(it.nbytes for it in items))
        self.stats.unwritten_bytes = self._budget.used
        self._on_committed(items)

    def _quarantine(self, parts: list[Part], reason: str) -> None:
        """Set `parts` aside in the store's quarantine file, counted as rejected (`quarantined`)."""
        store, st = self.store, self.stats
        assert store is not None
        n = sum(p.rows() for p in parts)
        rows = []
        for p in parts:
            for rec in columnar.records_of(p.arrays) + list(p.labels):
                rows.append({"source_id": p.source_id, "type": type(rec).__name__, **rec._asdict()})
        try:
            store.quarantine("record", rows, reason)
        except OSError as exc:
            log.error("could not write the quarantine file %s: %r", store.quarantine_path, exc)
        st.reject("quarantined", n)
        log.error("set aside %d record(s) after %s; see %s", n, reason, store.quarantine_path)


def _split(p: Part) -> tuple[Part, Part] | None:
    """Two halves of a part (by record type, then by rows); None when it holds one record."""
    chunks = [(code, a) for code, arrs in p.arrays.items() for a in arrs if len(a)]
    if len(chunks) > 1:
        mid = len(chunks) // 2
        left, right = chunks[:mid], chunks[mid:]
    elif chunks and len(chunks[0][1]) > 1:
        code, a = chunks[0]
        mid = len(a) // 2
        left, right = [(code, a[:mid])], [(code, a[mid:])]
    elif chunks and p.labels:
        left, right = chunks, []
    elif len(p.labels) > 1:
        left, right = [], []
    else:
        return None

    def arrays(ch: list) -> dict:
        out: dict = collections.defaultdict(list)
        for code, a in ch:
            out[code].append(a)
        return out

    labels_left, labels_right = (p.labels[: len(p.labels) // 2], p.labels[len(p.labels) // 2:]) if not chunks \
        else (p.labels, [])
    a = Part(p.source_id, arrays(left), labels_left, p.nonce, None, 0, 0)
    a.accepted = a.rows()
    b = Part(p.source_id, arrays(right), labels_right, p.nonce, p.seq, p.accepted - a.accepted, p.rejected)
    return a, b
