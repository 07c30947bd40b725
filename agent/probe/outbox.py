"""The probe's outbox: a bounded ring of records and the thread that ships them to the sidecar.

`push` is the hot path: one append to a `collections.deque` with a `maxlen` (drop-oldest; appends are
atomic under the GIL, so no lock the host could contend), the drop counted. Every `flush_interval_s` the
flush thread calls `tick` (the probe's sampler update and health record), encodes the ring into frames
of at most FRAME_RECORDS records and hands them to the `Sender`, which keeps what the sidecar has not
acknowledged. Without a sidecar the ring holds what it can and drops the oldest (counted); without any
transport (`connect=False`) what is pushed is counted as dropped, never kept.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable

from ..records.events import (MAX_FRAME_BYTES, Hello, ProbeHealth, Record, RequestEvent, Step, encode_frame,
                              record_size)
from .sender import Sender

# records per frame, so one frame always stays under MAX_FRAME_BYTES
_MAX_RECORD_BYTES = max(record_size(c) for c in (Hello, Step, RequestEvent, ProbeHealth)) + 32
FRAME_RECORDS = min(8192, MAX_FRAME_BYTES // _MAX_RECORD_BYTES)


class Outbox:
    """A ring of at most `maxlen` records, flushed every `flush_interval_s` to `sender` or `sink`."""

    def __init__(self, maxlen: int, flush_interval_s: float, sender: Sender | None,
                 sink: Callable[[list[Record]], None] | None, tick: Callable[[bool], None],
                 error: Callable[[BaseException], None], stop: threading.Event) -> None:
        """`sink` (tests, benchmarks) receives record batches in place of a socket; `tick(stopping)` runs
        before each flush; `error(exc)` counts a failure; the thread ends after the flush that follows `stop`."""
        self.ring: collections.deque[Record] = collections.deque(maxlen=maxlen)
        self.maxlen = maxlen
        self.flush_interval_s = flush_interval_s
        self.sender, self.sink = sender, sink
        self._tick, self._error, self._stop = tick, error, stop
        self.records = 0  # pushed (monotonic)
        self.dropped = 0  # dropped: the ring was full, or no transport took them
        self.frames_sent = 0
        self.thread = threading.Thread(target=self._loop, name="phasescope-flush", daemon=True)

    def push(self, rec: Record) -> None:
        """Queue `rec` (the hot path: never blocks, never allocates beyond the deque's slot)."""
        ring = self.ring
        if len(ring) >= self.maxlen:
            self.dropped += 1  # drop-oldest: the deque discards the head on append
        ring.append(rec)
        self.records += 1

    def discard(self) -> int:
        """Drop what is left in the ring (at close), counted; returns how many."""
        n = len(self.ring)
        self.ring.clear()
        self.dropped += n
        return n

    def _loop(self) -> None:
        while True:
            stopping = self._stop.wait(self.flush_interval_s)
            try:
                self._tick(stopping)
                self.flush_once()
            except Exception as exc:  # noqa: BLE001
                self._error(exc)
            if stopping:
                return

    def flush_once(self) -> None:
        """Hand what the ring holds to the sink, or to the sender while it has room."""
        ring, sender = self.ring, self.sender
        if self.sink is not None:
            batch = []
            while ring:
                batch.append(ring.popleft())
            if batch:
                self.sink(batch)
            return
        while ring:
            if sender is None or not sender.ready():
                if sender is None:  # no transport: keep counting, never grow
                    self.discard()
                return  # keep records in the ring until a sidecar appears
            batch: list[Record] = []
            while ring and len(batch) < FRAME_RECORDS:
                batch.append(ring.popleft())
            if sender.send(encode_frame(batch)):
                self.frames_sent += 1
            else:
                self.dropped += len(batch)
                return
