"""The sidecar's own counters and the byte budgets its parts share (records of the sidecar itself)."""

from __future__ import annotations

import asyncio
import threading


class SidecarStats:
    """Counters of the sidecar itself (monotonic, except the gauges marked so)."""

    def __init__(self) -> None:
        self.connections_total = 0
        self.open_connections = 0  # gauge
        self.connections_refused_total = 0  # over max_connections
        self.connections_closed_total: dict[str, int] = {}  # by reason: end, timeout, handshake_timeout,
        # partial_budget (no room for a frame before its deadline), bad_frame, auth, evicted (unverified pool
        # full), replaced (its sender connected again), lost, shutdown, error, refused
        self.auth_failures_total = 0  # wrong or missing token
        self.timeouts_total = 0  # idle or per-frame read deadline passed
        self.frames_total = 0
        self.records_total = 0
        self.bad_frames_total = 0
        self.records_rejected_total: dict[str, int] = {}  # by reason (columnar.REASONS, write_error, quarantined)
        self.records_dropped_total = 0  # records the sidecar let go without storing (always 0: backpressure)
        self.rows_written_total = 0
        self.batches_written_total = 0
        self.write_retries_total = 0  # batches retried in halves
        self.sources_quarantined_total = 0  # sources rows the store refused, set aside (quarantine file)
        self.store_errors_total = 0  # writes or checkpoints that failed on the file/connection
        self.store_reopens_total = 0
        self.store_ok = 1  # gauge: 0 while the store is broken (disk full, I/O error)
        self.store_error = ""  # the last store failure, "" when fine
        self.unwritten_bytes = 0  # gauge: budget in use by received-but-unwritten frames
        self.memory_budget_bytes = 0  # gauge: the budget
        self.checkpoints_total = 0
        self.checkpoints_deferred_total = 0  # refused while another cursor wrote (a read's fold); retried
        self.sink_errors_total = 0
        self.sink_dropped_records_total = 0  # records the exporters did not see (they lagged)
        self.collector_errors_total = 0
        # the live fold of the derived tables (folding.py)
        self.fold_slices_total = 0  # slices folded (one transaction each)
        self.fold_events_total = 0  # request events folded in
        self.fold_failures_total = 0  # rounds that failed (each also a sidecar_health row, at most one a minute)
        self.fold_last_error = ""  # the last failure, "" when none
        self.fold_lag_s = 0.0  # gauge: age bound of the oldest request event not yet folded after the last round, s
        self.fold_lag_max_s = 0.0  # gauge: the largest fold_lag_s seen
        self.fold_behind_rows = 0  # gauge: request events past the watermark after the last round
        self.fold_complete_unix_s = 0.0  # gauge: the derived tables hold every request event written before this
        # wall time (Unix s; 0 before the first round): the lag now is time.time() minus it

    def reject(self, reason: str, n: int) -> None:
        self.records_rejected_total[reason] = self.records_rejected_total.get(reason, 0) + n

    def closed(self, reason: str) -> None:
        self.connections_closed_total[reason] = self.connections_closed_total.get(reason, 0) + 1


class Budget:
    """Bytes that may be held at once; the network loop waits (stops reading) while it is spent.
    `take` runs on the loop; `give` may come from any thread."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._event = loop, asyncio.Event()

    def try_take(self, n: int) -> bool:
        with self._lock:
            if self.used and self.used + n > self.limit:
                return False
            self.used += n
            return True

    async def take(self, n: int) -> None:
        assert self._event is not None
        while not self.try_take(n):
            self._event.clear()
            if self.try_take(n):
                return
            await self._event.wait()

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n
        if self._loop is not None and self._event is not None:
            try:
                self._loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # loop closed at shutdown
                pass
