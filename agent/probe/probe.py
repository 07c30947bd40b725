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
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
import warnings
from typing import Any, Callable

from ..records.events import (
    PHASE_IDLE,
    Hello,
    ProbeHealth,
    Record,
    RequestEvent,
    RunLabel,
    Step,
    encode_frame,
    record_size,
    short_id,
    MAX_FRAME_BYTES,
    REQUEST_EVENTS,
)
from .phases import StepShape, classify_packed, classify_padded, phase_of
from ..records.address import Address, parse_address
from . import exit as exit_hooks
from .cost import CostMeter
from .sampling import BudgetSampler
from .sender import Sender

log = logging.getLogger("phasescope.probe")

NAN = float("nan")
# records per frame, so one frame always stays under MAX_FRAME_BYTES
_MAX_RECORD_BYTES = max(record_size(c) for c in (Hello, Step, RequestEvent, ProbeHealth)) + 32
FRAME_RECORDS = min(8192, MAX_FRAME_BYTES // _MAX_RECORD_BYTES)
# records encoded per frame by the background thread, which lets the GIL go between frames: a wake holds
# the GIL for one chunk's encode at most (~0.1-1 ms), not for the whole ring's, so a host thread that
# returns from its sync into a busy wake waits for one chunk
WAKE_CHUNK_RECORDS = min(FRAME_RECORDS, 512)

# the one piece of global state: which models have a probe attached
_REGISTRY: dict[int, "Probe"] = {}
_REGISTRY_LOCK = threading.Lock()


def _torch() -> Any:
    import torch

    return torch


def _first_tensor(args: tuple, kwargs: dict, *names: str) -> Any:
    for name in names:
        v = kwargs.get(name)
        if v is not None:
            return v
    return args[0] if args else None


def _cache_len(cache: Any) -> int | None:
    """Tokens per sequence already in an HF cache, read on the host (no device sync)."""
    if cache is None:
        return 0
    if isinstance(cache, (tuple, list)):  # legacy ((k, v), ...) caches
        return int(cache[0][0].shape[-2]) if cache and cache[0] is not None else 0
    get = getattr(cache, "get_seq_length", None)
    if get is None:
        return None
    # transformers >= 5 keeps integer lengths on the host for every cache type
    return int(get())


class Probe:
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
        self.flush_interval_s = flush_interval_s
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

        # counters (monotonic); written by one thread each except `dropped`
        self.records = 0
        self.dropped = 0
        self.errors = 0
        self.frames_sent = 0
        self.gpu_unsampled = 0
        self.captured = 0  # forwards/steps seen while a CUDA graph was being captured (not recorded)
        self.steps = 0
        self._error_logged = False

        self._ring: collections.deque[Record] = collections.deque(maxlen=buffer_records)
        self._maxlen = buffer_records
        # the step in flight: (t0_ns, mono_ns, shape, slot, pre_cost_ns, timed)
        self._open: tuple | None = None
        self._in_step = False  # an explicit begin_step() owns the step: module hooks stand aside
        self._last_mono = 0  # start of the previous step (period accounting)
        # a runtime adapter that knows the batch exactly sets this just before the forward
        self.next_shape: StepShape | None = None
        self.sampler = BudgetSampler(gpu_budget, gpu_min_rate, seed)

        self._device = device if device is not None else _model_device(model)
        if isinstance(self._device, str):
            self._device = _torch().device(self._device)
        self._pool = None
        self._guard = None
        self._capturing: Callable[[], bool] | None = None
        self._pending: collections.deque = collections.deque()
        self._last_prefill: tuple[int, int, int] | None = None  # poller thread only
        self._poll_interval_s = poll_interval_s
        if cuda_timing and self._device is not None and getattr(self._device, "type", "") == "cuda":
            from .cuda_timing import GUARD, EventPool, capturing

            self._pool = EventPool(self._device, event_pool_size)
            self._guard = GUARD
            self._capturing = capturing
            GUARD.acquire()

        self._restores: list[Callable[[], None]] = []
        self._stop = threading.Event()
        # `sink` (tests, benchmarks) receives record batches in place of a socket
        self._sink = sink
        self._sender = Sender(self.addr, self._hello_frame) if connect and sink is None else None
        self._threads: list[threading.Thread] = []
        self.cost = CostMeter()
        # held by whoever does background work: the background thread's wake, or an exit hook's ship
        self._bg_lock = threading.Lock()
        # the background thread's current wake interval; the first wake comes early, so the sampler
        # measures the step period (and leaves its initial min_rate) soon after attach
        self._interval_s = min(poll_interval_s, flush_interval_s)
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
            self.sampler.other_ns += self._perf() - t  # counted in the probe's cost (cost.py)
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
        self.sampler.other_ns += self._perf() - t

    def begin_step(self, phase: int | None = None, num_seqs: int = 0, prefill_tokens: int = 0,
                   decode_tokens: int = 0, context_tokens: int = 0) -> None:
        """Open a step the runtime times itself (e.g. around a CUDA-graph replay). Never raises.

        Token counts are the real batch's (not a padded graph's); `phase` (events.PHASE_*)
        defaults to what the counts imply. Events, when this step is sampled, are recorded on
        the current stream here and in `end_step()`, outside any graph. Module hooks of a
        probed module called in between record nothing (the step is this one).
        """
        try:
            t_in = self._perf()
            if self._in_step:
                self._end(t_in)  # the previous step was never ended: close it here
            self._in_step = True
            guard = self._guard
            if guard is not None and guard.depth:
                self.captured += 1
                self._open = None
                return
            if phase is None:
                phase = phase_of(prefill_tokens, decode_tokens)
            self._begin(StepShape(phase, num_seqs, prefill_tokens, decode_tokens, context_tokens), t_in)
        except Exception as exc:  # noqa: BLE001
            self._open = None
            self._error(exc)

    def end_step(self) -> None:
        """Close the step opened by `begin_step()`. Never raises."""
        try:
            t1 = self._perf()
            self._in_step = False
            self._end(t1)
        except Exception as exc:  # noqa: BLE001
            self._error(exc)

    def step(self, phase: int | None = None, num_seqs: int = 0, prefill_tokens: int = 0, decode_tokens: int = 0,
             context_tokens: int = 0) -> "_StepScope":
        """`with probe.step(decode_tokens=16, num_seqs=16, context_tokens=ctx): graph.replay()`."""
        return _StepScope(self, (phase, num_seqs, prefill_tokens, decode_tokens, context_tokens))

    def time_replays(self, graph: Any, shape: Callable[[], StepShape | tuple]) -> Callable[[], None]:
        """Time every `graph.replay()` of this CUDAGraph instance as one step.

        `shape()` returns the batch of the replay about to run (a StepShape, or the
        arguments of `begin_step` as a tuple). Returns a function that puts the
        instance's `replay` back (also done by `close()`).
        """
        inner = graph.replay

        def replay(*a: Any, **k: Any) -> Any:
            try:
                s = shape()
            except Exception as exc:  # noqa: BLE001
                self._error(exc)
                return inner(*a, **k)
            self.begin_step(*s)
            try:
                return inner(*a, **k)
            finally:
                self.end_step()

        graph.replay = replay

        def restore() -> None:
            if graph.__dict__.get("replay") is replay:
                del graph.replay

        self._restores.append(restore)
        return restore

    @property
    def connected(self) -> bool:
        """Whether the flush thread holds a connection to the sidecar now."""
        return self._sender is not None and self._sender.connected

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

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until queued records are handed to the socket (or dropped). True if drained."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._ring and not self._pending:
                return True
            time.sleep(0.005)
        return not self._ring and not self._pending

    def flush_now(self, timeout_s: float = 1.0) -> bool:
        """Ship what is buffered now, on the calling thread (exit hooks: SIGTERM, atexit). Never raises.

        Waits (up to `timeout_s`) for the device to finish the timed steps still pending, records
        them, and hands every record to the socket. True if nothing is left behind.
        """
        if self._closed:
            return not self._ring and not self._pending
        if os.getpid() != self._pid:  # a forked child: the socket is the parent's, never write to it
            return False
        deadline = time.monotonic() + timeout_s
        if not self._bg_lock.acquire(timeout=timeout_s):
            return False
        try:
            guard = self._guard
            while self._pending:
                if guard is None or self._pool is None:
                    self._complete()
                elif guard.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    try:
                        if not guard.depth:
                            self._complete()
                    finally:
                        guard.lock.release()
                if not self._pending or time.monotonic() >= deadline:
                    break
                time.sleep(0.001)
            self._push(self.health())
            self._flush_once()
        except Exception as exc:  # noqa: BLE001
            self._error(exc)
        finally:
            self._bg_lock.release()
        return not self._ring and not self._pending

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

    # --- hot path ---------------------------------------------------------

    def _push(self, rec: Record) -> None:
        ring = self._ring
        if len(ring) >= self._maxlen:
            self.dropped += 1  # drop-oldest: the deque discards the head on append
        ring.append(rec)
        self.records += 1

    def _pre_hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        try:
            t_in = self._perf()
            if self._in_step:
                return  # the runtime times this step itself (begin_step)
            guard = self._guard
            if guard is not None and guard.depth:
                self.captured += 1  # a CUDA-graph capture: nothing recorded, no CUDA call
                self._open = None
                return
            shape = self.next_shape
            if shape is None:
                shape = self._inspect(args, kwargs)
            else:
                self.next_shape = None
            self._begin(shape, t_in)
        except Exception as exc:  # noqa: BLE001
            self._open = None
            self._error(exc)

    def _post_hook(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        try:
            if not self._in_step:
                self._end(self._perf())
        except Exception as exc:  # noqa: BLE001
            self._error(exc)

    def _begin(self, shape: Any, t_in: int) -> None:
        """Open a step: choose whether it is GPU-timed, record its start (host, and event)."""
        slot = None
        timed = False
        if self._pool is not None:
            kind = type(shape)
            if kind is StepShape:
                timed = self.sampler.take(shape[0])
            elif shape is None:
                timed = False
            elif shape[0] == "padded_rel":
                timed = self.sampler.take(1)  # a decode; resolved in order by the poller
            else:
                timed = True  # exact counts need a device readback: the step is timed anyway
            if timed:
                if self._capturing():  # a capture we were not told about: no CUDA call at all
                    self.captured += 1
                    self._open = None
                    return
                slot = self._pool.take()
                if slot is None:
                    self.gpu_unsampled += 1
                    timed = False
                    if kind is not StepShape and shape is not None and shape[0] != "padded_rel":
                        shape = _unresolved(shape)
                elif kind is not StepShape and shape is not None and shape[0] != "padded_rel":
                    shape = self._queue_readback(shape, slot)
                if slot is not None:
                    slot.start.record()
        mono = self._clock_ns()
        t0 = self._perf()
        self._open = (t0, mono, shape, slot, t0 - t_in, timed)

    def _end(self, t1: int) -> None:
        """Close the open step: its host time, its end event, its record; account the probe's cost."""
        opened = self._open
        if opened is None:
            return
        self._open = None
        t0, mono, shape, slot, pre_cost, timed = opened
        host_ms = (t1 - t0) / 1e6
        step_id = self.steps
        if slot is not None:
            slot.end.record()
            self._pending.append((mono, step_id, host_ms, shape, slot))
            phase = shape[0] if type(shape) is StepShape else (1 if shape[0] == "padded_rel" else 0)
        elif type(shape) is StepShape:
            phase = shape[0]
            self._push(Step(mono, step_id, self.rank, phase, shape[1], shape[2], shape[3], shape[4], host_ms, NAN))
        elif shape is None:
            phase = PHASE_IDLE
            self._push(Step(mono, step_id, self.rank, PHASE_IDLE, 0, 0, 0, 0, host_ms, NAN))
        else:  # a deferred decode (padded_rel): the poller resolves it after the prefill it follows
            phase = 1
            self._pending.append((mono, step_id, host_ms, shape, None))
        # counted once queued: an exit hook (SIGTERM) running between the two bytecodes ships the step anyway
        self.steps = step_id + 1
        last, self._last_mono = self._last_mono, mono
        self.sampler.account(phase, mono - last if last else 0, pre_cost + self._perf() - t1, timed)

    def _inspect(self, args: tuple, kwargs: dict) -> StepShape | tuple | None:
        """Token counts of this forward: a StepShape, or a deferred tuple resolved later.

        Deferred tuples that need a device readback carry the tensors to read
        ("padded": the mask, "packed": cu_seq_lens); nothing is launched here, so
        this is safe to call before knowing whether a capture is open.
        """
        cu_q = kwargs.get("cu_seq_lens_q")
        if cu_q is not None:
            cu_k = kwargs.get("cu_seq_lens_k")
            if isinstance(cu_k, dict):  # HF continuous batching: one per attention type
                cu_k = cu_k.get("full_attention", next(iter(cu_k.values()), None))
            if cu_q.device.type == "cpu":
                return classify_packed(cu_q.tolist(), cu_k.tolist() if cu_k is not None else None)
            if self._pool is not None and self.exact_tokens:
                return ("packed", int(cu_q.numel()), cu_k is not None, cu_q, cu_k)
            n = int(cu_q.numel()) - 1
            return StepShape(PHASE_IDLE, n, 0, 0, 0)  # counts unknown without a sync
        ids = _first_tensor(args, kwargs, "input_ids", "inputs_embeds")
        if ids is None or not hasattr(ids, "shape") or len(ids.shape) < 2:
            return None
        batch, new_len = int(ids.shape[0]), int(ids.shape[1])
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        cache_len = _cache_len(cache)
        mask = kwargs.get("attention_mask")
        if cache_len is None:
            cache_len = 0 if new_len > 1 else 1
        if mask is None or not hasattr(mask, "dim") or mask.dim() != 2:
            return classify_padded(batch, new_len, cache_len, None)
        if mask.device.type == "cpu":
            return classify_padded(batch, new_len, cache_len, int(mask.sum()))
        if self._pool is not None and self.exact_tokens:
            if new_len == 1 and cache_len > 0:
                # generate-style decode: the mask only grew by ones since the prefill,
                # so the poller derives the real count from the prefill's; no readback
                return ("padded_rel", batch, new_len, cache_len)
            return ("padded", batch, new_len, cache_len, mask)
        return classify_padded(batch, new_len, cache_len, None)

    def _queue_readback(self, shape: tuple, slot: Any) -> tuple | StepShape:
        """Launch the readback of a deferred shape into `slot` (not capturing); drop the tensors."""
        from .cuda_timing import queue_readback

        if shape[0] == "packed":
            _, n, has_k, cu_q, cu_k = shape
            if queue_readback(slot, [cu_q] if cu_k is None else [cu_q, cu_k]):
                return ("packed", n, has_k)
        else:
            _, batch, new_len, cache_len, mask = shape
            if queue_readback(slot, [mask.sum().reshape(1)]):
                return ("padded", batch, new_len, cache_len)
        return _unresolved(shape)

    # --- background threads -----------------------------------------------

    def _resolve(self, shape: Any, slot: Any) -> StepShape:
        if isinstance(shape, StepShape):
            return shape
        if shape is None:
            return StepShape(PHASE_IDLE, 0, 0, 0, 0)
        kind = shape[0]
        if kind == "padded_rel":
            _, batch, new_len, cache_len = shape
            base = self._last_prefill  # (batch, width, real tokens) of the last resolved prefill
            if base is None or base[0] != batch or cache_len < base[1]:
                return classify_padded(batch, new_len, cache_len, None)
            return classify_padded(batch, new_len, cache_len, base[2] + batch * (cache_len + new_len - base[1]))
        vals = slot.readback[: slot.n_read].tolist()
        if kind == "padded":
            _, batch, new_len, cache_len = shape
            real = int(vals[0])
            if cache_len == 0:
                self._last_prefill = (batch, new_len, real)
            return classify_padded(batch, new_len, cache_len, real)
        n = shape[1]
        return classify_packed(vals[:n], vals[n : 2 * n] if shape[2] else None)

    def _complete(self) -> None:
        """Turn finished timed steps (and deferred untimed ones behind them) into records, in order."""
        pending, pool, sampler = self._pending, self._pool, self.sampler
        try:
            while pending:
                slot = pending[0][4]
                t = self._perf()
                if slot is not None and not slot.end.query():
                    return
                mono, step_id, host_ms, shape, slot = pending.popleft()
                gpu_ms = slot.start.elapsed_time(slot.end) if slot is not None else NAN
                s = self._resolve(shape, slot)
                if slot is not None:
                    pool.give(slot)
                self._push(Step(mono, step_id, self.rank, s[0], s[1], s[2], s[3], s[4], host_ms, gpu_ms))
                if slot is not None:
                    sampler.account_poll(self._perf() - t)
        except Exception as exc:  # noqa: BLE001
            if pending:
                slot = pending.popleft()[4]
                if slot is not None:
                    pool.give(slot)
            self._error(exc)

    def _hello_frame(self) -> bytes:
        wall_minus_mono = time.time_ns() - self._clock_ns()
        hello = Hello(
            self._clock_ns(), wall_minus_mono, os.getpid(), self.rank, self.world_size,
            self.run_id, self.model_name.encode()[:48].decode("utf-8", "ignore"), self.runtime[:16],
        )
        now = self._clock_ns()
        return encode_frame([hello] + [RunLabel(now, k, v) for k, v in self.labels.items()])

    def _wake_loop(self) -> None:
        """The one background thread: a wake per interval does poll, sampler, health, encode, send, acks."""
        next_health = 0.0
        meter = self.cost
        last = (time.monotonic(), 0, 0, 0)  # (s, steps, records, timed) at the previous wake
        while True:
            stopping = self._stop.wait(self._interval_s)
            with self._bg_lock:
                meter.begin()
                now = time.monotonic()
                cur = (now, self.steps, self.records, self.sampler.timed_total)
                dt, d_steps = now - last[0], cur[1] - last[1]
                period_ns = dt * 1e9 / d_steps if d_steps > 0 and dt > 0 else None
                try:
                    self._poll_once()
                    meter.interval(self.sampler.hooks_ns())
                    self.sampler.update(meter.bg_cpu_ns)
                    if now >= next_health or stopping:
                        self._push(self.health())
                        next_health = now + 1.0
                    self._flush_once()
                except Exception as exc:  # noqa: BLE001
                    self._error(exc)
                meter.end(period_ns)
            self._interval_s = self._next_interval(dt, cur[2] - last[2], cur[3] - last[3])
            last = cur
            if stopping:
                if not self._pending or self._pool is None:
                    return
                time.sleep(self._poll_interval_s)  # close() waits for the device's last timings

    def _poll_once(self) -> None:
        """Complete finished CUDA timings, never while a capture is open."""
        guard = self._guard
        if guard is None or not self._pending:
            return
        with guard.lock:  # a capture cannot begin while we query; we do not query while one is open
            if not guard.depth:
                self._complete()

    def _next_interval(self, dt_s: float, d_records: int, d_timed: int) -> float:
        """`flush_interval_s`, shortened so that a quarter of the ring or of the event pool at most
        fills before the next wake at the last interval's rates; never below `poll_interval_s`."""
        iv = self.flush_interval_s
        if dt_s > 0:
            if d_records > 0:
                iv = min(iv, 0.25 * self._maxlen * dt_s / d_records)
            if d_timed > 0 and self._pool is not None:
                iv = min(iv, 0.25 * self._pool.size * dt_s / d_timed)
        return max(min(self._poll_interval_s, self.flush_interval_s), iv)

    def _flush_once(self) -> None:
        ring, sender = self._ring, self._sender
        if self._sink is not None:
            batch = []
            while ring:
                batch.append(ring.popleft())
            if batch:
                self._sink(batch)
            return
        while ring:
            if sender is None or not sender.ready():
                if sender is None:  # no transport: keep counting, never grow
                    n = len(ring)
                    ring.clear()
                    self.dropped += n
                return  # keep records in the ring until a sidecar appears
            pop = ring.popleft
            batch: list[Record] = [pop() for _ in range(min(len(ring), WAKE_CHUNK_RECORDS))]
            frame = encode_frame(batch)
            if sender.send(frame):
                self.frames_sent += 1
            else:
                self.dropped += len(batch)
                return
            if ring:
                time.sleep(0)  # let the GIL go: a host thread waiting for it runs before the next chunk

    def _error(self, exc: BaseException) -> None:
        self.errors += 1
        if not self._error_logged:
            self._error_logged = True
            log.warning("phasescope probe error (further errors are only counted): %r", exc)


class _StepScope:
    """The context manager `Probe.step()` returns (a class: cheaper than @contextmanager)."""

    __slots__ = ("probe", "args")

    def __init__(self, probe: Probe, args: tuple) -> None:
        self.probe, self.args = probe, args

    def __enter__(self) -> None:
        self.probe.begin_step(*self.args)

    def __exit__(self, *exc: object) -> None:
        self.probe.end_step()


def _unresolved(shape: tuple) -> StepShape:
    """A deferred shape whose readback could not be made: what the host knows."""
    if shape[0] == "packed":
        return StepShape(PHASE_IDLE, shape[1] - 1, 0, 0, 0)
    return classify_padded(shape[1], shape[2], shape[3], None)


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
