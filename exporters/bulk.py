"""A Prometheus histogram fed in bulk from numpy columns (the sidecar hands committed batches as arrays).

Why not prometheus_client's `Histogram`: it has no bulk observe. n values cost n `observe` calls (a lock,
a scan of the bounds and two value updates each, ~1 us), so at the million steps per second the sidecar
ingests, the step histograms alone were more than the sinks' thread could do and the sidecar dropped what
they could not take (`phasescope_sidecar_sink_dropped_records_total`). `BulkHistogram` keeps the bucket
counts of each label set itself (numpy int64) and adds a column of values with one `np.searchsorted` and
one `np.bincount`; a Collector yields them at scrape time as a `HistogramMetricFamily`: the same name,
help, labels, bucket bounds and samples (`_bucket{le}` cumulative, `_count`, `_sum`; no `_created`, as
the exporter switches those off) as the `Histogram` it replaces.
"""

from __future__ import annotations

import math
import threading
from typing import Iterator, Sequence

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class BulkHistogram(Collector):
    """Histogram `name` with `labelnames` and upper `buckets` (+Inf added), observed a column at a time.

    A value v lands in the first bucket whose bound b has v <= b, as prometheus_client's `observe` does
    (NaN lands in none but is added to the sum, as there: callers filter NaN out)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry | None = None) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds) or not bounds:
            raise ValueError("buckets must be sorted and not empty")
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self.bounds = np.array(bounds)
        self._le = [floatToGoString(b) for b in bounds]
        self._series: dict[tuple[str, ...], list] = {}  # label values -> [counts per bucket (int64), sum]
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(self)

    def _get(self, labels: tuple[str, ...]) -> list:
        s = self._series.get(labels)
        if s is None:
            if len(labels) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected {len(self.labelnames)} label values, got {labels!r}")
            s = self._series[labels] = [np.zeros(len(self.bounds), np.int64), 0.0]
        return s

    def observe_many(self, labels: tuple[str, ...], values: np.ndarray, times: np.ndarray | None = None) -> None:
        """Observe every value of `values` (float64, s) under `labels`; value i `times[i]` times when given."""
        if not len(values):
            return
        idx = np.searchsorted(self.bounds, values, side="left")
        if times is None:
            counts = np.bincount(idx, minlength=len(self.bounds))
            total = float(values.sum())
        else:
            counts = np.bincount(idx, weights=times, minlength=len(self.bounds)).astype(np.int64)
            total = float((values * times).sum())
        with self._lock:
            s = self._get(labels)
            s[0] += counts[: len(self.bounds)]  # NaN sorts past +Inf: in no bucket, as with observe()
            s[1] += total

    def observe(self, labels: tuple[str, ...], value: float, count: int = 1) -> None:
        """Observe `value` `count` times under `labels`."""
        i = int(np.searchsorted(self.bounds, value, side="left"))
        with self._lock:
            s = self._get(labels)
            if i < len(self.bounds):
                s[0][i] += count
            s[1] += value * count if count != 1 else value

    def remove_where(self, label: str, value: str) -> None:
        """Drop every series whose `label` is `value` (a label value folded into `other`)."""
        if label not in self.labelnames:
            return
        i = self.labelnames.index(label)
        with self._lock:
            for k in [k for k in self._series if k[i] == value]:
                del self._series[k]

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            rows = [(k, np.cumsum(c), total) for k, (c, total) in self._series.items()]
        for k, cum, total in rows:
            fam.add_metric(list(k), list(zip(self._le, cum.astype(float).tolist())), total)
        yield fam
