"""Prometheus metrics of the server processes and the host (the sidecar's psutil collector).

A sidecar `RecordSink` that remembers the latest `ProcessSample` per pid and the
latest `HostSample`, and a `Collector` on the injected registry that turns them
into samples at scrape time. Process metrics mirror the conventional `process_*`
names of client libraries (`process_cpu_seconds_total`, `process_resident_memory_bytes`,
`process_open_fds`, ...) under the `phasescope_` prefix, labelled by `pid` and
`run_id` (the exporter's own `process_*` belong to the sidecar process itself):

    phasescope_process_cpu_seconds_total{pid,run_id,mode="user|system"}
    phasescope_process_resident_memory_bytes{pid,run_id}
    phasescope_process_open_fds{pid,run_id}
    phasescope_process_threads{pid,run_id}
    phasescope_process_context_switches_total{pid,run_id,kind="voluntary|involuntary"}
    phasescope_process_busiest_thread_cpu_ratio{pid,run_id}     (1 = one full core)
    phasescope_process_busiest_thread_cpu_wait_ratio{pid,run_id} (share of time runnable without a CPU)

    phasescope_host_cpus, phasescope_host_cpu_utilization_ratio, phasescope_host_load1,
    phasescope_host_memory_total_bytes, phasescope_host_memory_available_bytes,
    phasescope_host_swap_used_bytes, phasescope_host_swap_in_bytes_total, phasescope_host_swap_out_bytes_total,
    phasescope_host_cpu_pressure_ratio, phasescope_host_cgroup_cpu_quota_cores,
    phasescope_host_cgroup_cpu_periods_total, phasescope_host_cgroup_cpu_throttled_periods_total,
    phasescope_host_cgroup_cpu_throttled_seconds_total

Unreadable values (NaN, -1) are left out rather than exposed. A process not
heard of for `stale_after_s` is no longer exposed.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from phasescope.agent.records.events import HostSample, ProcessSample
from phasescope.agent.sidecar import Batch


class HostMetricsExporter(Collector):
    """Sidecar sink + registry collector for ProcessSample / HostSample."""

    record_types = frozenset({ProcessSample, HostSample})  # what the sidecar hands this sink

    def __init__(self, registry: CollectorRegistry, stale_after_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if registry is None:
            raise ValueError("pass a CollectorRegistry (the global one is never used implicitly)")
        if stale_after_s <= 0:
            raise ValueError("stale_after_s must be > 0")
        self.stale_after_s = stale_after_s
        self._clock = clock
        self.procs: dict[int, tuple[float, ProcessSample]] = {}
        self.host: tuple[float, HostSample] | None = None
        registry.register(self)

    # --- RecordSink ---------------------------------------------------------

    def on_records(self, batch: Batch) -> None:
        now = self._clock()
        for _, records in batch:
            for rec in records:
                t = type(rec)
                if t is ProcessSample:
                    self.procs[rec.pid] = (now, rec)
                elif t is HostSample:
                    self.host = (now, rec)

    def close(self) -> None:
        """Nothing to release."""

    # --- Collector ----------------------------------------------------------

    def describe(self) -> list:
        return []  # samples exist only once the collector has run

    def collect(self) -> Iterator[Metric]:
        horizon = self._clock() - self.stale_after_s
        procs = [rec for t, rec in list(self.procs.values()) if t >= horizon]
        yield from _process(procs)
        if self.host is not None and self.host[0] >= horizon:
            yield from _host(self.host[1])


def _process(rows: list[ProcessSample]) -> Iterator[Metric]:
    lab = ["pid", "run_id"]
    cpu = CounterMetricFamily("phasescope_process_cpu_seconds", "Server process CPU time by mode, s.",
                              labels=lab + ["mode"])
    rss = GaugeMetricFamily("phasescope_process_resident_memory_bytes", "Server process resident memory.",
                            labels=lab)
    fds = GaugeMetricFamily("phasescope_process_open_fds", "Server process open file descriptors.", labels=lab)
    thr = GaugeMetricFamily("phasescope_process_threads", "Server process threads.", labels=lab)
    ctx = CounterMetricFamily("phasescope_process_context_switches", "Server process context switches by kind.",
                              labels=lab + ["kind"])
    busy = GaugeMetricFamily("phasescope_process_busiest_thread_cpu_ratio",
                             "CPU of the server's busiest thread over the last sample period (1 = one full core).",
                             labels=lab)
    wait = GaugeMetricFamily("phasescope_process_busiest_thread_cpu_wait_ratio",
                             "Share of the last sample period the busiest thread was runnable but had no CPU.",
                             labels=lab)
    for s in rows:
        lv = [str(s.pid), s.run_id]
        cpu.add_metric(lv + ["user"], s.cpu_user_s_total)
        cpu.add_metric(lv + ["system"], s.cpu_system_s_total)
        rss.add_metric(lv, s.rss_bytes)
        if s.open_fds >= 0:
            fds.add_metric(lv, s.open_fds)
        thr.add_metric(lv, s.threads)
        ctx.add_metric(lv + ["voluntary"], s.ctx_voluntary_total)
        ctx.add_metric(lv + ["involuntary"], s.ctx_involuntary_total)
        if not math.isnan(s.busiest_thread_cores):
            busy.add_metric(lv, s.busiest_thread_cores)
        if not math.isnan(s.busiest_thread_wait_ratio):
            wait.add_metric(lv, s.busiest_thread_wait_ratio)
    yield from (cpu, rss, fds, thr, ctx, busy, wait)


def _host(h: HostSample) -> Iterator[Metric]:
    def gauge(name: str, doc: str, value: float) -> Iterator[Metric]:
        if value is not None and not (isinstance(value, float) and math.isnan(value)) and value != -1:
            yield GaugeMetricFamily(name, doc, value=value)

    def counter(name: str, doc: str, value: float) -> Iterator[Metric]:
        if value is not None and not (isinstance(value, float) and math.isnan(value)) and value >= 0:
            yield CounterMetricFamily(name, doc, value=value)

    yield from gauge("phasescope_host_cpus", "Logical CPUs of the host.", h.cpu_count)
    yield from gauge("phasescope_host_cpu_utilization_ratio", "All CPUs busy over the last sample period (0-1).",
                     h.cpu_util_pct / 100.0)
    yield from gauge("phasescope_host_load1", "1-minute load average.", h.load1)
    yield from gauge("phasescope_host_memory_total_bytes", "Host memory total.", h.mem_total_bytes)
    yield from gauge("phasescope_host_memory_available_bytes", "Memory available without swapping.",
                     h.mem_available_bytes)
    yield from gauge("phasescope_host_swap_used_bytes", "Swap in use.", h.swap_used_bytes)
    yield from counter("phasescope_host_swap_in_bytes", "Bytes swapped in since boot.", h.swap_in_bytes_total)
    yield from counter("phasescope_host_swap_out_bytes", "Bytes swapped out since boot.", h.swap_out_bytes_total)
    yield from gauge("phasescope_host_cpu_pressure_ratio",
                     "PSI cpu some avg10: share of time a runnable task waited for a CPU (0-1).",
                     h.cpu_pressure_some_pct / 100.0)
    yield from gauge("phasescope_host_cgroup_cpu_quota_cores", "Container CPU limit in cores (cgroup quota/period).",
                     h.cgroup_cpu_quota_cores)
    yield from counter("phasescope_host_cgroup_cpu_periods", "CFS enforcement periods elapsed.",
                       h.cgroup_periods_total)
    yield from counter("phasescope_host_cgroup_cpu_throttled_periods", "CFS periods in which the container was throttled.",
                       h.cgroup_throttled_periods_total)
    yield from counter("phasescope_host_cgroup_cpu_throttled_seconds", "Time the container was throttled, s.",
                       h.cgroup_throttled_s_total)
