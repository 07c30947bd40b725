"""The Prometheus families read straight off a record or a stats object: each declared once, here.

A row of `FAMILIES` is one family: the object it is read off, its kind, its name (a counter's `_total` is
added by prometheus_client), the attribute holding its value and its help. An attribute whose name carries
a unit other than Prometheus's base unit (`util_pct`, `sm_clock_mhz`) is converted (`TO_BASE_UNIT`).
`families(source, rows, labels)` makes the families of one source at scrape time. Families whose
samples are computed (KV ratios, counts by reason) are written where they are computed (prometheus.py).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class Family(NamedTuple):
    source: str  # the object it is read off, as `families(source, ...)` names it
    kind: str  # "counter" or "gauge"
    name: str
    field: str  # the source object's attribute holding the value
    help: str


def percent_to_ratio(v: float) -> float:
    return v / 100.0


def mhz_to_hz(v: float) -> float:
    return v * 1e6


# an attribute's unit (the suffix of its name) -> the conversion to the base unit its family's name states
TO_BASE_UNIT: dict[str, Callable[[float], float]] = {"_pct": percent_to_ratio, "_mhz": mhz_to_hz}

C, G = "counter", "gauge"

# every family read off an object: (source, kind, name, attribute, help); a source's in the
# order they are exposed
FAMILIES: tuple[Family, ...] = (
    # PrefixCounters, per (model, rank)
    Family("prefix", C, "phasescope_prefix_queried_tokens", "queried_tokens_total",
           "Prompt tokens looked up in the prefix cache."),
    Family("prefix", C, "phasescope_prefix_hit_tokens", "hit_tokens_total",
           "Prompt tokens served from the prefix cache."),
    Family("prefix", C, "phasescope_prefix_recomputed_tokens", "recomputed_tokens_total",
           "Tokens recomputed after preemption (never counted as hits)."),
    Family("prefix", C, "phasescope_prefix_evicted_blocks", "evicted_blocks_total",
           "Prefix-cache blocks evicted."),
    # ProbeHealth, per (model, rank)
    Family("probe", C, "phasescope_probe_records", "records_total",
           "Records the probe produced."),
    Family("probe", C, "phasescope_probe_dropped_records", "dropped_total",
           "Records the probe dropped (ring full)."),
    Family("probe", C, "phasescope_probe_errors", "errors_total",
           "Errors caught in probe hooks."),
    Family("probe", C, "phasescope_probe_frames_sent", "frames_sent_total",
           "Frames sent to the sidecar."),
    Family("probe", C, "phasescope_probe_send_failures", "send_failures_total",
           "Frames that could not be sent."),
    Family("probe", C, "phasescope_probe_gpu_unsampled_steps", "gpu_unsampled_total",
           "Steps without a GPU time."),
    Family("probe", C, "phasescope_probe_gpu_timed_steps", "gpu_timed_total",
           "Steps timed with CUDA events (sampled under the probe's host-cost budget)."),
    Family("probe", G, "phasescope_probe_gpu_sample_ratio", "gpu_sample_rate",
           "Fraction of steps timed with CUDA events (1 on CPU: host time only)."),
    Family("probe", C, "phasescope_probe_captured_forwards", "captured_total",
           "Forwards inside a CUDA-graph capture (not recorded as steps)."),
    Family("probe", C, "phasescope_probe_cpu_seconds", "probe_cpu_s_total",
           "CPU time of everything the probe does: hooks and its background thread."),
    Family("probe", C, "phasescope_probe_gil_wait_estimated_seconds", "gil_wait_est_s_total",
           "Estimated host wait for the GIL held by the probe's background thread."),
    Family("probe", G, "phasescope_probe_cost_ratio", "cost_share",
           "Probe CPU time / wall time over the probe's last interval (budgeted by gpu_budget)."),
    # GpuSample, per gpu
    Family("gpu", G, "phasescope_gpu_utilization_ratio", "util_pct",
           "GPU busy fraction (NVML utilization / 100)."),
    Family("gpu", G, "phasescope_gpu_memory_used_bytes", "mem_used_bytes",
           "GPU memory used."),
    Family("gpu", G, "phasescope_gpu_memory_total_bytes", "mem_total_bytes",
           "GPU memory total."),
    Family("gpu", G, "phasescope_gpu_power_watts", "power_w",
           "GPU power draw."),
    Family("gpu", G, "phasescope_gpu_temperature_celsius", "temp_c",
           "GPU temperature."),
    Family("gpu", G, "phasescope_gpu_sm_clock_hertz", "sm_clock_mhz",
           "GPU SM clock."),
    Family("gpu", C, "phasescope_gpu_xid_errors", "xid_errors_total",
           "XID / uncorrected ECC errors seen."),
    # SidecarStats: its totals, then (after the families labelled by reason) its gauges
    Family("sidecar", C, "phasescope_sidecar_connections", "connections_total",
           "Probe connections accepted."),
    Family("sidecar", C, "phasescope_sidecar_frames", "frames_total",
           "Frames received."),
    Family("sidecar", C, "phasescope_sidecar_records", "records_total",
           "Records received."),
    Family("sidecar", C, "phasescope_sidecar_bad_frames", "bad_frames_total",
           "Frames rejected (their connection closed)."),
    Family("sidecar", C, "phasescope_sidecar_dropped_records", "records_dropped_total",
           "Records the sidecar let go unstored (0: it applies backpressure)."),
    Family("sidecar", C, "phasescope_sidecar_rows_written", "rows_written_total",
           "Rows written to the store."),
    Family("sidecar", C, "phasescope_sidecar_sink_errors", "sink_errors_total",
           "Exporter (sink) failures."),
    Family("sidecar", C, "phasescope_sidecar_sink_dropped_records", "sink_dropped_records_total",
           "Records the exporters did not see because they lagged."),
    Family("sidecar", C, "phasescope_sidecar_collector_errors", "collector_errors_total",
           "Collector (NVML, ...) failures."),
    Family("sidecar", C, "phasescope_sidecar_connections_refused", "connections_refused_total",
           "Connections refused over the connection cap."),
    Family("sidecar", C, "phasescope_sidecar_auth_failures", "auth_failures_total",
           "Connections refused for a wrong or missing token."),
    Family("sidecar", C, "phasescope_sidecar_timeouts", "timeouts_total",
           "Connections closed because a read deadline passed."),
    Family("sidecar", C, "phasescope_sidecar_write_retries", "write_retries_total",
           "Batches that failed on their data and were retried in halves."),
    Family("sidecar", C, "phasescope_sidecar_store_errors", "store_errors_total",
           "Writes or checkpoints that failed on the file (disk full, I/O)."),
    Family("sidecar", C, "phasescope_sidecar_store_reopens", "store_reopens_total",
           "Times the store connection was reopened after a failure."),
    Family("sidecar", C, "phasescope_sidecar_fold_events", "fold_events_total",
           "Request events folded into the derived tables by the live fold."),
    Family("sidecar", C, "phasescope_sidecar_fold_failures", "fold_failures_total",
           "Live fold rounds that failed (each also stored as a sidecar_health row)."),
    Family("sidecar_gauges", G, "phasescope_sidecar_fold_lag_seconds", "fold_lag_s",
           "Bound on the age of the oldest request event not yet in the derived tables, after the last fold round."),
    Family("sidecar_gauges", G, "phasescope_sidecar_fold_behind_rows", "fold_behind_rows",
           "Request events not yet in the derived tables after the last fold round."),
    Family("sidecar_gauges", G, "phasescope_sidecar_store_up", "store_ok",
           "1 when the last write succeeded, 0 while the store fails (disk full)."),
    Family("sidecar_gauges", G, "phasescope_sidecar_unwritten_bytes", "unwritten_bytes",
           "Bytes received and not yet written (the memory budget in use)."),
    Family("sidecar_gauges", G, "phasescope_sidecar_memory_budget_bytes", "memory_budget_bytes",
           "Bytes of received-but-unwritten frames held at most."),
    Family("sidecar_gauges", G, "phasescope_sidecar_open_connections", "open_connections",
           "Probe connections open now."),
    # agent.sidecar.retention.Retention
    Family("retention", C, "phasescope_retention_rolls", "rolls_total",
           "Retention rolls run."),
    Family("retention", C, "phasescope_retention_rolled_rows", "rows_rolled_total",
           "Rows rolled up, exported and deleted from the store."),
    Family("retention", C, "phasescope_retention_errors", "errors_total",
           "Retention rolls that failed (their rows stayed)."),
)


def families(source: str, rows: Iterable[tuple[Sequence[str], Any]], labels: Sequence[str] = ()) -> list[Metric]:
    """The families of `source` (FAMILIES rows), one sample each per (label values, object) of `rows`."""
    table = [f for f in FAMILIES if f.source == source]
    if not table:
        raise KeyError(f"no metric families of source {source!r}")
    made = [(CounterMetricFamily if f.kind == C else GaugeMetricFamily)(f.name, f.help, labels=list(labels))
            for f in table]
    convert = [next((c for unit, c in TO_BASE_UNIT.items() if f.field.endswith(unit)), None) for f in table]
    for values, obj in rows:
        for fam, f, conv in zip(made, table, convert):
            value = getattr(obj, f.field)
            fam.add_metric(list(values), conv(value) if conv is not None else value)
    return made


class SourceCollector(Collector):
    """Collects the families of one object (`source`'s rows of FAMILIES), then what `more(obj)` yields."""

    source = ""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def more(self, obj: Any) -> Iterator[Metric]:
        """The object's families that are computed rather than read off it."""
        return iter(())

    def collect(self) -> Iterator[Metric]:
        yield from families(self.source, [([], self.obj)])
        yield from self.more(self.obj)
