"""The adapter's budget: its own time per engine step against a share of the step time, and the detail it lowers,
in a fixed order, when it is over.

Hot path (`Budget.step` and `Budget.end`, once per engine step): a counter, a modulo and a compare; on one step in
`Meter.every` also the sums below. The share is the hooks' time over the step's busy time (from schedule()'s return to the end
of update_from_output()), never the gap to the next step (idle waits, host pauses). The KV cross-check walk (kvaccount.walk) is paid from a credit: each step adds
`share x step time - the hooks' own time`, a walk costs what the last one took, and at most one walk runs every
`MIN_WALK_EVERY` steps, so the walks stay inside the budget whatever the batch.

Lowering order (LEVELS), one level per window over budget, never raised back during the run:
1. page lifecycles (sampled `PageEvent`s) off;
2. full KV walks off (shared pages and the largest free run are no longer refreshed);
3. per-lookup prefix detail off (`PrefixLookup` records and the table of earlier prompts behind the miss causes).
Every counter vLLM's /metrics has (requests, tokens, prefix queries and hits, preemptions, KV usage, latencies)
stays exact at every level. Each lowering is a `ServerMetric` `phasescope:vllm_detail_level` (its history) and the
run label `detail_lowered` (what is off, since when, why), which `diagnose` reports.
"""

from __future__ import annotations

import os
from typing import Callable

from .common import Meter, log

ENV_BUDGET = "PHASESCOPE_VLLM_BUDGET"  # the adapter's share of engine step time (default 0.005; 1 = never lower)
DEFAULT_SHARE = 0.005
LEVELS = ("full detail", "page lifecycles off", "KV walks off", "per-lookup prefix detail off")
DETAIL_METRIC = "phasescope:vllm_detail_level"
MIN_WALK_EVERY = 64  # steps between two KV cross-check walks at the least
WINDOW = 8  # measured steps per verdict (8 x Meter.every engine steps)
SKIP_WINDOWS = 2  # the first windows (start-up: lazy init, first compiles) give no verdict


def share_from_env(environ: dict | None = None) -> float:
    """PHASESCOPE_VLLM_BUDGET as a share in (0, 1]; a bad value: the default, said once in the log."""
    raw = (environ if environ is not None else os.environ).get(ENV_BUDGET, "").strip()
    if not raw:
        return DEFAULT_SHARE
    try:
        v = float(raw)
        if 0 < v <= 1:
            return v
    except ValueError:
        pass
    log.warning("phasescope: %s=%r is not a share in (0, 1]; the adapter's budget is %s", ENV_BUDGET, raw,
                DEFAULT_SHARE)
    return DEFAULT_SHARE


class Budget:
    """The adapter's cost against `share` of the step time (engine process); `on_lower(level, why)` applies a
    lowering. Parts named in `excluded` (the walk) are not counted in the per-step base cost."""

    def __init__(self, meter: Meter, on_lower: Callable[[int, str], None], share: float = DEFAULT_SHARE,
                 excluded: tuple[str, ...] = ("kv_walk",)) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"budget share must be in (0, 1], got {share}")
        self.meter = meter
        self.on_lower = on_lower
        self.share = share
        self.excluded = excluded
        self.level = 0
        self.steps = 0
        self.measured = 0  # measured steps so far
        self.hook_ns = 0  # the hooks' time over the measured steps (walks excluded)
        self.step_ns = 0  # the measured steps' wall time
        self.base_ns_per_step = 0.0  # the latest window's means
        self.step_ns_mean = 0.0
        self.credit_ns = 0.0  # the walk credit at step `_credit_step` (grows by `_gain_ns` a step, to a cap)
        self._credit_step = 0
        self._gain_ns = 0.0
        self.walk_ns_last = 0
        self.last_walk_step = -MIN_WALK_EVERY
        self._next_measured = meter.every  # the next step measured (one in meter.every)
        self._t0 = 0
        self._busy_ns = 0
        self._hooks0 = 0
        self._win = [0, 0, 0]  # measured steps, hook ns, step ns of the open window
        self._windows = 0

    def _hooks_total(self) -> int:
        ns = self.meter.ns
        return sum(v for k, v in ns.items() if k not in self.excluded)

    def step(self, now_ns: int) -> None:
        """One engine step starts at `now_ns` (monotonic): close the measured one, maybe open the next. An
        unmeasured step costs a counter and a compare."""
        self.steps += 1
        if self.steps >= self._next_measured or self.meter.on:
            self._measure(now_ns)

    def _measure(self, now_ns: int) -> None:
        m = self.meter
        if m.on:
            m.on = False
            hook = self._hooks_total() - self._hooks0
            # the step's busy time (schedule() to the end of update_from_output()) where `end` saw it: the time up
            # to this schedule() would also hold the engine's idle waits and any pause of the host between steps
            busy = self._busy_ns if self._busy_ns > 0 else now_ns - self._t0
            self.measured += 1
            self.hook_ns += hook
            self.step_ns += busy
            w = self._win
            w[0] += 1
            w[1] += hook
            w[2] += busy
            if w[0] >= WINDOW:
                self._verdict()
        if self.steps >= self._next_measured:
            self._next_measured = self.steps + m.every
            self._t0 = now_ns
            self._busy_ns = 0
            self._hooks0 = self._hooks_total()
            m.on = True

    def end(self, now_ns: int) -> None:
        """The engine step that started at the last `step` has its output (monotonic ns): its busy time, if measured.
        The hooks that run before the next step (arrivals, aborts) are still metered: they are the adapter's."""
        if self.meter.on and not self._busy_ns:
            self._busy_ns = now_ns - self._t0

    def _verdict(self) -> None:
        n, hook, step = self._win
        self._win = [0, 0, 0]
        self._windows += 1
        self.credit_ns = self._credit()  # the credit so far at the old gain, then the new one
        self._credit_step = self.steps
        self.base_ns_per_step = hook / n
        self.step_ns_mean = step / n
        self._gain_ns = self.share * self.step_ns_mean - self.base_ns_per_step
        if self._windows <= SKIP_WINDOWS or self.level >= len(LEVELS) - 1 or step <= 0:
            return
        used = hook / step
        if used > self.share:
            self.level += 1
            self.credit_ns = 0.0
            self._credit_step = self.steps
            self.on_lower(self.level, f"adapter {used:.2%} of step time > budget {self.share:.2%}")

    def _credit(self) -> float:
        """The walk credit now: each step since `_credit_step` added `share x step time - the hooks' own time`,
        capped at 4 walks' cost (computed when asked, not on every step)."""
        return min(self.credit_ns + (self.steps - self._credit_step) * self._gain_ns,
                   4.0 * max(self.walk_ns_last, 1))

    def walk_due(self) -> bool:
        """Whether a KV cross-check walk fits now (at most one per MIN_WALK_EVERY steps, paid from the credit)."""
        if self.level >= 2 or self.steps - self.last_walk_step < MIN_WALK_EVERY:
            return False
        return self.share >= 1.0 or self._credit() >= self.walk_ns_last

    def walked(self, ns: int) -> None:
        """A walk took `ns`."""
        self.credit_ns = self._credit() - ns
        self._credit_step = self.steps
        self.walk_ns_last = ns
        self.last_walk_step = self.steps

    def cost_us(self) -> dict[str, float]:
        """The hooks' time per engine step by part (means over measured steps, us)."""
        n = max(self.measured, 1)
        return {k: round(v / n / 1e3, 2) for k, v in sorted(self.meter.ns.items())}
