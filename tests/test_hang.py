"""The waits and timeouts of the suite only end hangs (issue 31): their stretch under load is measured."""

import threading

from hang import SchedulingLag, cpu_share, timeout_scale


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


def test_the_slowest_files_named_first_exist():
    """A renamed file would silently drop back to the end of the run."""
    import os

    from suite_order import SLOWEST_FILES_FIRST

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    missing = [f for f in SLOWEST_FILES_FIRST if not os.path.isfile(os.path.join(root, f))]
    assert missing == [] and len(set(SLOWEST_FILES_FIRST)) == len(SLOWEST_FILES_FIRST)
