"""The in-process probe: forward hooks -> step records -> bounded ring -> sidecar.

Hot path (every forward): two hook calls that read tensor shapes, take two
`perf_counter_ns` readings and append one tuple to a `collections.deque` with a
`maxlen` (drop-oldest; appends are atomic under the GIL, so no lock the host
could contend). On CUDA the hooks also record two pre-created events; a poller
thread completes them with `Event.query()`. A flush thread encodes the ring into
frames every `flush_interval_s` and sends them to the sidecar.

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
from typing import Any, Callable

from ..events import (
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
from .phases import StepShape, classify_packed, classify_padded
from ..address import Address, parse_address
from .sender import Sender

log = logging.getLogger("phasescope.probe")

NAN = float("nan")
# records per frame, so one frame always stays under MAX_FRAME_BYTES
_MAX_RECORD_BYTES = max(record_size(c) for c in (Hello, Step, RequestEvent, ProbeHealth)) + 32
FRAME_RECORDS = min(8192, MAX_FRAME_BYTES // _MAX_RECORD_BYTES)

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
        poll_interval_s: float = 0.002,
        exact_tokens: bool = True,
        connect: bool = True,
        sink: Callable[[list[Record]], None] | None = None,
        labels: dict[str, Any] | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if not hasattr(model, "register_forward_pre_hook"):
            raise TypeError(f"attach() needs a torch.nn.Module, got {type(model).__name__}")
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
        self.addr = agent if isinstance(agent, Address) else parse_address(agent)
        self.rank = rank
        self.world_size = world_size
        self.run_id = (run_id or uuid.uuid4().hex[:16])[:16]
        self.model_name = model_name or _model_name(model)
        self.runtime = runtime
        self.flush_interval_s = flush_interval_s
        self.exact_tokens = exact_tokens
        self._clock_ns = clock_ns
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
        self.steps = 0
        self._error_logged = False

        self._ring: collections.deque[Record] = collections.deque(maxlen=buffer_records)
        self._maxlen = buffer_records
        self._open: tuple | None = None  # the forward in flight: (t0_ns, mono_ns, shape, slot)
        # a runtime adapter that knows the batch exactly sets this just before the forward
        self.next_shape: StepShape | None = None

        self._device = _model_device(model)
        self._pool = None
        self._pending: collections.deque = collections.deque()
        self._last_prefill: tuple[int, int, int] | None = None  # poller thread only
        self._poll_interval_s = poll_interval_s
        if cuda_timing and self._device is not None and self._device.type == "cuda":
            from .cuda_timing import EventPool

            self._pool = EventPool(self._device, event_pool_size)

        self._stop = threading.Event()
        # `sink` (tests, benchmarks) receives record batches in place of a socket
        self._sink = sink
        self._sender = Sender(self.addr, self._hello_frame) if connect and sink is None else None
        self._threads: list[threading.Thread] = []
        self._handles = [
            model.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
            model.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True),
        ]
        self._threads.append(threading.Thread(target=self._flush_loop, name="phasescope-flush", daemon=True))
        if self._pool is not None:
            self._threads.append(threading.Thread(target=self._poll_loop, name="phasescope-poll", daemon=True))
        for t in self._threads:
            t.start()
        self._closed = False

    # --- public API -------------------------------------------------------

    def request_event(
        self, request_id: str, event: str, ts_ns: int | None = None, tokens: int = 0, cached_tokens: int = 0
    ) -> None:
        """Record one request lifecycle event (see events.REQUEST_EVENTS). Never raises."""
        try:
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
        self._push(record)

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
            self.dropped,
            self.errors,
            self.frames_sent,
            self._sender.failures if self._sender else 0,
            self.gpu_unsampled,
        )

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until queued records are handed to the socket (or dropped). True if drained."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._ring and not self._pending:
                return True
            time.sleep(0.005)
        return not self._ring and not self._pending

    def close(self, timeout_s: float = 5.0) -> None:
        """Remove the hooks, finish pending GPU timings, send what is left, stop threads."""
        if self._closed:
            return
        self._closed = True
        for h in self._handles:
            h.remove()
        self.flush(timeout_s)
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
        if self._sender is not None:
            self._sender.close()
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
            mono = self._clock_ns()
            slot = None
            if self._pool is not None:
                slot = self._pool.take()
                if slot is None:
                    self.gpu_unsampled += 1
            shape = self.next_shape
            if shape is None:
                shape = self._inspect(args, kwargs, slot)  # may queue a readback: before the timed region
            else:
                self.next_shape = None
            if slot is not None:
                slot.start.record()
            self._open = (time.perf_counter_ns(), mono, shape, slot)
        except Exception as exc:  # noqa: BLE001
            self._open = None
            self._error(exc)

    def _post_hook(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        try:
            t1 = time.perf_counter_ns()
            opened = self._open
            if opened is None:
                return
            self._open = None
            t0, mono, shape, slot = opened
            host_ms = (t1 - t0) / 1e6
            step_id = self.steps
            self.steps = step_id + 1
            if slot is None:
                if shape is None:
                    shape = StepShape(PHASE_IDLE, 0, 0, 0, 0)
                self._push(Step(mono, step_id, self.rank, shape[0], shape[1], shape[2], shape[3], shape[4], host_ms, NAN))
            else:
                slot.end.record()
                self._pending.append((mono, step_id, host_ms, shape, slot))
        except Exception as exc:  # noqa: BLE001
            self._error(exc)

    def _inspect(self, args: tuple, kwargs: dict, slot: Any) -> StepShape | tuple | None:
        """Token counts of this forward: a StepShape, or a deferred tuple resolved by the poller."""
        cu_q = kwargs.get("cu_seq_lens_q")
        if cu_q is not None:
            cu_k = kwargs.get("cu_seq_lens_k")
            if isinstance(cu_k, dict):  # HF continuous batching: one per attention type
                cu_k = cu_k.get("full_attention", next(iter(cu_k.values()), None))
            if cu_q.device.type == "cpu":
                return classify_packed(cu_q.tolist(), cu_k.tolist() if cu_k is not None else None)
            if slot is not None and self.exact_tokens:
                from .cuda_timing import queue_readback

                parts = [cu_q] if cu_k is None else [cu_q, cu_k]
                if queue_readback(slot, parts):
                    return ("packed", int(cu_q.numel()), cu_k is not None)
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
        if slot is not None and self.exact_tokens:
            if new_len == 1 and cache_len > 0:
                # generate-style decode: the mask only grew by ones since the prefill,
                # so the poller derives the real count from the prefill's; no readback
                return ("padded_rel", batch, new_len, cache_len)
            from .cuda_timing import queue_readback

            if queue_readback(slot, [mask.sum().reshape(1)]):
                return ("padded", batch, new_len, cache_len)
        return classify_padded(batch, new_len, cache_len, None)

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

    def _poll_loop(self) -> None:
        pending, pool = self._pending, self._pool
        while True:
            try:
                while pending and pending[0][4].end.query():
                    mono, step_id, host_ms, shape, slot = pending.popleft()
                    gpu_ms = slot.start.elapsed_time(slot.end)
                    s = self._resolve(shape, slot)
                    pool.give(slot)
                    self._push(Step(mono, step_id, self.rank, s[0], s[1], s[2], s[3], s[4], host_ms, gpu_ms))
            except Exception as exc:  # noqa: BLE001
                if pending:
                    _, _, _, _, slot = pending.popleft()
                    pool.give(slot)
                self._error(exc)
            if self._stop.is_set() and not pending:
                return
            time.sleep(self._poll_interval_s)

    def _hello_frame(self) -> bytes:
        wall_minus_mono = time.time_ns() - self._clock_ns()
        hello = Hello(
            self._clock_ns(), wall_minus_mono, os.getpid(), self.rank, self.world_size,
            self.run_id, self.model_name.encode()[:48].decode("utf-8", "ignore"), self.runtime[:16],
        )
        now = self._clock_ns()
        return encode_frame([hello] + [RunLabel(now, k, v) for k, v in self.labels.items()])

    def _flush_loop(self) -> None:
        next_health = 0.0
        while True:
            stopping = self._stop.wait(self.flush_interval_s)
            try:
                now = time.monotonic()
                if now >= next_health or stopping:
                    self._push(self.health())
                    next_health = now + 1.0
                self._flush_once()
            except Exception as exc:  # noqa: BLE001
                self._error(exc)
            if stopping:
                return

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
            batch: list[Record] = []
            while ring and len(batch) < FRAME_RECORDS:
                batch.append(ring.popleft())
            frame = encode_frame(batch)
            if sender.send(frame):
                self.frames_sent += 1
            else:
                self.dropped += len(batch)
                return

    def _error(self, exc: BaseException) -> None:
        self.errors += 1
        if not self._error_logged:
            self._error_logged = True
            log.warning("phasescope probe error (further errors are only counted): %r", exc)


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
