"""Issue 9 on CPU: capture safety, replay timing, the sampling budget, and hooks opaque to the compiler.

The CUDA parts run against fakes with the same surface (event pool, capture state); the real
thing is `benchmarks/graph_overhead.py` on a GPU.
"""

from __future__ import annotations

import math
import threading
import time
import warnings

import pytest

torch = pytest.importorskip("torch")

from phasescope.agent import attach  # noqa: E402
from phasescope.agent.records.events import PHASE_DECODE, PHASE_MIXED, PHASE_PREFILL, Step  # noqa: E402
from phasescope.agent.probe.cuda_timing import CaptureGuard  # noqa: E402
from phasescope.agent.probe.phases import StepShape  # noqa: E402
from phasescope.agent.probe.sampling import BudgetSampler  # noqa: E402
from hang import HANG_S


# --- fakes with the surface the probe uses -------------------------------------------

class FakeEvent:
    def __init__(self, log: list, done=lambda: True) -> None:
        self.log, self.t, self.done = log, None, done

    def record(self) -> None:
        self.log.append("record")
        self.t = time.perf_counter_ns()

    def query(self) -> bool:
        self.log.append("query")
        return self.done()

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.t - self.t) / 1e6


class FakeSlot:
    def __init__(self, log: list, done=lambda: True) -> None:
        self.start, self.end = FakeEvent(log), FakeEvent(log, done)
        self.readback, self.n_read = None, 0


class FakePool:
    def __init__(self, log: list, size: int = 64, done=lambda: True) -> None:
        self.free = [FakeSlot(log, done) for _ in range(size)]
        self.size = size

    def take(self):
        return self.free.pop() if self.free else None

    def give(self, slot) -> None:
        self.free.append(slot)


class FakeGraph:
    """Stands for torch.cuda.CUDAGraph: capture_begin/capture_end as methods of the class."""

    def __init__(self, fail_begin: bool = False) -> None:
        self.fail_begin = fail_begin

    def capture_begin(self, *a, **k):
        if self.fail_begin:
            raise RuntimeError("capture_begin failed")

    def capture_end(self):
        pass


def fake_cuda(probe, guard: CaptureGuard, log: list, stream_capturing=lambda: False, pool: int = 64,
              done=lambda: True) -> None:
    """Give a CPU probe the CUDA timing path with fakes (pool, guard, stream capture state, GPU progress)."""
    probe._pool = FakePool(log, pool, done)
    probe._guard = guard
    probe._capturing = lambda: bool(guard.depth) or stream_capturing()  # the background thread polls now


def steps_of(records: list) -> list[Step]:
    return sorted((r for r in records if type(r) is Step), key=lambda s: s.step_id)


# --- the capture guard -----------------------------------------------------------------

def test_guard_raises_depth_for_the_capture_and_restores_the_class():
    orig_begin, orig_end = FakeGraph.capture_begin, FakeGraph.capture_end
    guard = CaptureGuard(FakeGraph)
    guard.acquire()
    guard.acquire()  # a second probe
    seen = []
    g = FakeGraph()
    assert FakeGraph.capture_begin is not orig_begin
    g.capture_begin()
    seen.append(guard.depth)
    g.capture_end()
    seen.append(guard.depth)
    assert seen == [1, 0] and guard.captures == 1
    with pytest.raises(RuntimeError):
        FakeGraph(fail_begin=True).capture_begin()
    assert guard.depth == 0  # a capture that never began leaves no depth behind
    guard.release()
    assert FakeGraph.capture_begin is not orig_begin  # one user left
    guard.release()
    assert FakeGraph.capture_begin is orig_begin and FakeGraph.capture_end is orig_end
    guard.release()  # extra releases are harmless


def test_capture_begin_waits_for_a_poll_in_progress():
    guard = CaptureGuard(FakeGraph)
    guard.acquire()
    try:
        order = []
        guard.lock.acquire()  # a poller between query() calls

        def capture():
            FakeGraph().capture_begin()
            order.append(("begun", guard.depth))
            FakeGraph().capture_end()

        t = threading.Thread(target=capture)
        t.start()
        time.sleep(0.05)
        order.append(("poll done", guard.depth))
        guard.lock.release()
        t.join(5)
        assert order == [("poll done", 0), ("begun", 1)]
    finally:
        guard.release()


# --- the probe under capture -------------------------------------------------------------

def test_no_cuda_call_and_no_step_while_a_graph_is_captured():
    model = torch.nn.Linear(4, 4)
    got, log = [], []
    guard = CaptureGuard(FakeGraph)
    guard.acquire()
    probe = attach(model, sink=got.extend, gpu_budget=None, flush_interval_s=0.01)
    fake_cuda(probe, guard, log)
    try:
        x = torch.zeros(2, 4)
        model(x)
        g = FakeGraph()
        g.capture_begin()
        calls_before = len(log)
        for _ in range(5):
            model(x)  # "captured" forwards
            probe.begin_step(decode_tokens=2, num_seqs=2)
            probe.end_step()
        assert len(log) == calls_before  # no event record, no query while capturing
        g.capture_end()
        model(x)
        assert probe.flush(HANG_S)
    finally:
        probe.close()
        guard.release()
    steps = steps_of(got)
    assert [s.step_id for s in steps] == [0, 1]
    assert probe.captured == 10 and probe.errors == 0
    assert all(not math.isnan(s.gpu_ms) for s in steps)
    health = probe.health()
    assert health.captured_total == 10 and health.gpu_timed_total == 2


def test_a_capture_torch_did_not_announce_still_gets_no_cuda_call():
    model = torch.nn.Linear(4, 4)
    got, log = [], []
    guard = CaptureGuard(FakeGraph)
    raw = {"on": False}
    probe = attach(model, sink=got.extend, gpu_budget=None, flush_interval_s=0.01)
    fake_cuda(probe, guard, log, stream_capturing=lambda: raw["on"])
    try:
        raw["on"] = True
        model(torch.zeros(1, 4))
        assert log == []
        raw["on"] = False
        model(torch.zeros(1, 4))
        assert probe.flush(HANG_S)
    finally:
        probe.close()
    assert len(steps_of(got)) == 1 and probe.captured == 1


def test_poller_does_not_query_while_a_capture_is_open():
    model = torch.nn.Linear(4, 4)
    got, log = [], []
    guard = CaptureGuard(FakeGraph)
    guard.acquire()
    probe = attach(model, sink=got.extend, gpu_budget=None, flush_interval_s=0.01, poll_interval_s=0.001)
    gpu_done = threading.Event()  # the step's end event completes only when the test says so
    fake_cuda(probe, guard, log, done=gpu_done.is_set)
    try:
        g = FakeGraph()
        model(torch.zeros(1, 4))  # a timed step still running on the "GPU": the poller keeps asking
        deadline = time.monotonic() + HANG_S
        while log.count("query") < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert log.count("query") >= 3  # the poller is busy when the capture begins
        g.capture_begin()
        queries = log.count("query")
        gpu_done.set()
        time.sleep(0.05)
        assert log.count("query") == queries  # not one query while the capture is open
        g.capture_end()
        assert probe.flush(HANG_S)
        assert log.count("query") > queries
    finally:
        probe.close()
        guard.release()
    assert len(steps_of(got)) == 1


# --- timing a replay -----------------------------------------------------------------

class Clock:
    """A fake clock: every read advances it by `tick` ns."""

    def __init__(self, tick: int = 1000) -> None:
        self.t, self.tick = 0, tick

    def __call__(self) -> int:
        self.t += self.tick
        return self.t


def test_step_api_records_the_runtime_batch_with_a_fake_clock():
    model = torch.nn.Linear(4, 4)
    got = []
    clock = Clock(1000)
    probe = attach(model, sink=got.extend, clock_ns=clock, perf_ns=clock)
    try:
        with probe.step(decode_tokens=16, num_seqs=16, context_tokens=4000):
            clock.t += 1_000_000  # the replay: 1 ms
            model(torch.zeros(16, 4))  # a probed module inside the step records nothing of its own
        probe.begin_step(prefill_tokens=100, decode_tokens=3, num_seqs=4)
        probe.end_step()
        probe.begin_step(PHASE_PREFILL, 1, 7, 0, 0)
        probe.end_step()
        assert probe.flush(HANG_S)
    finally:
        probe.close()
    steps = steps_of(got)
    assert [(s.phase, s.num_seqs, s.prefill_tokens, s.decode_tokens, s.context_tokens) for s in steps] == [
        (PHASE_DECODE, 16, 0, 16, 4000), (PHASE_MIXED, 4, 100, 3, 0), (PHASE_PREFILL, 1, 7, 0, 0)]
    # host time spans exactly the fake replay plus the clock reads between begin and end
    assert 1.0 <= steps[0].host_ms <= 1.01
    assert all(math.isnan(s.gpu_ms) for s in steps)  # CPU: host time only


def test_time_replays_wraps_one_graph_instance_and_close_puts_it_back():
    class Graph:
        def __init__(self):
            self.replays = 0

        def replay(self):
            self.replays += 1

    g, other = Graph(), Graph()
    got = []
    batch = {"n": 8}
    probe = attach(torch.nn.Linear(2, 2), sink=got.extend)
    probe.time_replays(g, lambda: StepShape(PHASE_DECODE, batch["n"], 0, batch["n"], 100))
    for n in (8, 4, 2):
        batch["n"] = n
        g.replay()
    other.replay()  # another instance is not timed
    assert probe.flush(HANG_S)
    probe.close()
    assert g.replays == 3 and "replay" not in g.__dict__
    assert [(s.num_seqs, s.decode_tokens) for s in steps_of(got)] == [(8, 8), (4, 4), (2, 2)]


# --- the sampling budget ---------------------------------------------------------------

def test_rates_follow_the_budget_formula():
    s = BudgetSampler(budget=0.005, seed=1)
    # decode steps of 1 ms, prefill steps of 50 ms; untimed steps cost 2 us, timed 12 us + 3 us of polling
    for i in range(1000):
        timed = i % 10 == 0
        s.account(PHASE_DECODE, 1_000_000, 12_000 if timed else 2_000, timed)
        if timed:
            s.account_poll(3_000)
    for _ in range(10):
        s.account(PHASE_PREFILL, 50_000_000, 2_000, False)
    rates = s.update()
    extra = 12 + 3 - 2
    assert rates[PHASE_DECODE] == pytest.approx((0.005 * 1000 - 2) / extra)
    assert rates[PHASE_PREFILL] == 1.0  # 0.5% of 50 ms pays for timing every prefill
    # a step cheaper than the probe's own untimed cost: a trickle at min_rate, never zero
    for _ in range(30):  # windows of 100 us steps: the smoothed period converges
        for _ in range(100):
            s.account(PHASE_DECODE, 100_000, 2_000, False)
        s.update()
    assert s.rates[PHASE_DECODE] == s.min_rate > 0


def test_sampling_is_uniform_within_a_phase_whatever_the_step_duration():
    """Slow and fast decode steps are timed at the same rate: per-phase means stay unbiased."""
    model = torch.nn.Linear(4, 4)
    got, log = [], []
    probe = attach(model, sink=got.extend, gpu_budget=0.005, flush_interval_s=0.01, seed=7)
    fake_cuda(probe, CaptureGuard(FakeGraph), log, pool=5000)
    probe.sampler.rates[PHASE_DECODE] = 0.3
    probe.sampler.budget = None  # hold the rate fixed for the count below
    try:
        for i in range(4000):
            slow = i % 2 == 0
            probe.begin_step(decode_tokens=1, num_seqs=1)
            if slow:
                time.sleep(0)
            probe.end_step()
        assert probe.flush(HANG_S)
    finally:
        probe.close()
    steps = steps_of(got)
    assert len(steps) == 4000  # every step recorded with host time
    timed = [s for s in steps if not math.isnan(s.gpu_ms)]
    even = sum(1 for s in timed if s.step_id % 2 == 0) / 2000
    odd = sum(1 for s in timed if s.step_id % 2 == 1) / 2000
    # binomial(2000, 0.3): sd 0.010; 4.5 sd apart would fail
    assert abs(even - 0.3) < 0.045 and abs(odd - 0.3) < 0.045
    assert probe.health().gpu_sample_rate == pytest.approx(len(timed) / 4000)


def test_budget_lowers_the_rate_of_fast_steps_on_a_live_probe():
    model = torch.nn.Linear(4, 4)
    got, log = [], []
    probe = attach(model, sink=got.extend, gpu_budget=0.005, flush_interval_s=0.01, seed=3)
    fake_cuda(probe, CaptureGuard(FakeGraph), log)
    try:
        t_end = time.monotonic() + 0.5
        while time.monotonic() < t_end:  # back-to-back steps of a few us: far below budget
            probe.begin_step(decode_tokens=1, num_seqs=1)
            probe.end_step()
        assert probe.flush(HANG_S)
    finally:
        probe.close()
    assert probe.sampler.rates[PHASE_DECODE] == probe.sampler.min_rate
    assert probe.health().gpu_sample_rate < 0.2


# --- hooks opaque to the compiler ---------------------------------------------------------

def test_hooks_are_compiler_disabled_and_compiling_adds_no_phasescope_warning():
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    got = []
    probe = attach(model, sink=got.extend)
    for hook in (*model._forward_pre_hooks.values(), *model._forward_hooks.values()):
        assert getattr(hook, "_torchdynamo_disable", False)
    compiled = torch.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            for _ in range(6):
                compiled(torch.randn(2, 8))
    probe.flush(5)
    probe.close()
    torch._dynamo.reset()
    assert [str(w.message) for w in caught if "time." in str(w.message) or "phasescope" in str(w.message)] == []
    assert len(steps_of(got)) == 6 and probe.errors == 0


def test_idle_gaps_do_not_buy_timing_budget():
    """Bursts of 1 ms steps with 1 s pauses: the period is the steps', not the pauses'."""
    s = BudgetSampler(budget=0.005, seed=1)
    for _ in range(20):
        s.account(PHASE_DECODE, 900_000_000, 2_000, False)  # the pause before the burst
        for _ in range(100):
            s.account(PHASE_DECODE, 1_000_000, 2_000, False)
        s.account_poll(0)
        s.update()
    assert s.est_period_us[PHASE_DECODE] == pytest.approx(1000, rel=0.02)  # not ~9,900 us with the pauses
