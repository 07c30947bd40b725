"""The probe's whole cost: its hooks, its background thread, and an estimate of the GIL wait it causes.

What is counted, per interval between two background wakes (all in ns):

- hooks: the hook bodies' own time on the host thread (`BudgetSampler.account`, perf_counter);
- background: the CPU time of the probe's background thread over the interval, read by that thread
  itself with `time.thread_time_ns()` (CLOCK_THREAD_CPUTIME_ID, the clock `pthread_getcpuclockid`
  names): poll of CUDA events, sampler update, encode, send and acks;
- GIL wait (an estimate, not a measurement): the host thread that returns from a sync (the GIL
  released, e.g. waiting for the token a sampler needs) must wait while our thread holds the GIL.
  A wake that holds the GIL `h` ns starts at a random time in a step period `P`; if the host spends
  the step waiting on the device with the GIL released (the shape of a graph-replayed step), it
  returns into the hold with probability h/P and then waits h/2 on average, so the expected wait
  per wake is `h^2 / (2P)` for h <= P, and `h - P/2` for h > P. `h` is the wake's wall time (an
  upper bound of the GIL hold: it includes the syscalls that release the GIL). No step period
  known (idle): no host step to delay, 0.

The total share is `(hooks + background) / wall`: every CPU ns the probe spends, on any thread, as
a share of the interval. It over-counts the host's slowdown where a spare core runs our thread
while the host waits on its sync, and it is the exact cost where the host's thread has no spare
core; the GIL wait is the part the host's own thread pays on a machine with spare cores, and is
reported apart (`gil_wait_est`).
"""

from __future__ import annotations

import time
from typing import Callable


def gil_wait_ns(hold_ns: int, period_ns: float | None) -> float:
    """Expected wait (ns) of a host thread returning from a GIL-free sync into one wake's hold."""
    if not period_ns or period_ns <= 0 or hold_ns <= 0:
        return 0.0
    if hold_ns <= period_ns:
        return hold_ns * hold_ns / (2.0 * period_ns)
    return hold_ns - period_ns / 2.0


class CostMeter:
    """Accumulates the background thread's cost per wake; read by the same thread (no locks).

    `begin()`/`end()` bracket one wake's work; `end` takes the host's mean step period (ns, or None).
    """

    __slots__ = ("bg_cpu_ns", "gil_wait_ns", "wakes", "hold_ns", "hold_max_ns", "share", "gil_share",
                 "_cpu0", "_wall0", "_last", "_thread_ns", "_perf_ns")

    def __init__(self, thread_ns: Callable[[], int] = time.thread_time_ns,
                 perf_ns: Callable[[], int] = time.perf_counter_ns) -> None:
        self._thread_ns = thread_ns
        self._perf_ns = perf_ns
        self.bg_cpu_ns = 0  # CPU time of the background thread over its wakes (monotonic)
        self.gil_wait_ns = 0.0  # estimated host wait for the GIL (monotonic)
        self.wakes = 0
        self.hold_ns = 0  # wall time of the wakes' work (monotonic): the GIL hold's upper bound
        self.hold_max_ns = 0
        self.share = 0.0  # (hooks + background) / wall over the last interval
        self.gil_share = 0.0  # (hooks + GIL wait estimate) / wall over the last interval
        self._cpu0 = self._wall0 = 0
        # (perf_ns, hooks_ns, bg_cpu_ns, gil_wait_ns) at the last interval's end
        self._last: tuple[int, int, int, float] | None = None

    def begin(self) -> None:
        self._cpu0 = self._thread_ns()
        self._wall0 = self._perf_ns()

    def end(self, period_ns: float | None) -> None:
        """One wake done: add its CPU time, its hold and the GIL wait it may cause."""
        wall1 = self._perf_ns()
        hold = wall1 - self._wall0
        self.bg_cpu_ns += self._thread_ns() - self._cpu0
        self.hold_ns += hold
        if hold > self.hold_max_ns:
            self.hold_max_ns = hold
        self.wakes += 1
        self.gil_wait_ns += gil_wait_ns(hold, period_ns)

    def interval(self, hooks_ns: int) -> float:
        """Close an interval at now, given the hooks' cumulative time (ns); returns the total share."""
        now = self._perf_ns()
        cur = (now, hooks_ns, self.bg_cpu_ns, self.gil_wait_ns)
        last, self._last = self._last, cur
        if last is not None and now > last[0]:
            wall = now - last[0]
            hooks = hooks_ns - last[1]
            self.share = (hooks + self.bg_cpu_ns - last[2]) / wall
            self.gil_share = (hooks + self.gil_wait_ns - last[3]) / wall
        return self.share

    def background_per_wake_ns(self) -> float:
        """Mean CPU time of one wake (ns)."""
        return self.bg_cpu_ns / self.wakes if self.wakes else 0.0
