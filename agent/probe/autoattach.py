"""Zero-code attach: probes for the models a program loads, configured by environment variables.

`phasescope run -- python serve.py` puts `bootstrap/` on PYTHONPATH; its
`sitecustomize` calls `install()`, which waits for transformers to be imported and
then wraps, once per class:

- `PreTrainedModel.from_pretrained`: the loaded model gets a probe (every forward
  becomes a step record) and its `init_continuous_batching` is instrumented;
- `init_continuous_batching` and `generate` of models built another way: the probe
  is attached on the first call (runtime "hf-cb" or "hf-generate").

`generate` calls that pass no streamer of their own report request lifecycles too.
vLLM is not patched here: its phasescope plugin reads the same variables.

Variables (all optional; every option of `ProbeSettings` has one, see docs/settings.md):
    PHASESCOPE_AGENT        where the sidecar listens (unix:/path or tcp:HOST:PORT)
    PHASESCOPE_RUN_ID       run id shared by every process of the run
    PHASESCOPE_LABELS       run labels, "key=value,key=value"
    PHASESCOPE_CUDA_TIMING  0 to time forwards on the host only (default 1)
    PHASESCOPE_DISABLE      1 to load nothing

Nothing here raises into the program or prints: a failure is logged once at
DEBUG level on the "phasescope.autoattach" logger and the program runs unprobed.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.util
import logging
import os
import sys
import threading
from typing import Any, Callable, Mapping

from ..settings import ENV_CUDA_TIMING, ENV_DISABLE, ENV_LABELS, ENV_RUN_ID, ProbeSettings, from_env, parse_labels
from ..settings import probe_options

__all__ = ["ENV_CUDA_TIMING", "ENV_DISABLE", "ENV_LABELS", "ENV_RUN_ID", "install", "options_from_env", "parse_labels",
           "probe_for"]

log = logging.getLogger("phasescope.autoattach")

_PATCHED = "__phasescope_autoattach__"
_lock = threading.RLock()
_probes: list[Any] = []
_adapters: dict[int, Any] = {}
_failed = False


def options_from_env(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Probe options (`attach(model, **options)`) set by PHASESCOPE_* variables (`ProbeSettings`). Raises ValueError."""
    return from_env(environ, ProbeSettings)


def _fail(exc: BaseException) -> None:
    global _failed
    if not _failed:
        _failed = True
        log.debug("phasescope auto-attach failed; the program runs unprobed: %r", exc)


def probe_for(model: Any, runtime: str) -> Any:
    """The probe of `model`, attaching one (and the continuous-batching adapter) if it has none."""
    from .adapters.hf_cb import HFContinuousBatching
    from .probe import attach, attached

    with _lock:
        probe = attached(model)
        if probe is None:
            probe = attach(model, **probe_options({"runtime": runtime}))  # argument > env
            _probes.append(probe)
            if hasattr(model, "init_continuous_batching"):
                _adapters[id(model)] = HFContinuousBatching(probe).instrument_model(model)
        return probe


def _wrap_from_pretrained(owner: type) -> None:
    original = owner.__dict__["from_pretrained"]
    func = original.__func__

    @functools.wraps(func)
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        model = func(cls, *args, **kwargs)
        try:
            if hasattr(model, "register_forward_pre_hook"):
                probe_for(model, "hf-generate")
        except Exception as exc:  # noqa: BLE001 - never into the program
            _fail(exc)
        return model

    setattr(from_pretrained, _PATCHED, original)
    setattr(owner, "from_pretrained", classmethod(from_pretrained))


def _wrap_init_cb(owner: type) -> None:
    original = owner.__dict__["init_continuous_batching"]

    @functools.wraps(original)
    def init_continuous_batching(self: Any, *args: Any, **kwargs: Any) -> Any:
        # an instance-level wrapper (the adapter's) shadows this one: reaching here with one
        # present means it is calling through to us, so run the original
        if "init_continuous_batching" in vars(self):
            return original(self, *args, **kwargs)
        try:
            probe_for(self, "hf-cb")
        except Exception as exc:  # noqa: BLE001
            _fail(exc)
        if "init_continuous_batching" in vars(self):
            return self.init_continuous_batching(*args, **kwargs)
        return original(self, *args, **kwargs)

    setattr(init_continuous_batching, _PATCHED, original)
    setattr(owner, "init_continuous_batching", init_continuous_batching)


def _wrap_generate(owner: type) -> None:
    original = owner.__dict__["generate"]

    @functools.wraps(original)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        tracker = None
        try:
            probe = probe_for(self, "hf-generate")
            tracker = _tracker(self, probe, args, kwargs)
            if tracker is not None:
                kwargs["streamer"] = tracker
        except Exception as exc:  # noqa: BLE001
            _fail(exc)
        out = original(self, *args, **kwargs)
        if tracker is not None:
            try:
                n = len(tracker.token_ns)
                tracker.finish([n] * len(tracker.request_ids))
            except Exception as exc:  # noqa: BLE001
                _fail(exc)
        return out

    setattr(generate, _PATCHED, original)
    setattr(owner, "generate", generate)


_generate_calls = 0


def _tracker(model: Any, probe: Any, args: tuple, kwargs: dict) -> Any:
    """A request tracker for a generate call without a streamer or beams (rows = requests), else None.

    Every row is counted as generating the batch's number of new tokens (rows that stop
    early are padded by generate; telling them apart would need a device read)."""
    global _generate_calls
    if kwargs.get("streamer") is not None:
        return None
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    if int(kwargs.get("num_beams") or getattr(config, "num_beams", 1) or 1) > 1:
        return None  # generate refuses a streamer with beam search
    ids = kwargs.get("input_ids", args[0] if args else None)
    shape = getattr(ids, "shape", None)
    if shape is None or len(shape) != 2:
        return None
    from .adapters.hf_generate import GenerateRequests

    _generate_calls += 1
    rows, width = int(shape[0]), int(shape[1])
    rids = [f"gen-{os.getpid()}-{_generate_calls}-{i}" for i in range(rows)]
    return GenerateRequests(probe, rids, [width] * rows)


def _owner(cls: type, name: str) -> type | None:
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    return None


# module -> (class name, methods to wrap); each class is patched when its module is imported
TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "transformers.modeling_utils": ("PreTrainedModel", ("from_pretrained",)),
    "transformers.generation.utils": ("GenerationMixin", ("init_continuous_batching", "generate")),
}
_WRAPPERS: dict[str, Callable[[type], None]] = {
    "from_pretrained": _wrap_from_pretrained, "init_continuous_batching": _wrap_init_cb, "generate": _wrap_generate,
}


def patch_module(module: Any) -> None:
    """Wrap the methods TARGETS names for this module's class (once; absent ones are skipped)."""
    class_name, methods = TARGETS[module.__name__]
    base = getattr(module, class_name, None)
    if base is None:
        return
    for name in methods:
        owner = _owner(base, name)
        if owner is None:
            continue
        current = owner.__dict__[name]
        if hasattr(getattr(current, "__func__", current), _PATCHED):
            continue
        _WRAPPERS[name](owner)


def unpatch_module(module: Any) -> None:
    """Restore what patch_module wrapped (tests)."""
    class_name, methods = TARGETS[module.__name__]
    base = getattr(module, class_name, None)
    for name in methods:
        owner = _owner(base, name) if base is not None else None
        if owner is None:
            continue
        current = owner.__dict__[name]
        original = getattr(getattr(current, "__func__", current), _PATCHED, None)
        if original is not None:
            setattr(owner, name, original)


class _LoaderWithHook(importlib.abc.Loader):
    """Runs `callback(module)` after the wrapped loader executed the module."""

    def __init__(self, inner: Any, callback: Callable[[Any], None]) -> None:
        self._inner = inner
        self._callback = callback

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        try:
            self._callback(module)
        except Exception as exc:  # noqa: BLE001
            _fail(exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `callback(module)` once the module `name` is imported."""

    def __init__(self, name: str, callback: Callable[[Any], None]) -> None:
        self.name = name
        self.callback = callback
        self._busy = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _LoaderWithHook(spec.loader, self.callback)
        return spec


def _close_all() -> None:
    for probe in list(_probes):
        try:
            probe.close(timeout_s=2.0)
        except Exception as exc:  # noqa: BLE001
            _fail(exc)


def install(environ: Mapping[str, str] = os.environ) -> bool:
    """Patch transformers when (or if already) imported; close the probes at exit. False if disabled."""
    if environ.get(ENV_DISABLE, "").strip() in ("1", "true", "yes"):
        return False
    try:
        options_from_env(environ)  # a bad variable: say so once, attach nothing
    except ValueError as exc:
        _fail(exc)
        return False
    for name in TARGETS:
        if name in sys.modules:
            patch_module(sys.modules[name])
        else:
            sys.meta_path.insert(0, _AfterImport(name, patch_module))
    atexit.register(_close_all)
    return True
