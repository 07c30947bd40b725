"""Issue 25: the probe's account of its whole cost (agent/probe/cost.py) and the budget over it, with
injected clocks: exact values."""

from __future__ import annotations

import pytest
import torch

from phasescope.agent import attach
from phasescope.agent.probe.cost import CostMeter, gil_wait_ns
from phasescope.agent.probe.sampling import BudgetSampler
from phasescope.agent.records.events import PHASE_DECODE, ProbeHealth, decode_frame, encode_frame
from hang import HANG_S


def test_gil_wait_estimate():
    assert gil_wait_ns(100, 1000) == pytest.approx(100 * 100 / 2000)  # h^2 / 2P: 5 ns
    assert gil_wait_ns(1000, 1000) == pytest.approx(500)
    assert gil_wait_ns(3000, 1000) == pytest.approx(2500)  # h - P/2 past one period
    assert gil_wait_ns(100, None) == 0 and gil_wait_ns(0, 1000) == 0


def test_meter_adds_thread_cpu_per_wake_and_shares_over_wall():
    clock = {"cpu": 0, "wall": 0}
    m = CostMeter(thread_ns=lambda: clock["cpu"], perf_ns=lambda: clock["wall"])
    m.interval(0)  # opens the first interval at wall 0
    for _ in range(10):  # 10 wakes of 50 us CPU, 80 us wall, every 100 ms
        m.begin()
        clock["cpu"] += 50_000
        clock["wall"] += 80_000
        m.end(1_000_000)  # 1 ms steps
        clock["wall"] += 100_000_000 - 80_000
    share = m.interval(2_000_000)  # hooks took 2 ms over the second
    assert m.bg_cpu_ns == 500_000 and m.wakes == 10 and m.hold_max_ns == 80_000
    assert share == pytest.approx((2_000_000 + 500_000) / 1e9)
    assert m.gil_wait_ns == pytest.approx(10 * 80_000**2 / 2e6)
    assert m.background_per_wake_ns() == 50_000


def test_budget_counts_the_background_per_step():
    s = BudgetSampler(budget=0.005, seed=1)
    for i in range(1000):  # 1 ms decode steps; untimed 2 us, timed 12 us + 3 us polling
        timed = i % 10 == 0
        s.account(PHASE_DECODE, 1_000_000, 12_000 if timed else 2_000, timed)
        if timed:
            s.account_poll(3_000)
    s.other_ns += 1_000_000  # request events: 1 us per step
    # background: the wakes' CPU = 1.3 ms, of which 0.3 ms was polling (already in the timed steps' extra)
    rates = s.update(background_ns=1_300_000)
    assert s.est_background_us == pytest.approx((1_300_000 - 300_000 + 1_000_000) / 1000 / 1e3)  # 2 us
    assert rates[PHASE_DECODE] == pytest.approx((0.005 * 1000 - 2 - 2) / (12 + 3 - 2))  # 1/13, not 3/13
    assert s.hooks_ns() == 100 * 12_000 + 900 * 2_000 + 1_000_000


def test_a_budgeted_sampler_starts_at_min_rate_an_unbudgeted_one_at_one():
    assert BudgetSampler(budget=0.005, min_rate=0.01).rates[PHASE_DECODE] == 0.01
    assert BudgetSampler(budget=None).rates[PHASE_DECODE] == 1.0


def test_health_carries_the_cost_and_survives_the_wire():
    got = []
    probe = attach(torch.nn.Identity(), sink=got.extend, flush_interval_s=0.01)
    try:
        for _ in range(50):
            with probe.step(decode_tokens=1, num_seqs=1):
                pass
            probe.request_event("r", "token", tokens=1)
        assert probe.flush(HANG_S)
        h = probe.health()
    finally:
        probe.close()
    assert h.probe_cpu_s_total > h.background_cpu_s_total > 0
    assert h.probe_cpu_s_total == pytest.approx(probe.sampler.hooks_ns() / 1e9 + h.background_cpu_s_total)
    assert probe.sampler.other_ns > 0  # the request events are counted
    back = decode_frame(encode_frame([h]))[0]
    assert type(back) is ProbeHealth and back == h


def test_a_descheduled_interval_counts_at_most_the_cap_and_a_costly_hook_lifts_the_cap():
    """Wall-clock self-timing: a step whose hook the OS descheduled for 5 ms counts the cap, not 5 ms; a hook
    that truly costs 300 us (over the floor) is counted in full once the estimate has seen it."""
    from phasescope.agent.probe import sampling as sm
    s = BudgetSampler(budget=0.005, seed=1)
    assert s.cost_cap_ns == sm.INITIAL_COST_CAP_NS
    for i in range(100):  # 2 us hooks; one descheduled for 5 ms
        s.account(PHASE_DECODE, 1_000_000, 5_000_000 if i == 50 else 2_000, False)
    assert s.clipped_total == 1 and s.hooks_ns() == 99 * 2_000 + sm.INITIAL_COST_CAP_NS
    s.update(background_ns=0)
    assert s.cost_cap_ns == sm.COST_CAP_FLOOR_NS  # 4 x ~12 us is under the floor
    for i in range(100):
        s.account(PHASE_DECODE, 1_000_000, 5_000_000 if i == 50 else 2_000, False)
    assert s.clipped_total == 2 and s.hooks_ns() == 99 * 2_000 + sm.INITIAL_COST_CAP_NS + 99 * 2_000 + sm.COST_CAP_FLOOR_NS
    # hooks of 300 us: clipped at the floor at first, the estimate (smoothed) rises, then all count
    for _ in range(12):
        before = s.clipped_total
        for _ in range(100):
            s.account(PHASE_DECODE, 1_000_000, 300_000, False)
        s.update(background_ns=0)
    assert s.clipped_total == before and s.cost_cap_ns >= 4 * 300_000 * 0.9
    # a request event's interval in the probe is capped the same way
    probe = attach(torch.nn.Identity(), connect=False)
    try:
        probe.sampler.cost_cap_ns = 1  # every interval takes longer than 1 ns
        probe.request_event("r", "arrival", tokens=3)
        probe.emit(ProbeHealth(0, 0, 0, 0, 0, 0, 1.0, 0.0, 0.0))
        assert probe.sampler.other_ns == 2
    finally:
        probe.close()
