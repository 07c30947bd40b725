"""Which steps get CUDA-event timing: a host-cost budget, sampled uniformly within each phase.

Every step keeps its host timestamps. Timing a step on the GPU costs more host time
(two event records on the host thread, a query and an elapsed-time read on the
background wake, which holds the GIL meanwhile). The sampler keeps the probe's
average host cost per step under `budget` (a fraction, default 0.5%) of the step
period it measures, per phase:

    rate[p] = clamp((budget * period_us[p] - untimed_cost_us - background_us) / extra_cost_us, min_rate, 1)

where `period_us[p]` is the mean time between the starts of consecutive steps of
phase p, `untimed_cost_us` the probe's measured cost of an untimed step (its hook
bodies), `background_us` the background thread's CPU time per step that is not
event polling (encode, send, acks, sampler: see `cost.py`) plus the host-thread time
of records made outside steps (request events, adapters' snapshots) and `extra_cost_us` what
timing adds (hook bodies on timed steps plus the poll work per event). So the
budget bounds everything the probe does, not only its hooks. Decisions are Bernoulli draws at `rate[p]` from a private
PRNG, independent of the step's duration: within a phase every step has the same
chance, so per-phase means over the timed steps are unbiased estimates of the
phase's GPU time. `min_rate` keeps a trickle of timed steps when even an untimed
step costs more than the budget.

Every self-timed interval (a step's hook bodies, one record made outside a step) is counted at most
`cost_cap_ns`: COST_CAP_FACTOR x the current per-step estimate, at least COST_CAP_FLOOR_NS. The clocks
are wall clocks (a CPU-time clock costs ~1 us a read, the whole budget of a fast step), so an interval
the OS descheduled the thread in, or one spent waiting for the GIL the background wake holds (counted
as its CPU already), would count milliseconds the probe did not spend: on a loaded 2-core host the
reported hook share read 35% of the step against a measured 5% slowdown. Clipped intervals are
counted (`clipped_total`); a hook that truly costs more raises the estimate, and the cap, within a
few updates.

Lock-free by construction: the host thread only adds to its own accumulators
(`account_*`); `update()` (the background wake) reads them and keeps the previous
readings to take differences, so nothing is ever reset under the host's feet.
"""

from __future__ import annotations

import random

N_PHASES = 4  # events.PHASES
# gaps between steps longer than this are idle time, not a step period; so is a gap longer than
# IDLE_FACTOR times the phase's current period estimate (idle time must not buy timing budget)
MAX_PERIOD_NS = 1_000_000_000
IDLE_FACTOR = 4
# a first guess of what timing a step adds (us), until measured
INITIAL_EXTRA_US = 20.0
# the most one self-timed interval counts (see the module doc): the cap until the first estimate, its floor,
# and its factor over the estimated per-step cost
INITIAL_COST_CAP_NS = 1_000_000
COST_CAP_FLOOR_NS = 100_000
COST_CAP_FACTOR = 4


class BudgetSampler:
    """Per-phase sampling rates for CUDA-event timing under a host-cost budget.

    `budget` is a fraction of the step period (0.005 = 0.5%); `budget=None`
    times every step (rate 1). `smoothing` weights each new window's estimate.
    """

    __slots__ = ("budget", "min_rate", "smoothing", "rates", "draw", "period_ns", "period_n",
                 "untimed_ns", "untimed_n", "timed_ns", "timed_n", "poll_ns", "poll_n", "period_cap_ns",
                 "_last", "est_period_us", "est_untimed_us", "est_extra_us", "est_background_us", "timed_total",
                 "steps_total", "_bg_last", "other_ns", "cost_cap_ns", "clipped_total")

    def __init__(self, budget: float | None = 0.005, min_rate: float = 0.001, seed: int | None = None,
                 smoothing: float = 0.3) -> None:
        if budget is not None and not (0 < budget <= 1):
            raise ValueError("gpu_budget must be within (0, 1] (a fraction of the step time), or None")
        if not (0 < min_rate <= 1):
            raise ValueError("min_rate must be within (0, 1]")
        self.budget = budget
        self.min_rate = min_rate
        self.smoothing = smoothing
        # read by the host thread on every step; until the first update() has measured a period, a budgeted
        # sampler times at min_rate: at rate 1 the first interval's steps cost what timing costs (~60 us
        # each on an H200 host), which was most of the cost measured from attach() (issue 25)
        self.rates = [1.0 if budget is None else min_rate] * N_PHASES
        self.draw = random.Random(seed).random
        # accumulators: written by the host thread (period, hook costs) and the poller (poll costs)
        self.period_ns = [0] * N_PHASES
        self.period_n = [0] * N_PHASES
        self.period_cap_ns = [MAX_PERIOD_NS] * N_PHASES  # set by update() from the estimates
        self.untimed_ns = self.untimed_n = 0
        self.timed_ns = self.timed_n = 0
        self.poll_ns = self.poll_n = 0
        self.other_ns = 0  # host-thread time of records made outside steps (request events, adapters' emits)
        self.cost_cap_ns = INITIAL_COST_CAP_NS  # the most one interval counts: set by update()
        self.clipped_total = 0  # step costs counted at the cap
        self.timed_total = self.steps_total = 0
        self._last: tuple = ()
        self.est_period_us: list[float | None] = [None] * N_PHASES
        self.est_untimed_us: float | None = None
        self.est_extra_us: float | None = None
        self.est_background_us: float | None = None  # background CPU per step, poll work excluded
        self._bg_last: tuple[int, int, int, int] = (0, 0, 0, 0)  # (background, poll, other ns, steps) at the last update

    # --- host thread ------------------------------------------------------

    def take(self, phase: int) -> bool:
        """Whether this step of `phase` gets CUDA-event timing."""
        return self.draw() < self.rates[phase]

    def account(self, phase: int, period_ns: int, cost_ns: int, timed: bool) -> None:
        """One finished step: time since the previous step's start (ns), the probe's cost (ns, counted at most
        `cost_cap_ns`)."""
        if cost_ns > self.cost_cap_ns:
            cost_ns = self.cost_cap_ns
            self.clipped_total += 1
        if 0 < period_ns < self.period_cap_ns[phase]:
            self.period_ns[phase] += period_ns
            self.period_n[phase] += 1
        self.steps_total += 1
        if timed:
            self.timed_ns += cost_ns
            self.timed_n += 1
            self.timed_total += 1
        else:
            self.untimed_ns += cost_ns
            self.untimed_n += 1

    # --- background wake: completing timings -----------------------------

    def account_poll(self, cost_ns: int) -> None:
        """The poller's host time for completing one timed step (ns)."""
        self.poll_ns += cost_ns
        self.poll_n += 1

    # --- background wake: the sampler update -----------------------------

    def hooks_ns(self) -> int:
        """The probe's cumulative time on the host's threads (ns): hook bodies and records made outside steps."""
        return self.untimed_ns + self.timed_ns + self.other_ns

    def update(self, background_ns: int | None = None) -> list[float]:
        """Fold the accumulators since the last call into the estimates and new rates.

        `background_ns`: the background thread's cumulative CPU time (ns), poll work included.
        """
        now = (tuple(self.period_ns), tuple(self.period_n), self.untimed_ns, self.untimed_n,
               self.timed_ns, self.timed_n, self.poll_ns, self.poll_n)
        last = self._last or (
            (0,) * N_PHASES, (0,) * N_PHASES, 0, 0, 0, 0, 0, 0)
        self._last = now
        a = self.smoothing

        def mix(old: float | None, new: float) -> float:
            return new if old is None else (1 - a) * old + a * new

        for p in range(N_PHASES):
            dn = now[1][p] - last[1][p]
            if dn > 0:
                self.est_period_us[p] = mix(self.est_period_us[p], (now[0][p] - last[0][p]) / dn / 1e3)
                self.period_cap_ns[p] = int(min(MAX_PERIOD_NS, IDLE_FACTOR * self.est_period_us[p] * 1e3))
        d_un = now[3] - last[3]
        if d_un > 0:
            self.est_untimed_us = mix(self.est_untimed_us, (now[2] - last[2]) / d_un / 1e3)
        d_tn, d_pn = now[5] - last[5], now[7] - last[7]
        if d_tn > 0:
            hook_us = (now[4] - last[4]) / d_tn / 1e3
            poll_us = (now[6] - last[6]) / d_pn / 1e3 if d_pn > 0 else 0.0
            untimed = self.est_untimed_us if self.est_untimed_us is not None else 0.0
            self.est_extra_us = mix(self.est_extra_us, max(hook_us + poll_us - untimed, 0.1))
        if background_ns is not None:
            steps = self.untimed_n + self.timed_n
            b0, p0, o0, s0 = self._bg_last
            self._bg_last = (background_ns, self.poll_ns, self.other_ns, steps)
            if steps > s0:
                fixed = max(0, (background_ns - b0) - (self.poll_ns - p0) + (self.other_ns - o0)) / (steps - s0) / 1e3
                self.est_background_us = mix(self.est_background_us, fixed)
        per_step_us = self.est_untimed_us or 0.0  # the costlier kind of step: a timed one, once there are any
        if self.timed_total and self.est_extra_us is not None:
            per_step_us += self.est_extra_us
        if per_step_us > 0:
            self.cost_cap_ns = int(max(COST_CAP_FLOOR_NS, COST_CAP_FACTOR * per_step_us * 1e3))
        if self.budget is None:
            return self.rates
        untimed = (self.est_untimed_us or 0.0) + (self.est_background_us or 0.0)
        for p in range(N_PHASES):
            period = self.est_period_us[p]
            if period is None:
                continue
            rate = (self.budget * period - untimed) / (self.est_extra_us or INITIAL_EXTRA_US)
            self.rates[p] = min(1.0, max(self.min_rate, rate))
        return self.rates

    def overall_rate(self) -> float:
        """Timed steps / steps so far (1.0 before the first step)."""
        return self.timed_total / self.steps_total if self.steps_total else 1.0
