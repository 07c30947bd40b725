"""Server-process and host metrics: exact values through a private registry, parsed from the text format."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from phasescope.agent.records.events import HostSample, ProcessSample
from phasescope.exporters.host_metrics import HostMetricsExporter

PROC = ProcessSample(1, 4242, "run-a", 12.5, 3.25, 17, 4243, 0.97, 0.4, 3 << 30, 41, 1000, 250)
HOST = HostSample(1, 16, 87.5, 9.0, 64 << 30, 10 << 30, 1 << 20, 4096, 8192, 35.0, 4.0, 200, 50, 1.5)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def exp():
    reg = CollectorRegistry()
    clock = Clock()
    e = HostMetricsExporter(reg, stale_after_s=60, clock=clock)
    e.on_records([(0, [HOST, PROC])])
    return e, reg, clock


def samples(reg):
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_process_metrics(exp):
    _, reg, _ = exp
    s = samples(reg)
    lab = (("pid", "4242"), ("run_id", "run-a"))
    assert s[("phasescope_process_cpu_seconds_total", (("mode", "user"),) + lab)] == 12.5
    assert s[("phasescope_process_cpu_seconds_total", (("mode", "system"),) + lab)] == 3.25
    assert s[("phasescope_process_resident_memory_bytes", lab)] == 3 << 30
    assert s[("phasescope_process_open_fds", lab)] == 41
    assert s[("phasescope_process_threads", lab)] == 17
    ctx = (("kind", "involuntary"), ("pid", "4242"), ("run_id", "run-a"))
    assert s[("phasescope_process_context_switches_total", ctx)] == 250
    assert s[("phasescope_process_busiest_thread_cpu_ratio", lab)] == 0.97
    assert s[("phasescope_process_busiest_thread_cpu_wait_ratio", lab)] == 0.4


def test_host_metrics(exp):
    _, reg, _ = exp
    s = samples(reg)
    assert s[("phasescope_host_cpus", ())] == 16
    assert s[("phasescope_host_cpu_utilization_ratio", ())] == 0.875
    assert s[("phasescope_host_load1", ())] == 9.0
    assert s[("phasescope_host_memory_available_bytes", ())] == 10 << 30
    assert s[("phasescope_host_swap_in_bytes_total", ())] == 4096
    assert s[("phasescope_host_swap_out_bytes_total", ())] == 8192
    assert s[("phasescope_host_cpu_pressure_ratio", ())] == 0.35
    assert s[("phasescope_host_cgroup_cpu_quota_cores", ())] == 4.0
    assert s[("phasescope_host_cgroup_cpu_periods_total", ())] == 200
    assert s[("phasescope_host_cgroup_cpu_throttled_periods_total", ())] == 50
    assert s[("phasescope_host_cgroup_cpu_throttled_seconds_total", ())] == 1.5


def test_unreadable_values_are_left_out_and_stale_ones_expire(exp):
    e, reg, clock = exp
    nan = math.nan
    e.on_records([(0, [HOST._replace(cpu_pressure_some_pct=nan, cgroup_cpu_quota_cores=nan, cgroup_periods_total=-1,
                                     cgroup_throttled_periods_total=-1, cgroup_throttled_s_total=nan),
                       PROC._replace(busiest_thread_cores=nan, busiest_thread_wait_ratio=nan, open_fds=-1)])])
    names = {n for n, _ in samples(reg)}
    for gone in ("phasescope_host_cpu_pressure_ratio", "phasescope_host_cgroup_cpu_quota_cores",
                 "phasescope_host_cgroup_cpu_periods_total", "phasescope_host_cgroup_cpu_throttled_seconds_total",
                 "phasescope_process_busiest_thread_cpu_ratio", "phasescope_process_open_fds"):
        assert gone not in names
    assert "phasescope_process_resident_memory_bytes" in names
    clock.t += 61
    names = {n for n, _ in samples(reg)}
    assert not any(n.startswith(("phasescope_host_", "phasescope_process_")) for n in names)
