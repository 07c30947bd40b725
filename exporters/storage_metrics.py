"""Prometheus metrics of the store's retention: how big the store is and what the rolls did."""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class RetentionCollector(Collector):
    """Counters and gauges of an `agent.sidecar.retention.Retention`."""

    def __init__(self, retention: Any) -> None:
        self.retention = retention

    def collect(self) -> Iterator[Metric]:
        r = self.retention
        for name, doc, value in (
            ("phasescope_retention_rolls", "Retention rolls run.", r.rolls_total),
            ("phasescope_retention_rolled_rows", "Rows rolled up, exported and deleted from the store.",
             r.rows_rolled_total),
            ("phasescope_retention_errors", "Retention rolls that failed (their rows stayed).", r.errors_total),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
        used = GaugeMetricFamily("phasescope_store_used_bytes", "Bytes the store held after the last roll "
                                 "(used DuckDB blocks plus the WAL).")
        used.add_metric([], r.last.used_bytes_after if r.last is not None else 0)
        yield used
        cap = GaugeMetricFamily("phasescope_store_max_bytes", "The retention size cap.")
        cap.add_metric([], r.policy.max_bytes)
        yield cap
