"""An OTLP histogram fed in bulk from numpy columns, merged into what the SDK's metric reader exports.

Why not the SDK's `Histogram.record`: it takes one value (an attributes dict, a lock, a bisect and an
exemplar check each, several us), so at the million steps per second the sidecar ingests the OTLP sink
lagged and the sidecar dropped what it could not take (`phasescope_sidecar_sink_dropped_records_total`;
measured with `benchmarks/ingest.py --otlp`: a quarter to a third of 2M steps reached the exported histogram).

The OpenTelemetry Python SDK (1.45) has no bulk record and no `MetricProducer` / `metric_producers` on its
readers (the specification's way to merge pre-aggregated data into an export; open-telemetry/opentelemetry-python
issue 4768 asks for it). So `HistogramStream` aggregates itself, per attribute set: one `np.searchsorted` +
`np.bincount` against the View's explicit bounds per column, and `ProducingMetricReader`, a
`PeriodicExportingMetricReader`, adds the streams' `Metric`s (the SDK's public point types,
`opentelemetry.sdk.metrics.export`) to the SDK's own collection in `_receive_metrics`, the hook every reader
implements, before its exporter sees it. The result is what the SDK's `ExplicitBucketHistogramAggregation`
would export: same name, unit, description, bounds, attributes, temporality (cumulative: start at the
attribute set's first value; delta: since the previous collection, only attribute sets with new values),
count, sum, bucket counts, min and max; non-finite values are ignored and a 2001st attribute set goes to
`otel.metric.overflow=true`, as in the SDK; no exemplars (the sink thread has no sampled span, so the SDK's
trace-based exemplar filter would take none either). When the SDK has a `MetricProducer`, `collect` below
becomes one.
"""

from __future__ import annotations

import math
import threading
from time import time_ns
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from opentelemetry.sdk.metrics.export import (AggregationTemporality, Histogram, HistogramDataPoint, Metric,
                                              MetricExporter, MetricsData, PeriodicExportingMetricReader,
                                              ResourceMetrics, ScopeMetrics)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

CARDINALITY_LIMIT = 2000  # the SDK's default attribute sets per metric stream; more go to the overflow set
OVERFLOW_ATTRIBUTES = {"otel.metric.overflow": True}


class _Series:
    __slots__ = ("attributes", "start_ns", "counts", "sum", "min", "max", "fresh")

    def __init__(self, attributes: dict[str, Any], nbuckets: int, start_ns: int) -> None:
        self.attributes = attributes
        self.start_ns = start_ns  # cumulative: first value; delta: the previous collection
        self.counts = np.zeros(nbuckets, np.int64)
        self.sum = 0.0
        self.min, self.max = math.inf, -math.inf
        self.fresh = False  # values since the last collection


class HistogramStream:
    """Explicit-bucket histogram `name` [`unit`] with upper `boundaries` (the +Inf bucket is implied, as in
    OTLP), one series per attribute set, observed a column at a time; `collect` gives the SDK `Metric`."""

    def __init__(self, name: str, unit: str, description: str, boundaries: Sequence[float],
                 temporality: AggregationTemporality = AggregationTemporality.CUMULATIVE,
                 cardinality_limit: int = CARDINALITY_LIMIT, clock: Callable[[], int] = time_ns) -> None:
        bounds = tuple(float(b) for b in boundaries)
        if list(bounds) != sorted(bounds) or cardinality_limit < 1:
            raise ValueError("boundaries must be sorted and cardinality_limit >= 1")
        self.name, self.unit, self.description = name, unit, description
        self.boundaries = bounds
        self._bounds = np.array(bounds, np.float64)
        self.temporality = temporality
        self.cardinality_limit = cardinality_limit
        self._clock = clock
        self._series: dict[tuple, _Series] = {}
        self._lock = threading.Lock()

    def record_many(self, attributes: Mapping[str, Any], values: np.ndarray) -> None:
        """Record every finite value of `values` (float64, in `unit`) under `attributes`."""
        values = np.asarray(values, np.float64)
        if not len(values):
            return
        finite = np.isfinite(values)
        if not finite.all():
            values = values[finite]  # the SDK ignores non-finite values (with a warning)
            if not len(values):
                return
        # v lands in the first bucket whose upper bound b has v <= b (the SDK's bisect_left); past the last: +Inf
        counts = np.bincount(np.searchsorted(self._bounds, values, side="left"), minlength=len(self._bounds) + 1)
        total, lo, hi = float(values.sum()), float(values.min()), float(values.max())
        key = tuple(sorted(attributes.items()))
        with self._lock:
            s = self._series.get(key)
            if s is None:
                s = self._new(key, attributes)
            s.counts += counts
            s.sum += total
            s.min = min(s.min, lo)
            s.max = max(s.max, hi)
            s.fresh = True

    def _new(self, key: tuple, attributes: Mapping[str, Any]) -> _Series:
        if len(self._series) >= self.cardinality_limit:
            key, attributes = tuple(OVERFLOW_ATTRIBUTES.items()), OVERFLOW_ATTRIBUTES
            s = self._series.get(key)
            if s is not None:
                return s
        s = self._series[key] = _Series(dict(attributes), len(self._bounds) + 1, self._clock())
        return s

    def collect(self, collection_ns: int) -> Metric | None:
        """The metric as of `collection_ns` (ns since the epoch); None when it has no data point."""
        delta = self.temporality is AggregationTemporality.DELTA
        points = []
        with self._lock:
            for s in self._series.values():
                if delta and not s.fresh:
                    continue
                points.append(HistogramDataPoint(
                    attributes=dict(s.attributes), start_time_unix_nano=s.start_ns, time_unix_nano=collection_ns,
                    count=int(s.counts.sum()), sum=s.sum, bucket_counts=tuple(s.counts.tolist()),
                    explicit_bounds=self.boundaries, min=s.min, max=s.max, exemplars=[]))
                s.fresh = False
                if delta:
                    s.counts[:] = 0
                    s.sum, s.min, s.max = 0.0, math.inf, -math.inf
                    s.start_ns = collection_ns
        if not points:
            return None
        return Metric(name=self.name, description=self.description, unit=self.unit,
                      data=Histogram(data_points=points, aggregation_temporality=self.temporality))


class ProducingMetricReader(PeriodicExportingMetricReader):
    """A `PeriodicExportingMetricReader` that adds the `streams`' metrics (scope `scope`) to each collection
    of the SDK's instruments before exporting it, or exports them alone when the SDK has nothing."""

    def __init__(self, exporter: MetricExporter, streams: Sequence[HistogramStream], scope: InstrumentationScope,
                 resource: Resource, **kwargs: Any) -> None:
        self._streams = list(streams)
        self._scope = scope
        self._resource = resource
        self._collect_lock = threading.Lock()  # one collection at a time (ticker, force_flush, shutdown)
        self._merged = False
        super().__init__(exporter, **kwargs)

    def _produce(self) -> list[Metric]:
        now = time_ns()
        return [m for m in (s.collect(now) for s in self._streams) if m is not None]

    def collect(self, timeout_millis: float = 10_000) -> None:
        with self._collect_lock:
            self._merged = False
            super().collect(timeout_millis=timeout_millis)
            if self._merged:
                return
            # the SDK collected nothing (it then skips _receive_metrics): export the streams alone
            extra = self._produce()
            if extra:
                super()._receive_metrics(self._wrap([], extra), timeout_millis=timeout_millis)

    def _receive_metrics(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> None:
        self._merged = True
        extra = self._produce()
        if extra:
            metrics_data = self._wrap(metrics_data.resource_metrics, extra)
        super()._receive_metrics(metrics_data, timeout_millis=timeout_millis, **kwargs)

    def _wrap(self, resource_metrics: Sequence[ResourceMetrics], extra: list[Metric]) -> MetricsData:
        """`resource_metrics` with `extra` added to the ScopeMetrics of `scope` (made when missing)."""
        out = list(resource_metrics)
        for i, rm in enumerate(out):
            if rm.resource == self._resource or len(out) == 1:
                scopes = list(rm.scope_metrics)
                for j, sm in enumerate(scopes):
                    if sm.scope == self._scope:
                        scopes[j] = ScopeMetrics(scope=sm.scope, metrics=[*sm.metrics, *extra],
                                                 schema_url=sm.schema_url)
                        break
                else:
                    scopes.append(ScopeMetrics(scope=self._scope, metrics=extra,
                                               schema_url=self._scope.schema_url))
                out[i] = ResourceMetrics(resource=rm.resource, scope_metrics=scopes, schema_url=rm.schema_url)
                return MetricsData(resource_metrics=out)
        out.append(ResourceMetrics(resource=self._resource, scope_metrics=[
            ScopeMetrics(scope=self._scope, metrics=extra, schema_url=self._scope.schema_url)],
            schema_url=self._resource.schema_url))
        return MetricsData(resource_metrics=out)
