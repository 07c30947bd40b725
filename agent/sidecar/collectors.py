"""Collectors the sidecar polls itself: GPUs through NVML.

`NvmlCollector.sample()` returns one `GpuSample` per GPU. What it reads, per
device (nvidia-ml-py's `pynvml`):

- util_pct        nvmlDeviceGetUtilizationRates().gpu    (% of the last sample period a kernel ran)
- mem_used_bytes  nvmlDeviceGetMemoryInfo().used
- mem_total_bytes nvmlDeviceGetMemoryInfo().total
- power_w         nvmlDeviceGetPowerUsage() / 1000        (mW -> W)
- temp_c          nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)
- sm_clock_mhz    nvmlDeviceGetClockInfo(NVML_CLOCK_SM)
- xid_errors_total  XID critical-error events counted since the collector started,
                  from an NVML event set (nvmlDeviceRegisterEvents with
                  nvmlEventTypeXidCriticalError, drained without waiting at each
                  sample). Where the device cannot register events (some
                  virtualised or older GPUs), the volatile uncorrected ECC error
                  count (nvmlDeviceGetTotalEccErrors) stands in; `xid_source`
                  says which ("events", "ecc" or "none" per GPU).

Quiet for the environment: no pynvml, no driver, or nvmlInit failing gives no
data (logged once); a query a GPU does not support reads NaN (0 for counts).
The NVML module is injected for tests.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Sequence

from ..records.events import GpuSample, Record

log = logging.getLogger("phasescope.collectors")

NAN = math.nan


class NvmlCollector:
    """One GpuSample per GPU per `sample()`; nothing at all when NVML is unavailable."""

    def __init__(self, nvml: Any = None, clock_ns: Callable[[], int] = time.monotonic_ns,
                 devices: Sequence[int] | None = None) -> None:
        if devices is not None and any(int(d) < 0 for d in devices):
            raise ValueError("device indexes must be >= 0")
        self._nvml = nvml
        self._clock_ns = clock_ns
        self._devices = None if devices is None else [int(d) for d in devices]
        self._handles: list[tuple[int, Any]] = []
        self._event_set: Any = None
        self._xid: dict[int, int] = {}
        self.xid_source: dict[int, str] = {}
        self._state = "new"  # new -> ready | unavailable -> closed

    # --- lifecycle ---------------------------------------------------------

    def _init(self) -> bool:
        if self._state != "new":
            return self._state == "ready"
        try:
            if self._nvml is None:
                import pynvml  # nvidia-ml-py

                self._nvml = pynvml
            nv = self._nvml
            nv.nvmlInit()
            count = nv.nvmlDeviceGetCount()
            indexes = self._devices if self._devices is not None else list(range(count))
            self._handles = [(i, nv.nvmlDeviceGetHandleByIndex(i)) for i in indexes if i < count]
        except Exception as exc:  # noqa: BLE001 - no NVML is an environment, not an error
            log.info("NVML unavailable, no GPU samples: %r", exc)
            self._state = "unavailable"
            return False
        self._setup_xid_events()
        self._state = "ready"
        return True

    def _setup_xid_events(self) -> None:
        nv = self._nvml
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except Exception as exc:  # noqa: BLE001
            log.info("NVML event sets unavailable, XID from ECC counts: %r", exc)
            self._event_set = None
        for idx, handle in self._handles:
            self._xid[idx] = 0
            source = "none"
            if self._event_set is not None:
                try:
                    nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, self._event_set)
                    source = "events"
                except Exception:  # noqa: BLE001 - not supported on this device
                    pass
            if source == "none" and _query(nv.nvmlDeviceGetTotalEccErrors, handle,
                                           nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC) is not None:
                source = "ecc"
            self.xid_source[idx] = source

    def close(self) -> None:
        """Free the event set and shut NVML down (only if this collector initialised it)."""
        if self._state != "ready":
            self._state = "closed"
            return
        self._state = "closed"
        nv = self._nvml
        if self._event_set is not None:
            _query(nv.nvmlEventSetFree, self._event_set)
            self._event_set = None
        _query(nv.nvmlShutdown)

    # --- Collector ---------------------------------------------------------

    def sample(self) -> list[Record]:
        if not self._init():
            return []
        nv = self._nvml
        self._drain_xid_events()
        out: list[Record] = []
        for idx, h in self._handles:
            util = _query(nv.nvmlDeviceGetUtilizationRates, h)
            mem = _query(nv.nvmlDeviceGetMemoryInfo, h)
            power_mw = _query(nv.nvmlDeviceGetPowerUsage, h)
            temp = _query(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
            clock = _query(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
            if self.xid_source.get(idx) == "ecc":
                xid = _query(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                             nv.NVML_VOLATILE_ECC) or 0
            else:
                xid = self._xid.get(idx, 0)
            out.append(GpuSample(
                ts_ns=self._clock_ns(), gpu_index=idx,
                util_pct=float(util.gpu) if util is not None else NAN,
                mem_used_bytes=int(mem.used) if mem is not None else 0,
                mem_total_bytes=int(mem.total) if mem is not None else 0,
                power_w=power_mw / 1000.0 if power_mw is not None else NAN,
                temp_c=float(temp) if temp is not None else NAN,
                sm_clock_mhz=float(clock) if clock is not None else NAN,
                xid_errors_total=int(xid),
            ))
        return out

    def _drain_xid_events(self, max_events: int = 1024) -> None:
        """Count the XID events queued since the last sample, without waiting."""
        if self._event_set is None:
            return
        nv = self._nvml
        wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        for _ in range(max_events):
            try:
                data = wait(self._event_set, 0)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) != nv.NVML_ERROR_TIMEOUT:
                    log.info("NVML event wait failed: %r", exc)
                return
            try:
                idx = nv.nvmlDeviceGetIndex(data.device)
            except Exception:  # noqa: BLE001
                continue
            if idx in self._xid:
                self._xid[idx] += 1
                log.warning("GPU %d reported XID %s", idx, getattr(data, "eventData", "?"))


def _query(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), or None when the device or driver does not support it (nvitop's nvmlQuery)."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - unsupported query on this GPU
        return None
