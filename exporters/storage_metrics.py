"""Prometheus metrics of the store's retention: how big the store is and what the rolls did."""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from .families import SourceCollector


class RetentionCollector(SourceCollector):
    """Counters and gauges of an `agent.sidecar.retention.Retention`."""

    source = "retention"

    def more(self, r: Any) -> Iterator[Metric]:
        used = GaugeMetricFamily("phasescope_store_used_bytes", "Bytes the store held after the last roll "
                                 "(used DuckDB blocks plus the WAL).")
        used.add_metric([], r.last.used_bytes_after if r.last is not None else 0)
        yield used
        cap = GaugeMetricFamily("phasescope_store_max_bytes", "The retention size cap.")
        cap.add_metric([], r.policy.max_bytes)
        yield cap
