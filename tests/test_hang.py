"""The waits and timeouts of the suite only end hangs (issue 31): their stretch under load is measured."""

import os
import subprocess
import sys
import threading
import time

from hang import HANG_S, Blocked, RunQueueWait, SchedulingLag, cpu_share, timeout_scale


def test_timeout_scale_is_one_when_quiet_and_the_inverse_share_when_not():
    assert timeout_scale(1.0) == 1.0
    assert timeout_scale(0.5) == 2.0 and timeout_scale(1 / 3) == 3.0
    assert timeout_scale(0.1) == 8.0 and timeout_scale(0.0) == 8.0  # at most 8x: a stuck test still ends


def test_cpu_share_sees_a_competing_thread():
    """Two spinning threads of one process take turns on the interpreter: each gets at most about half of the
    wall time (less on a loaded machine, never more), so the share measured beside the other is well under 1."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin)
    t.start()
    try:
        shared = cpu_share(0.6)
    finally:
        stop.set()
        t.join()
    assert 0 < shared < 0.75, shared


def test_scheduling_lag_samples_while_it_runs():
    lag = SchedulingLag().start()
    threading.Event().wait(0.2)
    lag.stop()
    assert len(lag.lags) >= 5 and all(x >= 0 for x in lag.lags) and lag.p99_s() < 0.2


def test_run_queue_wait_sees_a_process_sharing_its_core_with_two_spinners():
    """Three spinning processes pinned to one core: each runs about a third of the time, so one of them took at
    least twice its CPU time in wall time (more when the machine adds load of its own, never less)."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    spin = (f"import os, time\nos.sched_setaffinity(0, {{{cpu}}})\n"
            f"t = time.monotonic()\nwhile time.monotonic() - t < {HANG_S}: pass")
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(3)]
    try:
        deadline = time.monotonic() + HANG_S
        while any(os.sched_getaffinity(p.pid) != {cpu} for p in procs) and time.monotonic() < deadline:
            time.sleep(0.01)  # until each has pinned itself (a loaded machine can take seconds to start python)
        k = RunQueueWait(procs[0].pid)
        time.sleep(1.5)
        stretched = k.stretch()
        assert procs[0].poll() is None  # still spinning: the figure is over the window
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert stretched >= 2.0, stretched


def test_blocked_counts_a_sleep_and_not_a_spin_that_waits_for_its_core():
    """A 0.3 s sleep is 0.3 s blocked; 0.3 s of spinning beside two spinners pinned to the same core is (nearly)
    none, though its wall time is about three times its CPU time."""
    with Blocked() as slept:
        time.sleep(0.3)
    cpu = sorted(os.sched_getaffinity(0))[0]
    spin = (f"import os, time\nos.sched_setaffinity(0, {{{cpu}}})\n"
            f"t = time.monotonic()\nwhile time.monotonic() - t < {HANG_S}: pass")
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    mask = os.sched_getaffinity(0)
    try:
        deadline = time.monotonic() + HANG_S
        while any(os.sched_getaffinity(p.pid) != {cpu} for p in procs) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.sched_setaffinity(threading.get_native_id(), {cpu})
        t0, c0 = time.monotonic(), time.thread_time()
        with Blocked() as spun:
            while time.thread_time() - c0 < 0.3:
                pass
        wall = time.monotonic() - t0
    finally:
        os.sched_setaffinity(threading.get_native_id(), mask)
        for p in procs:
            p.kill()
            p.wait()
    assert 0.29 <= slept.s < 0.3 + HANG_S and spun.s < 0.05, (slept.s, spun.s, wall)
    assert wall >= 0.6  # the spin did share its core (else the test shows nothing)


def test_run_queue_wait_is_one_without_the_file():
    assert RunQueueWait(2**22 + 12345).stretch() == 1.0  # above Linux's largest pid: no such process


def test_the_slowest_files_named_first_exist():
    """A renamed file would silently drop back to the end of the run."""
    from suite_order import SLOWEST_FILES_FIRST

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    missing = [f for f in SLOWEST_FILES_FIRST if not os.path.isfile(os.path.join(root, f))]
    assert missing == [] and len(set(SLOWEST_FILES_FIRST)) == len(SLOWEST_FILES_FIRST)
