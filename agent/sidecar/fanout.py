"""Fan-out: committed batches handed to the sinks (exporters) on a thread of their own, within a budget.

Ingestion never waits for a sink: what the sinks cannot take in time is counted
(`sink_dropped_records_total`). Sinks may take records of some types as numpy columns (`Chunk`s, views of
the committed frames: nothing is copied), so an exporter keeps up with a million records a second.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, NamedTuple, Protocol, Sequence

from ..records.events import Record
from . import columnar
from .stats import SidecarStats

log = logging.getLogger("phasescope.sidecar")

Batch = list[tuple[int, list[Any]]]  # (source_id, records) in arrival order; a source's Hello comes first;
# records are NamedTuples, or `Chunk`s of the types a sink takes as columns (`columnar_types`)


class Chunk(NamedTuple):
    """Committed records of one type as columns: `rows` is a numpy structured array with a field per field
    of `cls` (numbers as sent, text as NUL-padded bytes) plus `_type`, in arrival order."""

    cls: type
    rows: Any


class RecordSink(Protocol):
    """A consumer of everything the sidecar stores (exporters): called on the sinks' thread.

    A sink may have `record_types` (a set of record classes): the sidecar then hands it only records of
    those types (Hello and RunLabel always come), and turns only the types some sink reads into NamedTuples.
    Without it, every record comes (turning columns back into records costs ~1 us each).
    A sink may have `columnar_types` (record classes; of its `record_types` when it has those): records of
    these types come as `Chunk`s (one per frame and type) in place of the records, where they would have
    been in the batch, so the sink can take a million records a second with numpy instead of a Python loop."""

    def on_records(self, batch: Batch) -> None: ...

    def close(self) -> None: ...


class FanOut:
    """Hands committed batches to `sinks` on the thread `start` starts; `offer` is called by the writer."""

    def __init__(self, sinks: Sequence[RecordSink], stats: SidecarStats, queue_batches: int = 64,
                 budget_bytes: int = 32 << 20) -> None:
        self.sinks = list(sinks)
        self.stats = stats
        self._queue: queue.Queue = queue.Queue(maxsize=queue_batches)
        self._budget = budget_bytes
        self._bytes = 0  # bytes of the records in _queue (only the types the sinks read)
        self._lock = threading.Lock()  # _bytes: the writer adds, the sinks' thread subtracts
        self._want: set[type] | None = set()  # record classes some sink reads; None: every type
        # per sink: (the types it reads, None: all; the types it takes as Chunks)
        self._plan: list[tuple[RecordSink, frozenset | None, frozenset]] = []
        for sink in self.sinks:
            types = getattr(sink, "record_types", None)
            cols = frozenset(getattr(sink, "columnar_types", None) or ())
            if types is None or self._want is None:
                self._want = None
            else:
                self._want |= set(types) | cols
            self._plan.append((sink, None if types is None else frozenset(types) | cols, cols))
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.sinks:
            self._thread = threading.Thread(target=self._run, name="phasescope-sinks", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Hand over what is queued, close the sinks, and end the thread (within `timeout_s`)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)

    def offer(self, items: Sequence[Any]) -> None:
        """Queue what the sinks read of a committed batch (views of its frames: nothing is copied; what no
        sink reads is not kept), within `sink_budget_bytes`."""
        want, st = self._want, self.stats
        out, nbytes, rows = [], 0, 0
        for it in items:
            p = it.part
            arrays = {code: arrs for code, arrs in p.arrays.items()
                      if want is None or columnar.TYPES[code].cls in want}
            n = sum(a.nbytes for arrs in arrays.values() for a in arrs)
            if arrays or p.labels or it.hello is not None:
                out.append((p.source_id, it.hello, arrays, p.labels))
                nbytes += n
                rows += sum(len(a) for arrs in arrays.values() for a in arrs)
        if not out:
            return
        with self._lock:
            over = self._bytes and self._bytes + nbytes > self._budget
            if not over:
                self._bytes += nbytes
        if not over:
            try:
                self._queue.put_nowait((out, nbytes))
                return
            except queue.Full:
                with self._lock:
                    self._bytes -= nbytes
        st.sink_dropped_records_total += rows

    def _run(self) -> None:
        while True:
            got = self._queue.get()
            if got is None:
                break
            parts, nbytes = got
            tuples: dict[tuple[int, int], list[Record]] = {}  # (part, type code) -> NamedTuples, made once
            batches = [(sink, _sink_batch(parts, types, cols, tuples)) for sink, types, cols in self._plan]
            del parts, got, tuples
            # out of the budget now, as before Chunks: one batch in the sinks' hands besides the budget (Chunks
            # are views of its frames, which stay alive until the sinks are done)
            with self._lock:
                self._bytes -= nbytes
            for sink, batch in batches:
                try:
                    sink.on_records(batch)
                except Exception as exc:  # noqa: BLE001 - an exporter must not stop ingestion
                    self.stats.sink_errors_total += 1
                    log.warning("sink %s failed: %r", type(sink).__name__, exc)
            batches = batch = None  # type: ignore[assignment]
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("sink %s close failed: %r", type(sink).__name__, exc)


def _sink_batch(parts: list, types: frozenset | None, cols: frozenset,
                tuples: dict[tuple[int, int], list[Record]]) -> Batch:
    """One sink's batch of queued `parts` ((source_id, hello, arrays by type code, labels)): the records of
    `types` (None: all), those of `cols` as Chunks; NamedTuples are made once per part and type (`tuples`)."""
    batch: Batch = []
    for i, (source_id, hello, arrays, labels) in enumerate(parts):
        recs: list = [hello] if hello is not None else []
        for code, arrs in arrays.items():
            cls = columnar.TYPES[code].cls
            if cls in cols:
                recs.extend(Chunk(cls, a) for a in arrs if len(a))
            elif types is None or cls in types:
                got = tuples.get((i, code))
                if got is None:
                    got = tuples[(i, code)] = columnar.records_of({code: arrs})
                recs.extend(got)
        recs.extend(labels)
        if recs:
            batch.append((source_id, recs))
    return batch
