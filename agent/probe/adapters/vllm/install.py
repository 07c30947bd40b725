"""Arming: catch the first `Scheduler`, `OutputProcessor` and `Worker` of this process and hook their instances.

The classes are touched only until their first instance exists, then put back. Nothing here runs per step.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from .common import fail

_HOOKED: dict[int, Any] = {}  # id(instance) -> hooks (keeps them alive, makes install idempotent)


def _catch_first(cls: Any, method: str, on_instance: Callable[[Any], Any]) -> None:
    """Wrap `cls.method` until its first call returns, then put the class back."""
    original = cls.__dict__.get(method)
    if original is None or getattr(original, "_phasescope_catch", False):
        return

    @functools.wraps(original)
    def catcher(self: Any, *a: Any, **k: Any) -> Any:
        result = original(self, *a, **k)
        if cls.__dict__.get(method) is catcher:
            setattr(cls, method, original)
        if id(self) not in _HOOKED:
            try:
                _HOOKED[id(self)] = on_instance(self)
            except Exception as exc:  # noqa: BLE001 - never into vLLM
                fail(f"{cls.__name__}.{method}", exc)
        return result

    catcher._phasescope_catch = True  # type: ignore[attr-defined]
    setattr(cls, method, catcher)


def install() -> None:
    """Arm the one-shot catchers for the scheduler (EngineCore), the output processor (frontend) and the worker
    (each rank). A class this vLLM does not have is counted as a failure; the others still arm."""
    from .engine import EngineHooks
    from .frontend import FrontendHooks
    from .worker import WorkerHooks

    try:
        from vllm.v1.core.sched.scheduler import Scheduler

        _catch_first(Scheduler, "__init__", EngineHooks)
    except Exception as exc:  # noqa: BLE001
        fail("Scheduler", exc)
    try:
        from vllm.v1.engine.output_processor import OutputProcessor

        _catch_first(OutputProcessor, "__init__", FrontendHooks)
    except Exception as exc:  # noqa: BLE001
        fail("OutputProcessor", exc)
    try:
        from vllm.v1.worker.gpu_worker import Worker

        _catch_first(Worker, "load_model", WorkerHooks)
    except Exception as exc:  # noqa: BLE001
        fail("Worker", exc)
