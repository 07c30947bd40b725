"""vLLM plugin entry points (pyproject: `vllm.general_plugins`, `vllm.stat_logger_plugins`).

Off unless `PHASESCOPE_AGENT` is set (e.g. `unix:/run/phasescope/agent.sock`):
then `register()` arms the adapter in every vLLM process (frontend, EngineCore,
each worker), and `StatLogger` (frontend of `vllm serve` / `AsyncLLM` only)
records vLLM's own per-engine gauges: running and waiting requests and KV usage
per engine, which is what data-parallel imbalance is measured from.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ...records.address import ENV_ADDRESS
from ...records.events import ServerMetric

log = logging.getLogger("phasescope.vllm")
_FORK_HOOKED = False


def enabled() -> bool:
    """Whether phasescope is switched on for this process."""
    return bool(os.environ.get(ENV_ADDRESS))


def _after_fork_in_child() -> None:
    # a forked EngineCore/worker inherits vLLM's `plugins_loaded = True` and would never
    # call register() again; reset it so the child arms its own hooks
    try:
        import vllm.plugins

        vllm.plugins.plugins_loaded = False
    except Exception:  # noqa: BLE001
        pass
    from . import vllm as adapter

    adapter.reset_after_fork()


def register() -> None:
    """`vllm.general_plugins` entry point: arm the adapter in this process. Never raises."""
    global _FORK_HOOKED
    if not enabled():
        return
    try:
        from . import vllm as adapter

        adapter.run_id()  # fixed here so every child inherits the same run id
        adapter.install()
        if not _FORK_HOOKED:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _FORK_HOOKED = True
    except Exception as exc:  # noqa: BLE001 - vLLM must start regardless
        log.warning("phasescope: vLLM plugin not armed: %r", exc)


try:
    from vllm.v1.metrics.loggers import StatLoggerBase as _Base
except Exception:  # noqa: BLE001 - a vLLM without this interface: the class is then inert
    _Base = object  # type: ignore[assignment,misc]


class StatLogger(_Base):  # type: ignore[misc,valid-type]
    """`vllm.stat_logger_plugins` entry point: vLLM's per-step SchedulerStats, per engine.

    Emits `ServerMetric` samples named like vLLM's own gauges
    (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
    `vllm:kv_cache_usage_perc`) with the engine index, once per engine step.
    """

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.probe = None
        if not enabled():
            return
        try:
            from . import vllm as adapter

            labels = adapter.config_labels(vllm_config)
            self.probe = adapter.channel("frontend", 0, 1, adapter._model_name(vllm_config), labels)
            self.probe.label(**labels)
        except Exception as exc:  # noqa: BLE001
            log.warning("phasescope: stat logger inert: %r", exc)

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if self.probe is None or scheduler_stats is None:
            return
        try:
            now = time.monotonic_ns()
            emit = self.probe.emit
            emit(ServerMetric(now, engine_idx, "vllm:num_requests_running", "",
                              float(scheduler_stats.num_running_reqs)))
            emit(ServerMetric(now, engine_idx, "vllm:num_requests_waiting", "",
                              float(scheduler_stats.num_waiting_reqs)))
            emit(ServerMetric(now, engine_idx, "vllm:kv_cache_usage_perc", "",
                              float(scheduler_stats.kv_cache_usage)))
        except Exception as exc:  # noqa: BLE001
            self.probe._error(exc)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass
