"""The Prometheus exporter's engine-step series: host and GPU time of each forward by phase, the tokens
forwards compute by kind, and, for tensor-parallel runs, the step skew across ranks and which rank was
slowest (the same step id matched across the ranks of one run, in a bounded table of groups).

Steps come one at a time (`observe`) or as a numpy column of Step's fields (`observe_column`: one
histogram update per (rank, phase) present), with the same effect.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram

from phasescope.agent.records.events import PHASES, Step

from . import buckets
from .bulk import BulkHistogram
from .sources import LabelCap, Source


class StepMetrics:
    """Step series in `registry`; rank labels through `rank_cap`; at most `max_pending` TP step groups
    waiting for their other ranks (the oldest dropped, counted in `groups_evicted_total`)."""

    def __init__(self, registry: CollectorRegistry, rank_cap: LabelCap, max_pending: int) -> None:
        r = registry
        self.rank_cap = rank_cap
        self.max_pending = max_pending
        # observed a column at a time (BulkHistogram: prometheus_client's Histogram has no bulk observe)
        self.host = BulkHistogram("phasescope_step_host_seconds", "Host wall time of one forward, by phase, s.",
                                  ["model", "rank", "phase"], buckets=buckets.STEP_S, registry=r)
        self.gpu = BulkHistogram("phasescope_step_gpu_seconds",
                                 "GPU time of one forward (CUDA events; sampled steps only), by phase, s.",
                                 ["model", "rank", "phase"], buckets=buckets.STEP_S, registry=r)
        self.tokens = Counter("phasescope_step_tokens",
                              "Tokens computed by forwards, kind=prefill (prompt) or decode (generated).",
                              ["model", "rank", "kind"], registry=r)
        self.tp_skew = Histogram("phasescope_tp_step_skew_ratio",
                                 "Tensor-parallel step skew, max_r(step time) / median_r(step time) - 1.",
                                 ["model"], buckets=buckets.SKEW_RATIO, registry=r)
        self.tp_slowest = Counter("phasescope_tp_slowest_rank_steps",
                                  "Steps in which this rank was the slowest of its tensor-parallel group.",
                                  ["model", "rank"], registry=r)
        self.last_prefill: dict[str, int] = {}  # model -> prompt tokens of its latest lowest-rank step
        self._pending: OrderedDict[tuple[str, str, int], dict[int, tuple[float, float]]] = OrderedDict()
        self.groups_evicted_total = 0

    def observe(self, src: Source, s: Step) -> None:
        phase = PHASES[s.phase] if s.phase < len(PHASES) else "other"
        rank = self.rank_cap(str(s.rank))
        if s.rank == 0:  # the step a token event that follows was computed in (one rank is enough)
            self.last_prefill[src.model] = s.prefill_tokens
        self.host.observe((src.model, rank, phase), s.host_ms * 1e-3)
        if not math.isnan(s.gpu_ms):
            self.gpu.observe((src.model, rank, phase), s.gpu_ms * 1e-3)
        if s.prefill_tokens:
            self.tokens.labels(src.model, rank, "prefill").inc(s.prefill_tokens)
        if s.decode_tokens:
            self.tokens.labels(src.model, rank, "decode").inc(s.decode_tokens)
        if src.world_size > 1:
            self._tp_step(src, s.step_id, s.rank, s.gpu_ms, s.host_ms)

    def observe_column(self, src: Source, a: np.ndarray) -> None:
        """Take a column of steps in (a numpy structured array with Step's fields, in arrival order), with
        the same effect as `observe` on each row: one histogram update per (rank, phase) present.
        Rank labels: each distinct rank counts its rows in the LabelCap at once (in order of first
        appearance), then every row takes the label its rank has after the chunk."""
        n = len(a)
        if not n:
            return
        model = src.model
        ranks = a["rank"]
        zero = np.flatnonzero(ranks == 0)
        if len(zero):  # the latest rank-0 step (a token event that follows was computed in it)
            self.last_prefill[model] = int(a["prefill_tokens"][zero[-1]])
        key = ranks.astype(np.int64) * 256 + a["phase"]
        if (key == key[0]).all():
            groups = [(int(key[0]), None)]
            counts = {int(ranks[0]): n}
        else:
            uniq, first, inv = np.unique(key, return_index=True, return_inverse=True)
            order = np.argsort(inv, kind="stable")
            bounds = np.cumsum(np.bincount(inv, minlength=len(uniq)))[:-1]
            groups = [(int(k), idx) for k, idx in zip(uniq, np.split(order, bounds))]
            groups.sort(key=lambda g: int(g[1][0]))  # in order of first appearance
            counts = {}
            for k, idx in groups:
                counts[k >> 8] = counts.get(k >> 8, 0) + len(idx)
        for r, c in counts.items():
            self.rank_cap(str(r), c)
        labels = {r: self.rank_cap.peek(str(r)) for r in counts}  # an evicted rank is `other` now
        host_all, gpu_all = a["host_ms"], a["gpu_ms"]
        pre_all, dec_all = a["prefill_tokens"], a["decode_tokens"]
        for k, idx in groups:
            p = k & 0xFF
            rank = labels[k >> 8]
            phase = PHASES[p] if p < len(PHASES) else "other"
            sel = (lambda col: col) if idx is None else (lambda col, idx=idx: col[idx])
            self.host.observe_many((model, rank, phase), sel(host_all).astype(np.float64) * 1e-3)
            gpu = sel(gpu_all).astype(np.float64)
            gpu = gpu[~np.isnan(gpu)]
            if len(gpu):
                self.gpu.observe_many((model, rank, phase), gpu * 1e-3)
            pre = int(sel(pre_all).sum(dtype=np.int64))
            if pre:
                self.tokens.labels(model, rank, "prefill").inc(pre)
            dec = int(sel(dec_all).sum(dtype=np.int64))
            if dec:
                self.tokens.labels(model, rank, "decode").inc(dec)
        if src.world_size > 1:
            for step_id, r, g, h in zip(a["step_id"].tolist(), ranks.tolist(), gpu_all.tolist(), host_all.tolist()):
                self._tp_step(src, step_id, r, g, h)

    def _tp_step(self, src: Source, step_id: int, rank: int, gpu_ms: float, host_ms: float) -> None:
        """Match the same step id across the ranks of one run; score skew and the slowest rank."""
        key = (src.run_id, src.model, step_id)
        group = self._pending.get(key)
        if group is None:
            group = self._pending[key] = {}
            while len(self._pending) > self.max_pending:
                self._pending.popitem(last=False)
                self.groups_evicted_total += 1
        group[rank] = (gpu_ms, host_ms)
        if len(group) < src.world_size:
            return
        del self._pending[key]
        use_gpu = all(not math.isnan(g) for g, _ in group.values())
        times = {r: (g if use_gpu else h) for r, (g, h) in group.items()}
        median = statistics.median(times.values())
        if median <= 0:
            return
        slowest = max(times, key=times.__getitem__)
        skew = times[slowest] / median - 1.0
        self.tp_skew.labels(src.model).observe(skew)
        if skew > 0:  # all equal: nobody is slowest
            self.tp_slowest.labels(src.model, self.rank_cap(str(slowest))).inc()
