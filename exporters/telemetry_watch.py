"""`phasescope_telemetry_degraded{model, reason}`: live flags for telemetry that stopped being true.

A sidecar sink beside the Prometheus exporter. It keeps, per model, when (sidecar monotonic
clock, s) it last received steps, KV snapshots, a moving prefix counter, a request's first admission
(its first `scheduled` event: a re-admission after a preemption is no prefix lookup), a GPU-timed step, a
probe's drop, and whether an adapter said it understands the runtime only in part or a probe's
clock was skewed at connect. At scrape time each reason is 1 while it holds, else 0, so an
alert can fire on `== 1` (reasons and thresholds as in analyzers/telemetry.py, the offline
twin; `telemetry_stale_s` and `max_clock_skew_s` come from the shared thresholds table).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from phasescope.agent.records.events import (REQUEST_EVENTS, Hello, KVSnapshot, PrefixCounters, ProbeHealth,
                                             RequestEvent, RunLabel, Step)
from phasescope.agent.read.thresholds import T
from phasescope.agent.sidecar import Batch, Chunk

from .sources import SourceTable

_SCHEDULED, _PREEMPTED, _TOKEN = (REQUEST_EVENTS.index(e) for e in ("scheduled", "preempted", "token"))
_ENDS = tuple(REQUEST_EVENTS.index(e) for e in ("finished", "aborted", "cancelled"))
_MAX_PREEMPTED = 1 << 16  # ids awaiting re-admission kept per model; past it the set restarts, and the
# re-admission of an id dropped then reads as an admission (only with > 65,536 preempted requests waiting at once)

REASONS = ("kv-snapshots-stopped", "prefix-counters-stuck", "gpu-timing-stopped", "records-dropped",
           "clock-skew", "adapter-partial")


class _ModelState:
    __slots__ = ("last_step", "last_admit", "preempted", "last_kv", "last_prefix_move", "prefix_q", "last_gpu",
                 "dropped", "last_drop", "skew_s", "adapter_missing")

    def __init__(self) -> None:
        self.last_step = self.last_admit = self.last_kv = self.last_prefix_move = self.last_gpu = None
        self.last_drop = None
        self.prefix_q = -1
        self.dropped: dict[int, int] = {}  # source -> latest dropped_total
        self.skew_s = 0.0
        self.adapter_missing = ""
        self.preempted: set = set()  # request ids (as sent) preempted and not yet scheduled again

    def request_event(self, event: int, rid: object, now: float) -> None:
        """One non-token request event: a first admission moves `last_admit`."""
        if event == _SCHEDULED:
            if rid in self.preempted:
                self.preempted.discard(rid)
            else:
                self.last_admit = now
        elif event == _PREEMPTED:
            if len(self.preempted) >= _MAX_PREEMPTED:
                self.preempted.clear()
            self.preempted.add(rid)
        elif event in _ENDS:
            self.preempted.discard(rid)


class TelemetryWatch:
    """Sidecar sink: per-model telemetry freshness, exported as `phasescope_telemetry_degraded`."""

    record_types = frozenset({Hello, Step, KVSnapshot, PrefixCounters, ProbeHealth, RunLabel, RequestEvent})
    # steps and request events come as numpy columns (a Chunk per frame), not one tuple each
    columnar_types = frozenset({Step, RequestEvent})

    def __init__(self, registry: CollectorRegistry, stale_s: float = T["telemetry_stale_s"],
                 max_clock_skew_s: float = T["max_clock_skew_s"], clock: Callable[[], float] = time.monotonic,
                 wall_ns: Callable[[], int] = time.time_ns) -> None:
        self.stale_s, self.max_clock_skew_s = stale_s, max_clock_skew_s
        self._clock, self._wall_ns = clock, wall_ns
        self.sources = SourceTable()
        self.models: dict[str, _ModelState] = {}
        registry.register(_Collector(self))

    def _state(self, model: str) -> _ModelState:
        st = self.models.get(model)
        if st is None:
            st = self.models[model] = _ModelState()
        return st

    def on_records(self, batch: Batch) -> None:
        now = self._clock()
        for source_id, records in batch:
            src = self.sources.get(source_id)
            st = self._state(src.model)
            for rec in records:
                t = type(rec)
                if t is Chunk:
                    if rec.cls is Step and len(rec.rows):
                        st.last_step = now
                        if not np.isnan(rec.rows["gpu_ms"]).all():
                            st.last_gpu = now
                    elif rec.cls is RequestEvent:
                        ev = rec.rows["event"]
                        rids = rec.rows["request_id"]
                        for i in np.flatnonzero(ev != _TOKEN):  # tokens are most events and never matter here
                            st.request_event(int(ev[i]), bytes(rids[i]), now)
                elif t is Step:
                    st.last_step = now
                    if not math.isnan(rec.gpu_ms):
                        st.last_gpu = now
                elif t is RequestEvent:
                    st.request_event(rec.event, rec.request_id.encode(), now)
                elif t is KVSnapshot:
                    st.last_kv = now
                elif t is PrefixCounters:
                    if rec.queried_tokens_total > st.prefix_q:
                        st.prefix_q = rec.queried_tokens_total
                        st.last_prefix_move = now
                elif t is ProbeHealth:
                    if rec.dropped_total > st.dropped.get(source_id, 0):
                        st.last_drop = now
                    st.dropped[source_id] = rec.dropped_total
                elif t is RunLabel:
                    if rec.key == "adapter_missing":
                        st.adapter_missing = rec.value
                elif t is Hello:
                    src = self.sources.hello(source_id, rec)
                    st = self._state(src.model)
                    st.skew_s = (rec.ts_ns + rec.wall_minus_mono_ns - self._wall_ns()) / 1e9

    def close(self) -> None:
        """Nothing to release."""

    def degraded(self, model: str) -> dict[str, bool]:
        """Each reason's state for `model` now."""
        st, now, stale = self.models[model], self._clock(), self.stale_s

        def silent_while_steps(last: float | None, active: float | None) -> bool:
            # the thing had reported before, and steps kept flowing for `stale` s since it last did
            return last is not None and active is not None and active - last >= stale and now - active < stale

        return {
            "kv-snapshots-stopped": silent_while_steps(st.last_kv, st.last_step),
            "prefix-counters-stuck": silent_while_steps(st.last_prefix_move, st.last_admit),
            "gpu-timing-stopped": silent_while_steps(st.last_gpu, st.last_step),
            "records-dropped": st.last_drop is not None and now - st.last_drop < stale,
            "clock-skew": abs(st.skew_s) > self.max_clock_skew_s,
            "adapter-partial": bool(st.adapter_missing),
        }


class _Collector(Collector):
    def __init__(self, watch: TelemetryWatch) -> None:
        self.watch = watch

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("phasescope_telemetry_degraded",
                              "1 while this telemetry of the model has stopped being true (reason), else 0.",
                              labels=["model", "reason"])
        for model in list(self.watch.models):
            if not model:
                continue
            for reason, on in self.watch.degraded(model).items():
                g.add_metric([model, reason], 1.0 if on else 0.0)
        yield g
