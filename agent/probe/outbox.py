"""The probe's outbox: a bounded ring of records and the one background thread that empties it.

`_push` is the hot path: one append to a `collections.deque` with a `maxlen` (drop-oldest; appends are
atomic under the GIL, so no lock the host could contend), the drop counted. One background thread wakes
once per interval and does all the background work: it completes the CUDA events (the step timer's
poller), updates the sampler, queues a health record (each second), encodes the ring into frames of at
most WAKE_CHUNK_RECORDS records, sends them and reads the sidecar's acks (`Sender`). The interval is
`flush_interval_s`, shortened (not below `poll_interval_s`) when the step rate would fill a quarter of
the event pool or the ring before the next wake. What that thread costs (its CPU time per wake) is
measured by `cost.CostMeter` and budgeted by the sampler. `flush_now` does one wake's work on the
calling thread (exit hooks, `exit.py`). Without a sidecar the ring holds what it can and drops the
oldest (counted); without any transport (`connect=False`) what is pushed is counted as dropped.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Callable

from ..records.events import (
    Hello,
    ProbeHealth,
    Record,
    RequestEvent,
    Step,
    encode_frame,
    record_size,
    MAX_FRAME_BYTES,
)
from .cost import CostMeter
from .sender import Sender

# records per frame, so one frame always stays under MAX_FRAME_BYTES
_MAX_RECORD_BYTES = max(record_size(c) for c in (Hello, Step, RequestEvent, ProbeHealth)) + 32
FRAME_RECORDS = min(8192, MAX_FRAME_BYTES // _MAX_RECORD_BYTES)
# records encoded per frame by the background thread, which lets the GIL go between frames: a wake holds
# the GIL for one chunk's encode at most (~0.1-1 ms), not for the whole ring's, so a host thread that
# returns from its sync into a busy wake waits for one chunk
WAKE_CHUNK_RECORDS = min(FRAME_RECORDS, 512)


class Outbox:
    """The probe's ring and background wake (a base class of `Probe`: `_push` is the probe's own method,
    no indirection). The wake uses the probe's step timer (`_complete`, `_pending`, `_guard`, `_pool`,
    `sampler`, `steps`), `health()` and `_error(exc)`."""

    def _init_outbox(self, buffer_records: int, flush_interval_s: float, poll_interval_s: float,
                     sender: Sender | None, sink: Callable[[list[Record]], None] | None) -> None:
        """A ring of at most `buffer_records`; `sink` (tests, benchmarks) receives record batches in place
        of `sender`'s socket; intervals in seconds."""
        self.flush_interval_s = flush_interval_s
        self.records = 0  # pushed (monotonic)
        self.dropped = 0  # the ring was full, no transport took them, or left at close
        self.frames_sent = 0
        self._ring: collections.deque[Record] = collections.deque(maxlen=buffer_records)
        self._maxlen = buffer_records
        self._stop = threading.Event()
        self._sink = sink
        self._sender = sender
        self.cost = CostMeter()
        # called by the background wake (every wake, and at flush_now) to push what an adapter keeps as a
        # running value (cumulative counters): the hot path then only adds to an int
        self.periodic: list[Callable[[], None]] = []
        # held by whoever does background work: the background thread's wake, or an exit hook's ship
        self._bg_lock = threading.Lock()
        # the background thread's current wake interval; the first wake comes early, so the sampler
        # measures the step period (and leaves its initial min_rate) soon after attach
        self._interval_s = min(poll_interval_s, flush_interval_s)

    @property
    def connected(self) -> bool:
        """Whether the background thread holds a connection to the sidecar now."""
        return self._sender is not None and self._sender.connected

    def _push(self, rec: Record) -> None:
        ring = self._ring
        if len(ring) >= self._maxlen:
            self.dropped += 1  # drop-oldest: the deque discards the head on append
        ring.append(rec)
        self.records += 1

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until queued records are handed to the socket (or dropped). True if drained."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._ring and not self._pending:
                return True
            time.sleep(0.005)
        return not self._ring and not self._pending

    def flush_now(self, timeout_s: float = 1.0) -> bool:
        """Ship what is buffered now, on the calling thread (exit hooks: SIGTERM, atexit). Never raises.

        Waits (up to `timeout_s`) for the device to finish the timed steps still pending, records
        them, and hands every record to the socket. True if nothing is left behind.
        """
        if self._closed:
            return not self._ring and not self._pending
        if os.getpid() != self._pid:  # a forked child: the socket is the parent's, never write to it
            return False
        deadline = time.monotonic() + timeout_s
        if not self._bg_lock.acquire(timeout=timeout_s):
            return False
        try:
            guard = self._guard
            while self._pending:
                if guard is None or self._pool is None:
                    self._complete()
                elif guard.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    try:
                        if not guard.depth:
                            self._complete()
                    finally:
                        guard.lock.release()
                if not self._pending or time.monotonic() >= deadline:
                    break
                time.sleep(0.001)
            self._run_periodic()
            self._push(self.health())
            self._flush_once()
        except Exception as exc:  # noqa: BLE001
            self._error(exc)
        finally:
            self._bg_lock.release()
        return not self._ring and not self._pending

    def _wake_loop(self) -> None:
        """The one background thread: a wake per interval does poll, sampler, health, encode, send, acks."""
        next_health = 0.0
        meter = self.cost
        last = (time.monotonic(), 0, 0, 0)  # (s, steps, records, timed) at the previous wake
        while True:
            stopping = self._stop.wait(self._interval_s)
            with self._bg_lock:
                meter.begin()
                now = time.monotonic()
                cur = (now, self.steps, self.records, self.sampler.timed_total)
                dt, d_steps = now - last[0], cur[1] - last[1]
                period_ns = dt * 1e9 / d_steps if d_steps > 0 and dt > 0 else None
                try:
                    self._poll_once()
                    self._run_periodic()
                    meter.interval(self.sampler.hooks_ns())
                    self.sampler.update(meter.bg_cpu_ns)
                    if now >= next_health or stopping:
                        self._push(self.health())
                        next_health = now + 1.0
                    self._flush_once()
                except Exception as exc:  # noqa: BLE001
                    self._error(exc)
                meter.end(period_ns)
            self._interval_s = self._next_interval(dt, cur[2] - last[2], cur[3] - last[3])
            last = cur
            if stopping:
                if not self._pending or self._pool is None:
                    return
                time.sleep(self._poll_interval_s)  # close() waits for the device's last timings

    def _run_periodic(self) -> None:
        for fn in self.periodic:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - an adapter's callback never stops the wake
                self._error(exc)

    def _poll_once(self) -> None:
        """Complete finished CUDA timings, never while a capture is open."""
        guard = self._guard
        if guard is None or not self._pending:
            return
        with guard.lock:  # a capture cannot begin while we query; we do not query while one is open
            if not guard.depth:
                self._complete()

    def _next_interval(self, dt_s: float, d_records: int, d_timed: int) -> float:
        """`flush_interval_s`, shortened so that a quarter of the ring or of the event pool at most
        fills before the next wake at the last interval's rates; never below `poll_interval_s`."""
        iv = self.flush_interval_s
        if dt_s > 0:
            if d_records > 0:
                iv = min(iv, 0.25 * self._maxlen * dt_s / d_records)
            if d_timed > 0 and self._pool is not None:
                iv = min(iv, 0.25 * self._pool.size * dt_s / d_timed)
        return max(min(self._poll_interval_s, self.flush_interval_s), iv)

    def _flush_once(self) -> None:
        ring, sender = self._ring, self._sender
        if self._sink is not None:
            batch = []
            while ring:
                batch.append(ring.popleft())
            if batch:
                self._sink(batch)
            return
        while ring:
            if sender is None or not sender.ready():
                if sender is None:  # no transport: keep counting, never grow
                    n = len(ring)
                    ring.clear()
                    self.dropped += n
                return  # keep records in the ring until a sidecar appears
            pop = ring.popleft
            batch: list[Record] = [pop() for _ in range(min(len(ring), WAKE_CHUNK_RECORDS))]
            frame = encode_frame(batch)
            if sender.send(frame):
                self.frames_sent += 1
            else:
                self.dropped += len(batch)
                return
            if ring:
                time.sleep(0)  # let the GIL go: a host thread waiting for it runs before the next chunk
