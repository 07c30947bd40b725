"""NvmlCollector with an injected fake NVML module (and the real pynvml on a machine without a driver)."""

from __future__ import annotations

import logging
import math
import os
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from phasescope.agent.sidecar.collectors import NvmlCollector
from phasescope.agent.records.events import GpuSample
from phasescope.agent.sidecar import Sidecar


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


class FakeNvml:
    """The parts of pynvml the collector uses; two GPUs, GPU 1 cannot register events."""

    NVMLError = NVMLError
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init = fail_init
        self.events: list[SimpleNamespace] = []
        self.ecc = {1: 2}
        self.calls: list[str] = []

    def nvmlInit(self):
        self.calls.append("init")
        if self.fail_init:
            raise NVMLError(12)  # library not found

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetIndex(self, handle):
        return handle[1]

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=[87, 12][h[1]], memory=40)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=[70 << 30, 1 << 30][h[1]], total=80 << 30, free=0)

    def nvmlDeviceGetPowerUsage(self, h):
        return [350_500, 61_000][h[1]]  # mW

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return [61, 35][h[1]]

    def nvmlDeviceGetClockInfo(self, h, clock):
        assert clock == self.NVML_CLOCK_SM
        if h[1] == 1:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return 1980

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        assert (kind, counter) == (self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self.NVML_VOLATILE_ECC)
        return self.ecc[h[1]] if h[1] in self.ecc else 0

    def nvmlEventSetCreate(self):
        return "set"

    def nvmlEventSetFree(self, s):
        self.calls.append("free")

    def nvmlDeviceRegisterEvents(self, h, types, s):
        assert types == self.nvmlEventTypeXidCriticalError and s == "set"
        if h[1] == 1:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)

    def nvmlEventSetWait_v2(self, s, timeout_ms):
        assert timeout_ms == 0  # never blocks the sampler
        if not self.events:
            raise NVMLError(self.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)


def test_samples_every_gpu_with_units_converted():
    nv = FakeNvml()
    c = NvmlCollector(nvml=nv, clock_ns=lambda: 42)
    s0, s1 = c.sample()
    assert s0 == GpuSample(ts_ns=42, gpu_index=0, util_pct=87.0, mem_used_bytes=70 << 30, mem_total_bytes=80 << 30,
                           power_w=350.5, temp_c=61.0, sm_clock_mhz=1980.0, xid_errors_total=0)
    assert (s1.gpu_index, s1.util_pct, s1.power_w, s1.temp_c) == (1, 12.0, 61.0, 35.0)
    assert math.isnan(s1.sm_clock_mhz)  # not supported on that GPU: NaN, the rest still read
    assert c.xid_source == {0: "events", 1: "ecc"}
    assert s1.xid_errors_total == 2  # GPU 1 cannot register events: volatile uncorrected ECC count


def test_xid_events_are_counted_per_gpu():
    nv = FakeNvml()
    c = NvmlCollector(nvml=nv)
    c.sample()
    nv.events += [SimpleNamespace(device=("handle", 0), eventData=79), SimpleNamespace(device=("handle", 0),
                                                                                       eventData=48)]
    assert [s.xid_errors_total for s in c.sample()] == [2, 2]
    nv.ecc[1] = 5
    assert [s.xid_errors_total for s in c.sample()] == [2, 5]  # monotonic totals
    c.close()
    assert nv.calls == ["init", "free", "shutdown"]


def test_no_nvml_means_no_data_logged_once(caplog):
    nv = FakeNvml(fail_init=True)
    c = NvmlCollector(nvml=nv)
    with caplog.at_level(logging.INFO, logger="phasescope.collectors"):
        assert c.sample() == [] and c.sample() == []
    assert nv.calls == ["init"]  # not retried on every sample
    assert len([r for r in caplog.records if "NVML unavailable" in r.message]) == 1
    c.close()


def test_real_pynvml_reads_exactly_the_gpus_the_driver_has():
    """The real pynvml: one sample per GPU the driver reports, with sane values; none (and no error) on a
    machine without a driver, as CI's."""
    import pynvml

    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        count = 0
    c = NvmlCollector()
    try:
        samples = c.sample()
        assert c.sample() is not None  # a second call (init not retried without a driver) does not raise
    finally:
        c.close()
    assert sorted(s.gpu_index for s in samples) == list(range(count))
    for s in samples:
        assert isinstance(s, GpuSample) and 0 <= s.util_pct <= 100 and 0 < s.mem_used_bytes <= s.mem_total_bytes


def test_device_selection_and_misuse():
    c = NvmlCollector(nvml=FakeNvml(), devices=[1, 7])
    assert [s.gpu_index for s in c.sample()] == [1]  # 7 does not exist
    with pytest.raises(ValueError):
        NvmlCollector(nvml=FakeNvml(), devices=[-1])


def test_sidecar_polls_the_collector_into_the_prometheus_exporter(short_tmp):
    from phasescope.exporters.prometheus import PrometheusExporter

    reg = CollectorRegistry()
    sc = Sidecar(os.path.join(short_tmp, "s.duckdb"), listen=[f"unix:{short_tmp}/a.sock"], batch_interval_s=0.05,
                 sinks=[PrometheusExporter(reg)], collectors=[NvmlCollector(nvml=FakeNvml())],
                 sample_interval_s=0.05).start()
    try:
        assert sc.wait_rows(lambda: reg.get_sample_value("phasescope_gpu_utilization_ratio", {"gpu": "0"}) == 0.87)
        assert reg.get_sample_value("phasescope_gpu_xid_errors_total", {"gpu": "1"}) == 2
        assert reg.get_sample_value("phasescope_gpu_power_watts", {"gpu": "0"}) == 350.5
    finally:
        sc.stop()
