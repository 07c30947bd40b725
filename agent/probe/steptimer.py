"""Step timing: what the probe measures of every forward or runtime-timed step, into `Step` records.

Hot path (every forward): two hook calls that read tensor shapes, take `perf_counter_ns` readings and
hand one record to `_push` (the outbox's bounded ring). On CUDA, sampled steps also record two
pre-created events (see `sampling.py`: the rate keeps the probe's host cost under `gpu_budget` of the
step time); the poller (`_complete`, called by the outbox's background wake) completes them with
`Event.query()`, in order, and resolves token counts that needed a device readback. Runtimes that replay
CUDA graphs call no module: they time their step call with `step(...)` (or `begin_step`/`end_step`, or
`time_replays(graph, ...)`). During a CUDA-graph capture nothing is recorded and no CUDA call is made
(see `cuda_timing.py`). Every body is guarded: an exception goes to `_error`, never to the host.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

from ..records.events import PHASE_IDLE, Step
from .phases import StepShape, classify_packed, classify_padded, phase_of
from .sampling import BudgetSampler

NAN = float("nan")
_new = tuple.__new__


def _same_clock() -> bool:
    """Whether `time.perf_counter_ns` and `time.monotonic_ns` read the same clock here."""
    return time.get_clock_info("perf_counter").implementation == time.get_clock_info("monotonic").implementation


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


class StepTimer:
    """The probe's step timing (a base class of `Probe`: the hot path reads the probe's own attributes,
    no indirection). Uses the probe's `_push(record)` (must not block), `_error(exc)` (counts, never
    raises), `_restores`, `rank`, `_clock_ns` and `_perf`; `_pre_hook`/`_post_hook` are a module's
    forward hooks."""

    def _init_timer(self, device: Any, *, cuda_timing: bool, event_pool_size: int, poll_interval_s: float,
                    gpu_budget: float | None, gpu_min_rate: float, seed: int | None) -> None:
        """`device`: where the model runs (CUDA events time a CUDA device's steps when `cuda_timing`);
        `poll_interval_s`: the shortest background wake (s)."""
        self.gpu_unsampled = 0
        self.captured = 0  # forwards/steps seen while a CUDA graph was being captured (not recorded)
        self.steps = 0
        # the step in flight: (t0_ns, mono_ns, shape, slot, pre_cost_ns, timed)
        self._open: tuple | None = None
        self._in_step = False  # an explicit begin_step() owns the step: module hooks stand aside
        self._last_mono = 0  # start of the previous step (period accounting)
        # a runtime adapter that knows the batch exactly sets this just before the forward
        self.next_shape: StepShape | None = None
        self.sampler = BudgetSampler(gpu_budget, gpu_min_rate, seed)
        # one clock read stamps a host-timed step and starts its duration where the record clock and the duration
        # clock are the same one (CPython on Linux: both CLOCK_MONOTONIC); injected clocks keep two reads
        self._one_clock = (self._clock_ns is time.monotonic_ns and self._perf is time.perf_counter_ns
                           and _same_clock())
        self._device = device
        self._pool = None
        self._guard = None
        self._capturing: Callable[[], bool] | None = None
        self._pending: collections.deque = collections.deque()
        self._last_prefill: tuple[int, int, int] | None = None  # background thread only
        self._poll_interval_s = poll_interval_s
        if cuda_timing and device is not None and getattr(device, "type", "") == "cuda":
            from .cuda_timing import GUARD, EventPool, capturing

            self._pool = EventPool(device, event_pool_size)
            self._guard = GUARD
            self._capturing = capturing
            GUARD.acquire()

    # --- steps a runtime times itself -------------------------------------

    def begin_step(self, phase: int | None = None, num_seqs: int = 0, prefill_tokens: int = 0,
                   decode_tokens: int = 0, context_tokens: int = 0) -> None:
        """Open a step the runtime times itself (e.g. around a CUDA-graph replay). Never raises.

        Token counts are the real batch's (not a padded graph's); `phase` (events.PHASE_*)
        defaults to what the counts imply. Events, when this step is sampled, are recorded on
        the current stream here and in `end_step()`, outside any graph. Module hooks of a
        probed module called in between record nothing (the step is this one).
        """
        try:
            shape = StepShape(phase_of(prefill_tokens, decode_tokens) if phase is None else phase, num_seqs,
                              prefill_tokens, decode_tokens, context_tokens)
        except Exception as exc:  # noqa: BLE001
            self._error(exc)
            return
        self.begin_shape(shape)

    def begin_shape(self, shape: StepShape) -> None:
        """`begin_step` for a runtime adapter that holds the step's `StepShape` already (no re-pack: the vLLM
        worker's hot path). Never raises."""
        try:
            t_in = self._perf()
            if self._in_step:
                self._end(t_in)  # the previous step was never ended: close it here
            self._in_step = True
            if self._pool is None:  # host time only (no CUDA timing, so no capture guard): the step opens here
                self._open = (t_in, t_in if self._one_clock else self._clock_ns(), shape, None, 0, False)
                return
            guard = self._guard
            if guard is not None and guard.depth:
                self.captured += 1
                self._open = None
                return
            self._begin(shape, t_in)
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
            if getattr(graph, "replay", None) is replay:  # never graph.__dict__: it slows the host's loads (shadow.py)
                delattr(graph, "replay")

        self._restores.append(restore)
        return restore

    # --- hot path ---------------------------------------------------------

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
                    shape = _queue_readback(shape, slot)
                if slot is not None:
                    slot.start.record()
        if self._one_clock:
            mono = t0 = self._perf()
        else:
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
            # tuple.__new__: the record without the namedtuple's Python-level __new__ frame (~0.15 us a step)
            self._push(_new(Step, (mono, step_id, self.rank) + shape + (host_ms, NAN)))
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
        """Token counts of this forward (`inspect_forward`), deferred to a readback where CUDA events time it."""
        return inspect_forward(args, kwargs, self._pool is not None and self.exact_tokens)

    # --- the poller (called by the outbox's background wake) -----------------

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


def inspect_forward(args: tuple, kwargs: dict, readback: bool) -> StepShape | tuple | None:
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
        if readback:
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
    if readback:
        if new_len == 1 and cache_len > 0:
            # generate-style decode: the mask only grew by ones since the prefill,
            # so the poller derives the real count from the prefill's; no readback
            return ("padded_rel", batch, new_len, cache_len)
        return ("padded", batch, new_len, cache_len, mask)
    return classify_padded(batch, new_len, cache_len, None)


class _StepScope:
    """The context manager `Probe.step()` returns (a class: cheaper than @contextmanager)."""

    __slots__ = ("probe", "args")

    def __init__(self, probe: StepTimer, args: tuple) -> None:
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


def _queue_readback(shape: tuple, slot: Any) -> tuple | StepShape:
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
