"""What every process of the vLLM adapter shares: its record channels, its install failures, the guarded and
self-timed instance wrapper, and clock conversions.

Hot path: `wrap`'s wrapper costs one attribute read (`meter.on`) per call on an unmeasured step, and four
`perf_counter_ns` readings on a measured one (one step in `Meter.every`, see budget.py).
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import time
import uuid
from typing import Any, Callable

from ....records.events import MAX_TOKENS
from ....settings import ENV_RUN_ID, ProbeSettings, from_env
from ...probe import Probe
from .wrappers import hook

log = logging.getLogger("phasescope.vllm")

RUNTIME = "vllm"
WARMUP_PREFIX = "_warmup_"  # request ids of vLLM's kernel warm-up batches (0.24: v1/worker/gpu/warmup.py)

_STATE_LOCK = threading.Lock()
_CHANNELS: dict[str, Probe] = {}  # role -> this process's record channel
_FAILURES = collections.Counter()  # install-time failures by hook name (internals that moved)
_FORKED = [False]  # this process is a forked child of a process that had armed the plugin


class _NoModule:
    """What a `Probe` hooks when there is no forward to hook: vLLM steps are timed
    around `execute_model` instead, so the probe is only a record channel here."""

    class _Handle:
        def remove(self) -> None:
            pass

    def register_forward_pre_hook(self, *a: Any, **k: Any) -> "_NoModule._Handle":
        return self._Handle()

    register_forward_hook = register_forward_pre_hook

    def parameters(self) -> Any:
        return iter(())


def run_id() -> str:
    """The run id every process of one vLLM instance shares (inherited through the environment)."""
    rid = os.environ.get(ENV_RUN_ID)
    if not rid:
        rid = uuid.uuid4().hex[:16]
        os.environ[ENV_RUN_ID] = rid
    return rid[:16]


_TIMING_OPTIONS = ("flush_interval_s", "poll_interval_s", "buffer_records", "event_pool_size", "gpu_budget",
                   "gpu_min_rate")


def _env_timing() -> dict[str, Any]:
    """The probe's timing options set by PHASESCOPE_* variables (ProbeSettings), `cuda_timing` included;
    a bad value: the defaults."""
    try:
        opts = from_env(os.environ, ProbeSettings)
    except ValueError as exc:  # the user's variable, not vLLM's internals: say so, run on the defaults
        log.warning("phasescope: %s; the vLLM probes use the default timing options", exc)
        return {}
    return {k: v for k, v in opts.items() if k in _TIMING_OPTIONS + ("cuda_timing",)}


def channel(role: str, rank: int, world_size: int, model: str, labels: dict[str, str], device: Any = None) -> Probe:
    """This process's probe for `role` ("engine", "worker", "frontend"), made once.

    A worker's probe on a CUDA `device` times the steps it is handed (`begin_step`/`end_step`)
    with sampled CUDA events, capture-safe (see probe.cuda_timing).
    """
    with _STATE_LOCK:
        p = _CHANNELS.get(role)
        if p is None:
            opts = _env_timing()
            # PHASESCOPE_CUDA_TIMING=0: the worker's steps are timed on the host only (no CUDA event, no poll)
            wanted = bool(opts.pop("cuda_timing", True))
            cuda = wanted and getattr(device, "type", "") == "cuda"
            p = Probe(_NoModule(), rank=rank, world_size=max(world_size, rank + 1), run_id=run_id(),
                      model_name=model, runtime=f"{RUNTIME}-{role}"[:16], cuda_timing=cuda,
                      device=device if cuda else None, labels=labels, **opts)
            if not _CHANNELS:
                atexit.register(close_channels)
            _CHANNELS[role] = p
            from .pause import watch  # a benchmark's pause file (pause.py); nothing unless its variable is set

            watch(p)
            if _FAILURES:
                p.label(adapter_missing=",".join(sorted(_FAILURES))[:96])
        return p


def close_channels(timeout_s: float = 1.0) -> None:
    """Send what is buffered and stop (at exit: vLLM ends its processes on SIGTERM -> SystemExit)."""
    for p in list(_CHANNELS.values()):
        try:
            p.close(timeout_s)
        except Exception:  # noqa: BLE001
            pass


def reset_after_fork() -> None:
    """In a forked child the parent's flush threads are gone: forget its channels."""
    _FORKED[0] = True
    _CHANNELS.clear()
    from .pause import _PROBES, _WATCHED

    _WATCHED[0] = False  # the child's own wake follows a benchmark's pause file (pause.py), if any
    _PROBES.clear()  # the parent's probes are not this process's: never labelled from here


def forked() -> bool:
    return _FORKED[0]


def failures() -> dict[str, int]:
    """Hooks that could not be installed on this vLLM version (name -> count)."""
    return dict(_FAILURES)


def fail(what: str, exc: BaseException) -> None:
    """Count a part of vLLM this adapter cannot read (that part is disarmed; vLLM runs on)."""
    first = what not in _FAILURES
    if not _FAILURES:
        log.warning("phasescope: vLLM internals differ from what this adapter knows (%s: %r); "
                    "those figures are missing, vLLM runs on (further failures are only counted)", what, exc)
    _FAILURES[what] += 1
    if first:  # a run label: the store and diagnose say these figures are absent, not zero
        for p in list(_CHANNELS.values()):
            try:
                p.label(adapter_missing=",".join(sorted(_FAILURES))[:96])
            except Exception:  # noqa: BLE001
                pass


class Meter:
    """The adapter's own time, measured on one engine step in `every` (set by the engine's step hook).

    `ns[part]` sums the hook time of measured steps by part; `on` is True during a measured step."""

    __slots__ = ("on", "every", "ns")

    def __init__(self, every: int = 16) -> None:
        self.on = False
        self.every = every
        self.ns: dict[str, int] = collections.defaultdict(int)


OFF = Meter()  # a meter never switched on: wrappers outside the engine's steps


def wrap(obj: Any, name: str, after: Callable[..., Any] | None, probe_ref: Callable[[], Probe | None],
         before: Callable[..., Any] | None = None, meter: Meter = OFF, part: str = "", role: str = "engine") -> bool:
    """Replace the bound method `obj.name` by a guarded wrapper on the instance.

    `before(*args, **kw)` may return replacement args (a tuple) or None; `after(result, *args, **kw)` observes.
    Neither can raise into vLLM: an exception is counted as a probe error. On a measured step the time of both is
    added to `meter.ns[part or name]`. False (and counted) when vLLM has no such method.
    """
    try:
        original = getattr(obj, name)
    except AttributeError as exc:
        fail(name, exc)
        return False
    part = part or name
    perf = time.perf_counter_ns

    def on_error(exc: BaseException) -> None:
        p = probe_ref()
        if p is not None:
            p._error(exc)
        else:
            fail("hook", exc)

    def wrapper(*args: Any, **kw: Any) -> Any:
        timed = meter.on
        t0 = perf() if timed else 0
        if before is not None:
            try:
                new = before(*args, **kw)
                if new is not None:
                    args = new
            except Exception as exc:  # noqa: BLE001 - never into vLLM
                on_error(exc)
        spent = perf() - t0 if timed else 0
        result = original(*args, **kw)
        if after is not None:
            t1 = perf() if timed else 0
            try:
                after(result, *args, **kw)
            except Exception as exc:  # noqa: BLE001
                on_error(exc)
            if timed:
                spent += perf() - t1
        if timed:
            meter.ns[part] += spent
        return result

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    hook(obj, name, wrapper, role)
    return True


# --- clocks ----------------------------------------------------------------------------------------------

def core_event_ns(request: Any, kind: str) -> int | None:
    """The latest EngineCoreEvent `kind` (QUEUED, SCHEDULED) vLLM recorded on `request`, in monotonic ns (vLLM
    stamps them with time.monotonic() in this process); None when it records none (log stats off)."""
    for ev in reversed(getattr(request, "events", None) or ()):
        t = getattr(ev, "type", None)
        name = getattr(t, "name", None)  # vLLM's EngineCoreEventType: an enum named QUEUED, SCHEDULED, ...
        if (name if name is not None else str(t).upper()) == kind:
            return int(ev.timestamp * 1e9)
    return None


def wall_minus_mono_ns(tries: int = 3) -> int:
    """time.time_ns() - time.monotonic_ns() now, from the tightest of `tries` mono-wall-mono readings (a thread
    descheduled between two reads would put the offset off by that long)."""
    best = None
    for _ in range(tries):
        a = time.monotonic_ns()
        w = time.time_ns()
        b = time.monotonic_ns()
        if best is None or b - a < best[0]:
            best = (b - a, w - (a + b) // 2)
        if b - a < 20_000:
            break
    return best[1]


def mono_of_wall(wall_s: float) -> int:
    """A wall-clock stamp of vLLM's (time.time(), s) on this process's monotonic clock (ns), by the offset now:
    two such stamps taken apart differ by their wall difference up to the clock's slew between the conversions."""
    return int(wall_s * 1e9) - wall_minus_mono_ns()


def engine_lead_us(received_ns: int, engine_ns: int) -> tuple[int, int]:
    """(lead, ts_ns) of a token event received at `received_ns` that the engine stamped at `engine_ns` (monotonic
    ns, one host): lead = ceil((received - engine) / 1 us) and ts_ns = engine_ns + 1000 * lead (the receive time,
    under 1 us later), so ts_ns - 1000 * lead is the engine's stamp exactly. (0, received_ns) when the stamp is
    not before the receive time or leads it by MAX_TOKENS us or more (the field's range; ~16.8 s): no engine time."""
    d = received_ns - engine_ns
    lead = -(-d // 1000)
    if d <= 0 or lead >= MAX_TOKENS:
        return 0, received_ns
    return lead, engine_ns + 1000 * lead


def is_abort(reason: Any) -> bool:
    """An output's finish reason that is no success: ABORT (reaching outputs only from the engine's own aborts:
    shutdown, pause; a client's abort never produces one) or ERROR (a request-level internal error)."""
    name = str(reason).upper()
    return "ABORT" in name or "ERROR" in name
