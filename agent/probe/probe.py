"""The in-process probe: forward hooks -> step records -> bounded ring -> sidecar.

Hot path (every forward): two hook calls that read tensor shapes, take
`perf_counter_ns` readings and append one tuple to a `collections.deque` with a
`maxlen` (drop-oldest; appends are atomic under the GIL, so no lock the host
could contend). On CUDA, sampled steps also record two pre-created events (see
`sampling.py`: the rate keeps the probe's host cost under `gpu_budget` of the step
time). One background thread wakes once per interval and does all the background
work: it completes the events with `Event.query()`, updates the sampler, encodes
the ring into frames, sends them and reads the sidecar's acks. The interval is
`flush_interval_s`, shortened (not below `poll_interval_s`) when the step rate
would fill a quarter of the event pool or the ring before the next wake. What that
thread costs (its CPU time per wake, read with a per-thread clock) is added to the
hooks' time, and the sampler budgets the sum (`cost.py`). On SIGTERM and at exit
the buffer is shipped on the exiting thread (`exit.py`).

Runtimes that replay CUDA graphs call no module: they time their step call with
`probe.step(...)` (or `begin_step`/`end_step`, or `time_replays(graph, ...)`),
handing in the batch's token counts. During a CUDA-graph capture nothing is
recorded and no CUDA call is made (see `cuda_timing.py`).

The hook bodies are hidden from the compiler (`torch.compiler.disable`): compiling
a probed module traces none of phasescope's code.

Every hook body is guarded: an exception is counted, logged once, and never
reaches the host. A missing sidecar only means records are dropped (counted).

The probe is three parts, base classes that keep their state on the one object (the hot path reads
the probe's own attributes, no indirection): `Probe` here (identity, labels, lifecycle),
`steptimer.StepTimer` (hooks, CUDA events, the poller) and `outbox.Outbox` (ring, the one background
wake, `flush_now`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import warnings
from typing import Any, Callable

from ..records.events import Hello, ProbeHealth, Record, RequestEvent, RunLabel, encode_frame, short_id, REQUEST_EVENTS
from ..records.address import Address, parse_address
from . import exit as exit_hooks
from .outbox import Outbox
from .sender import Sender
from .steptimer import StepTimer

log = logging.getLogger("phasescope.probe")


# the one piece of global state: which models have a probe attached
_REGISTRY: dict[int, "Probe"] = {}
_REGISTRY_LOCK = threading.Lock()


def _torch() -> Any:
    import torch

    return torch


class Probe(StepTimer, Outbox):
    """Measures every forward of one model and ships records to the sidecar.

    Construct through `attach()`. Arguments are validated here (loud); the
    environment (no GPU, no sidecar) only degrades to fewer data (quiet).
    """

    def __init__(
        self,
        model: Any,
        *,
        address: str | Address | None = None,
        agent: str | Address | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        run_id: str | None = None,
        model_name: str | None = None,
        runtime: str = "module",
        buffer_records: int = 65536,
        flush_interval_s: float = 0.1,
        cuda_timing: bool = True,
        event_pool_size: int = 256,
        poll_interval_s: float = 0.02,
        gpu_budget: float | None = 0.005,
        gpu_min_rate: float = 0.001,
        device: Any = None,
        seed: int | None = None,
        exact_tokens: bool = True,
        connect: bool = True,
        sink: Callable[[list[Record]], None] | None = None,
        labels: dict[str, Any] | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        perf_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        if not hasattr(model, "register_forward_pre_hook"):
            raise TypeError(f"attach() needs a torch.nn.Module, got {type(model).__name__}")
        from ..settings import ProbeSettings, check_options

        # every value option against its declared range (agent/settings.py), here where it is given
        check_options(ProbeSettings, {
            "address": next((a for a in (address, agent) if a is not None and not isinstance(a, Address)), None),
            "rank": rank, "world_size": world_size,
            "buffer_records": buffer_records, "flush_interval_s": flush_interval_s, "event_pool_size": event_pool_size,
            "poll_interval_s": poll_interval_s, "gpu_budget": gpu_budget, "gpu_min_rate": gpu_min_rate})
        if buffer_records < 16:
            raise ValueError("buffer_records must be >= 16")
        if not (0.001 <= flush_interval_s <= 60):
            raise ValueError("flush_interval_s must be within [0.001, 60]")
        if rank is None:
            rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
        if world_size is None:
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if rank < 0 or world_size < 1 or rank >= world_size:
            raise ValueError(f"bad rank {rank} for world_size {world_size}")
        if agent is not None:  # the old spelling of `address`: kept for one release
            warnings.warn("attach(agent=...) is deprecated and goes in the next release; use attach(address=...)",
                          DeprecationWarning, stacklevel=3)
            if address is not None:
                raise TypeError("attach() got both address= and its deprecated alias agent=")
            address = agent
        self.addr = address if isinstance(address, Address) else parse_address(address)
        self.rank = rank
        self.world_size = world_size
        self.run_id = (run_id or uuid.uuid4().hex[:16])[:16]
        self.model_name = model_name or _model_name(model)
        self.runtime = runtime
        self.exact_tokens = exact_tokens
        self._clock_ns = clock_ns  # timestamps of records (monotonic, ns)
        self._perf = perf_ns  # durations (ns); both injectable for tests
        self._model = model
        from .labels import model_labels

        # run labels (config key/values): sent after the Hello on every connection; latest value wins
        self.labels: dict[str, str] = {**model_labels(model, world_size),
                                       **{str(k): str(v) for k, v in (labels or {}).items()}}
        for key, value in self.labels.items():
            if len(key.encode()) > 32 or len(value.encode()) > 96:
                raise ValueError(f"label {key!r}={value!r}: keys are at most 32 bytes, values 96")

        self.errors = 0  # counted by every thread (never raised to the host)
        self._error_logged = False
        self._init_outbox(buffer_records, flush_interval_s, poll_interval_s,
                          Sender(self.addr, self._hello_frame) if connect and sink is None else None, sink)
        device = device if device is not None else _model_device(model)
        if isinstance(device, str):
            device = _torch().device(device)
        self._init_timer(device, cuda_timing=cuda_timing, event_pool_size=event_pool_size,
                         poll_interval_s=poll_interval_s, gpu_budget=gpu_budget, gpu_min_rate=gpu_min_rate,
                         seed=seed)
        self._restores: list[Callable[[], None]] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._pid = os.getpid()  # a forked child inherits this object, not its thread or its connection
        pre, post = _compiler_opaque(self._pre_hook), _compiler_opaque(self._post_hook)
        self._handles = [
            model.register_forward_pre_hook(pre, with_kwargs=True),
            model.register_forward_hook(post, with_kwargs=True, always_call=True),
        ]
        self._threads.append(threading.Thread(target=self._wake_loop, name="phasescope-flush", daemon=True))
        for t in self._threads:
            t.start()
        self.exit_hooked = exit_hooks.register(self)  # ship at SIGTERM (chained) and at exit

    # --- public API -------------------------------------------------------

    def request_event(
        self, request_id: str, event: str, ts_ns: int | None = None, tokens: int = 0, cached_tokens: int = 0
    ) -> None:
        """Record one request lifecycle event (see events.REQUEST_EVENTS). Never raises."""
        try:
            t = self._perf()
            self._push(
                RequestEvent(
                    self._clock_ns() if ts_ns is None else ts_ns,
                    self.rank,
                    REQUEST_EVENTS.index(event),
                    short_id(str(request_id)),
                    tokens,
                    cached_tokens,
                )
            )
            # counted in the probe's cost (cost.py), at most one interval's cap (sampling.py: a deschedule is no
            # cost); a compare, not min(): ~100 ns less per record
            sampler = self.sampler
            d = self._perf() - t
            sampler.other_ns += d if d <= sampler.cost_cap_ns else sampler.cost_cap_ns
        except Exception as exc:  # noqa: BLE001 - the host must never see our errors
            self._error(exc)

    def label(self, **labels: Any) -> None:
        """Add or change run labels (e.g. the config values an experiment varies)."""
        now = self._clock_ns()
        for key, value in labels.items():
            self.labels[key] = str(value)
            self._push(RunLabel(now, key, str(value)))

    def emit(self, record: Record) -> None:
        """Queue any record (adapters and collectors use this). Never raises."""
        t = self._perf()
        self._push(record)
        sampler = self.sampler
        d = self._perf() - t
        sampler.other_ns += d if d <= sampler.cost_cap_ns else sampler.cost_cap_ns

    def health(self) -> ProbeHealth:
        """The probe's counters now."""
        return ProbeHealth(
            self._clock_ns(),
            self.rank,
            os.getpid(),
            self.records,
            self.dropped + (self._sender.lost + self._sender.rejected if self._sender else 0),
            self.errors,
            self.frames_sent,
            self._sender.failures if self._sender else 0,
            self.gpu_unsampled,
            self.sampler.timed_total,
            self.sampler.overall_rate() if self._pool is not None else 1.0,
            self.captured,
            (self.sampler.hooks_ns() + self.cost.bg_cpu_ns) / 1e9,
            self.cost.bg_cpu_ns / 1e9,
            self.cost.gil_wait_ns / 1e9,
            self.cost.share,
        )

    def close(self, timeout_s: float = 5.0) -> None:
        """Remove the hooks, finish pending GPU timings, send what is left, stop threads."""
        if self._closed:
            return
        self._closed = True
        exit_hooks.unregister(self)
        for h in self._handles:
            h.remove()
        for restore in self._restores:
            restore()
        self.flush(timeout_s)
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
        if self._guard is not None:
            self._guard.release()
        if self._sender is not None:
            self._sender.close()
        # what no sidecar took before the end (none came, or the window stayed full) is counted, not gone
        left = len(self._ring) + len(self._pending)
        if left:
            self._ring.clear()
            self._pending.clear()
            self.dropped += left
            log.info("phasescope: %d record(s) not delivered at close (no sidecar took them): counted as dropped",
                     left)
        with _REGISTRY_LOCK:
            if _REGISTRY.get(id(self._model)) is self:
                del _REGISTRY[id(self._model)]

    def __enter__(self) -> "Probe":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _hello_frame(self) -> bytes:
        wall_minus_mono = time.time_ns() - self._clock_ns()
        hello = Hello(
            self._clock_ns(), wall_minus_mono, os.getpid(), self.rank, self.world_size,
            self.run_id, self.model_name.encode()[:48].decode("utf-8", "ignore"), self.runtime[:16],
        )
        now = self._clock_ns()
        return encode_frame([hello] + [RunLabel(now, k, v) for k, v in self.labels.items()])

    def _error(self, exc: BaseException) -> None:
        self.errors += 1
        if not self._error_logged:
            self._error_logged = True
            log.warning("phasescope probe error (further errors are only counted): %r", exc)


def _compiler_opaque(fn: Callable) -> Callable:
    """`fn` hidden from torch.compile (Dynamo runs it eagerly, traces nothing inside).

    Costs ~0.5 us per call in eager mode; the alternative (Dynamo tracing our hooks)
    warns on the clock reads and breaks the user's graph inside the hook.
    """
    try:
        import torch

        return torch.compiler.disable(fn)
    except (ImportError, AttributeError):
        return fn


def _model_device(model: Any) -> Any:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return None


def _model_name(model: Any) -> str:
    cfg = getattr(model, "config", None)
    name = getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", "") or type(model).__name__
    return str(name)


def attach(model: Any, **options: Any) -> Probe:
    """Attach a probe to `model` (a torch.nn.Module); see `Probe` for options.

    One probe per model: attaching twice raises ValueError.
    """
    with _REGISTRY_LOCK:
        if id(model) in _REGISTRY:
            raise ValueError("a phasescope probe is already attached to this model; close() it first")
        probe = Probe(model, **options)
        _REGISTRY[id(model)] = probe
    return probe


def attached(model: Any) -> Probe | None:
    """The probe attached to `model`, if any."""
    return _REGISTRY.get(id(model))
