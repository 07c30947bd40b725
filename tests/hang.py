"""How long a test waits for something that must happen (issue 31: no verdict depends on load).

A wait returns as soon as its condition holds, so a long bound costs nothing when the code works, while a
short one turns a loaded machine into a failure: under 4 CPU spinners on 2 cores a thread can get an eighth
of a core for minutes (load average up to 19.9 in the busy runs of 2026-12-03). Waits bounded by `HANG_S`
only fail on a hang; a test that judges speed compares within one run instead, or widens its bound by the
machine's scheduling noise measured beside it (`SchedulingLag`).
"""

import threading
import time

import numpy as np

from phasescope.agent.sidecar.host import schedstat  # the sidecar's own reader

HANG_S = 300.0  # seconds
HTTP_S = 60.0  # seconds: one request to a local server of ours (its answer may need a store read)


class SchedulingLag:
    """Samples how late a 10 ms sleep wakes up (s), on a thread of its own: the machine's scheduling noise."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "SchedulingLag":
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            time.sleep(0.01)
            self.lags.append(max(time.monotonic() - t0 - 0.01, 0.0))

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)

    def p99_s(self) -> float:
        return float(np.percentile(self.lags, 99)) if self.lags else 0.0


class RunQueueWait:
    """How much longer than its CPU time a process's main thread took over an interval: (CPU + run-queue wait) /
    CPU, from Linux's /proc/<pid>/schedstat (ns on the CPU, ns runnable but waiting). 1 when the thread got a
    core whenever it could run; k: a CPU-bound task of it takes k times its CPU time in wall time. 1 where the
    file is missing (a kernel without schedstats)."""

    def __init__(self, pid: int) -> None:
        self.path = f"/proc/{pid}/task/{pid}/schedstat"
        self._start = schedstat(self.path)

    def stretch(self) -> float:
        """(CPU + wait) / CPU since this object was made."""
        now = schedstat(self.path)
        if now is None or self._start is None or now[0] <= self._start[0]:
            return 1.0
        return 1.0 + (now[1] - self._start[1]) / (now[0] - self._start[0])


class Blocked:
    """Seconds the calling thread spent blocked inside a `with` block: its wall time less its time on a CPU and
    its time runnable without one (Linux schedstat of this thread). A call that never waits on I/O, a lock or a
    sleep stays near 0 however loaded the machine is, but a wait for a lock (the GIL too) whose holder waits for
    a CPU counts as blocked: judge it against the wait it must not make. Where the file is missing, the wall
    time (no better)."""

    def __init__(self) -> None:
        self.path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        self.s = 0.0

    def __enter__(self) -> "Blocked":
        self._t0, self._start = time.monotonic(), schedstat(self.path)
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self._t0
        now = schedstat(self.path)
        if now is None or self._start is None:
            self.s = wall
        else:
            self.s = max(0.0, wall - (now[0] - self._start[0] + now[1] - self._start[1]) / 1e9)


def cpu_share(wall_s: float = 1.0) -> float:
    """The share of one core (0-1] this thread gets while it spins for `wall_s` seconds: about 1 on a quiet
    machine, 2/6 beside 4 spinners and another busy worker on 2 cores."""
    t0, c0 = time.monotonic(), time.thread_time()
    while time.monotonic() - t0 < wall_s:
        pass
    return min(1.0, (time.thread_time() - c0) / (time.monotonic() - t0))


def timeout_scale(share: float) -> float:
    """How much longer a test's timeout (pytest-timeout, a bound only a hang should reach) is given on a machine
    that gives this process `share` of a core: 1 when quiet, 1/share when not, at most 8x."""
    return min(8.0, max(1.0, 1.0 / max(share, 1e-3)))
