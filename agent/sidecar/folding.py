"""Live folding: the derived tables (records/derived.py) kept within seconds of the raw rows while the sidecar runs.

Without it the request events were folded only when a reader asked (the read API, at most once per interval) and
at close, all at once: at a busy GPU's rate (~40k token events/s) the fold at close ran out of memory and every
read folded every event again (issue 54). Here a thread folds every `interval_s`, a slice of at most `slice_rows`
events per transaction (`derived.refresh(con, max_rows)`), slice after slice until it has caught up with what
was written when the round began or `budget_s` has passed; while more than a slice is left after a round the
next one starts at once. Each slice runs under the store's read memory limit
(`Store.reading`): its memory is bounded by the slice, not by the history.

Lag: the derived tables hold every raw row written up to `complete_as_of` (monotonic s: the latest sample of the
table's end, taken at each round's start, that the watermark has passed), so `lag_s = now - complete_as_of` is
an upper bound on the age of the oldest row not yet folded. The views stay exact whatever the lag (they fold the
rest in at each read); the lag is what a read pays.

A fold that fails (out of memory, a write conflict it cannot retry, a broken file) is counted in the sidecar's
stats, logged, and stored as a `sidecar_health` row (check 'derived-fold', ok false, the error and the lag), as is
a lag past `alarm_lag_s`; a row with ok true marks the recovery. `diagnose` reads them
(analyzers/telemetry.py `telemetry-store-fold-failed`). One fold at a time in the process: the read API's
fold takes the same lock (`lock`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import duckdb

from ..records import derived
from .stats import SidecarStats

log = logging.getLogger("phasescope.fold")

CHECK = "derived-fold"
BEHIND_WAIT_S = 0.05  # between rounds while more than a slice behind
MIN_SLICE_ROWS = 1000  # the smallest slice a loaded host's interrupts shrink it to
RECORD_EVERY_S = 60.0  # while failing, at most one health row per this many seconds


class LiveFold:
    """The thread that folds new request events into the derived tables, a bounded slice at a time."""

    def __init__(self, store: Any, stats: SidecarStats, lock: threading.Lock, *, interval_s: float,
                 slice_rows: int, budget_s: float, alarm_lag_s: float = 30.0) -> None:
        """`store`: the sidecar's `Store`; `interval_s`: seconds between rounds; `slice_rows`: request events per
        transaction at most; `budget_s`: a round stops starting slices after this many seconds; `alarm_lag_s`: a
        lag past it is stored as a failing health row."""
        if interval_s <= 0 or budget_s <= 0 or alarm_lag_s <= 0:
            raise ValueError("interval_s, budget_s and alarm_lag_s must be > 0")
        if slice_rows < 1:
            raise ValueError(f"slice_rows must be >= 1, got {slice_rows!r}")
        self.store, self.stats, self.lock = store, stats, lock
        self.interval_s, self.slice_rows, self.budget_s, self.alarm_lag_s = interval_s, slice_rows, budget_s, alarm_lag_s
        # the slice in use: halved when a slice outlasts the store's read time limit (a loaded host), doubled
        # back after each round that completes, never above `slice_rows`
        self.cur_slice = slice_rows
        self._ends: collections.deque[tuple[float, int]] = collections.deque()  # (monotonic s, last rowid then)
        self._failing = False
        self._recorded_at = float("-inf")
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.complete_as_of = time.monotonic()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="phasescope-fold", daemon=True)
        self.thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop after the slice in flight (the store's close folds what is left, in slices too)."""
        self._stop.set()
        if self.thread is not None:
            self.thread.join(timeout_s)

    def _run(self) -> None:
        wait = self.interval_s
        while not self._stop.wait(wait):
            self.round()
            # still behind after a whole round: go on at once (the fold then takes up to a core, the writer
            # and the host keep the rest), else the lag grows with the rate (at 80k events/s on 2 cores, folding
            # 3 s in every 5 fell behind by ~23k events/s: benchmarks/gpu_rate.py)
            wait = BEHIND_WAIT_S if self.stats.fold_behind_rows > self.slice_rows else self.interval_s

    def round(self) -> int:
        """One round: slices until caught up with the table's end at its start, or `budget_s`; returns the
        events folded. Never raises (a failure is counted, logged and stored)."""
        t0 = time.monotonic()
        folded = 0
        slices0 = self.stats.fold_slices_total
        try:
            with self.lock, self.store.reading() as con:
                end = _last_rowid(con)
                self._ends.append((t0, end))
                wm = (derived.state(con) or (-1, 0))[0]
                while not self._stop.is_set():
                    n = derived.refresh(con, max_rows=self.cur_slice)
                    folded += n
                    self.stats.fold_slices_total += 1
                    wm = (derived.state(con) or (-1, 0))[0]
                    if wm >= end or n == 0 or time.monotonic() - t0 >= self.budget_s:
                        break
                behind = max(0, _last_rowid(con) - wm)
        except Exception as exc:  # noqa: BLE001 - an optimisation failed; the raw rows and the views are exact
            if isinstance(exc, duckdb.InterruptException) and self._stop.is_set():
                return folded  # the sidecar is closing: its close folds what is left
            self.stats.fold_failures_total += 1
            self.stats.fold_last_error = f"{type(exc).__name__}: {exc}"[:500]
            detail = f"fold failed: {type(exc).__name__}: {exc}"
            if isinstance(exc, duckdb.InterruptException) and not self._stop.is_set():
                # the slice outlasted the read time limit (a loaded host): the next round folds half as much
                self.cur_slice = max(MIN_SLICE_ROWS, self.cur_slice // 2)
                detail = (f"fold interrupted at the store's read time limit after {time.monotonic() - t0:.1f} s "
                          f"(a loaded host); slices now {self.cur_slice} request events")
            log.warning("live fold of the derived tables: %s", detail)
            self._health(False, detail[:1000], None)
            return folded
        if self.stats.fold_slices_total > slices0:  # a slice completed: grow back towards slice_rows
            self.cur_slice = min(self.slice_rows, self.cur_slice * 2)
        now = time.monotonic()
        while len(self._ends) > 1 and self._ends[1][1] <= wm:
            self._ends.popleft()
        if self._ends and self._ends[0][1] <= wm:
            self.complete_as_of = self._ends[0][0]
        lag = now - self.complete_as_of
        self.stats.fold_complete_unix_s = time.time() - lag
        self.stats.fold_events_total += folded
        self.stats.fold_lag_s = lag
        self.stats.fold_behind_rows = behind
        self.stats.fold_lag_max_s = max(self.stats.fold_lag_max_s, lag)
        if lag > self.alarm_lag_s:
            self._health(False, f"behind: the derived tables miss the last {lag:.0f} s of request events "
                                f"({behind} rows; reads fold them in themselves, slower)", lag, behind)
        elif self._failing:
            self._health(True, "caught up", lag, behind)
        return folded

    def _health(self, ok: bool, detail: str, lag: float | None, behind: int | None = None) -> None:
        """Store a health row on a change of state, and at most every RECORD_EVERY_S while failing."""
        now = time.monotonic()
        if (ok and not self._failing) or (not ok and self._failing and now - self._recorded_at < RECORD_EVERY_S):
            return
        self._failing, self._recorded_at = not ok, now
        try:
            con = self.store.cursor()
            try:
                con.execute("INSERT INTO sidecar_health VALUES (?, ?, ?, ?, ?, ?)",
                            [time.time_ns(), CHECK, ok, detail, behind, lag])
            finally:
                con.close()
        except Exception as exc:  # noqa: BLE001 - the store itself is failing: its own checks say so
            log.warning("could not store the fold's health row: %r", exc)


def _last_rowid(con: Any) -> int:
    return int(con.execute("SELECT coalesce(max(rowid), -1) FROM request_events").fetchone()[0])
