"""Worker process (one per TP rank; inside the EngineCore process at TP=1 on a GPU): one `Step` per engine step.

A step is `execute_model` + `sample_tokens`, timed by the worker's probe with `begin_step`/`end_step` around them:
host time always, CUDA events (sampled under the probe's budget, recorded outside any graph) on GPU, so steps that
replay full CUDA graphs are timed too. Token counts come from the SchedulerOutput, never from padded graph inputs.

Hot path (`execute_model` and `sample_tokens`, one frame each around vLLM's call; `StepShaper.shape` once per
step): O(1) Python besides the requests admitted or still prefilling in the step; a pure decode step takes the
shape from the SchedulerOutput's totals alone. The decode side is what is left of the step's total: every running
request that is neither new nor in a prompt (or a re-prefill after a preemption) computes decode positions. Context
tokens are the C-level sum of the cached requests' computed tokens (`sum()` over vLLM's list) plus the new ones'.
"""

from __future__ import annotations

from typing import Any

from ....records.events import PHASE_DECODE, PHASE_IDLE, PHASE_MIXED, PHASE_PREFILL
from ...phases import StepShape
from .common import WARMUP_PREFIX, channel, fail, hook
from .labels import _cpu_has_fp8_kv, _model_name, _ranks, block_size_rule, engine_side_labels


def split_tokens(start: int, n: int, num_prompt: int, num_tokens: int) -> tuple[int, int]:
    """(prefill, decode) tokens of one sequence computing positions [start, start+n).

    Positions before max(num_prompt, num_tokens-1) are prefill (the prompt, or a
    recomputation after preemption); the rest decode the latest token(s).
    """
    boundary = max(num_prompt, num_tokens - 1)
    pre = max(0, min(start + n, boundary) - start)
    return pre, n - pre


def step_shape(per_seq: list[tuple[int, int, int]]) -> StepShape:
    """StepShape from per-sequence (prefill, decode, context) token counts."""
    pre = dec = ctx = n_pre = n_dec = 0
    for p, d, c in per_seq:
        if p + d <= 0:
            continue
        pre += p
        dec += d
        ctx += c
        if p:
            n_pre += 1
        else:
            n_dec += 1
    return _shape(n_pre, n_dec, pre, dec, ctx)


def _shape(n_pre: int, n_dec: int, pre: int, dec: int, ctx: int) -> StepShape:
    phase = (PHASE_IDLE if n_pre + n_dec == 0 else PHASE_MIXED if n_pre and n_dec
             else PHASE_PREFILL if n_pre else PHASE_DECODE)
    return StepShape(phase, n_pre + n_dec, pre, dec, ctx)


_new = tuple.__new__


def _any_resumed(cr: Any) -> bool:
    """Whether a CachedRequestData resumes a preempted request (vLLM 0.32: a set of ids; 0.24: per-request flags)."""
    resumed = getattr(cr, "resumed_req_ids", None)
    if resumed is not None:
        return bool(resumed)
    return True in (getattr(cr, "resumed_from_preemption", None) or ())


def _config_context(cfg: Any) -> Any:
    """vLLM's `set_current_vllm_config(cfg)` where no config is current (the worker's hooks are installed outside
    vLLM's own context, where 0.24's attention backends read theirs); a no-op context otherwise or where this vLLM
    has none."""
    import contextlib

    try:
        from vllm.config import get_current_vllm_config_or_none, set_current_vllm_config
    except ImportError:
        return contextlib.nullcontext()
    if get_current_vllm_config_or_none() is not None:
        return contextlib.nullcontext()
    return set_current_vllm_config(cfg)


class StepShaper:
    """Token counts of SchedulerOutputs, identical on every rank, in O(requests admitted or prefilling)."""

    def __init__(self) -> None:
        self.prompt_len: dict[str, int] = {}  # running requests' prompt lengths
        self.prefilling: dict[str, tuple[int, int]] = {}  # request -> (next position, prefill boundary)

    def shape(self, so: Any) -> StepShape:
        nst = so.num_scheduled_tokens
        prompt_len, prefilling = self.prompt_len, self.prefilling
        finished = so.finished_req_ids
        if finished:
            for rid in finished:
                prompt_len.pop(rid, None)
                prefilling.pop(rid, None)
        preempted = getattr(so, "preempted_req_ids", None)
        if preempted:
            for rid in preempted:
                prefilling.pop(rid, None)
        cr = so.scheduled_cached_reqs
        new = so.scheduled_new_reqs
        if not new and not prefilling and not _any_resumed(cr):
            # a pure decode step: every scheduled request decodes (tuple.__new__: no namedtuple __new__ frame)
            n = len(nst)
            return _new(StepShape, (PHASE_DECODE if n else PHASE_IDLE, n, 0, int(so.total_num_scheduled_tokens),
                                    sum(cr.num_computed_tokens)))
        pre = n_pre = ctx = 0
        new_ids = []
        for nr in new:
            plen = len(nr.prompt_token_ids) if nr.prompt_token_ids is not None else int(nr.num_computed_tokens)
            rid = nr.req_id
            new_ids.append(rid)
            prompt_len[rid] = plen
            start, n = int(nr.num_computed_tokens), int(nst.get(rid, 0))
            ctx += start
            p = self._advance(rid, start, n, plen)
            pre += p
            n_pre += p > 0
        computed = cr.num_computed_tokens
        ctx += sum(computed)  # C-level: the cached requests' starts
        resumed = getattr(cr, "resumed_req_ids", None)  # vLLM 0.32: a set; 0.24: resumed_from_preemption flags
        if resumed is None:
            flags = getattr(cr, "resumed_from_preemption", None) or ()
            resumed = [cr.req_ids[i] for i, f in enumerate(flags) if f] if True in flags else ()
        for rid in resumed:  # a re-prefill of what the preemption dropped, then decode (split_tokens' boundary)
            i = cr.req_ids.index(rid)
            plen = prompt_len.get(rid, 0)
            prefilling[rid] = (int(computed[i]), max(plen, plen + int(cr.num_output_tokens[i]) - 1))
        for rid, (start, boundary) in list(prefilling.items()) if prefilling else ():
            n = nst.get(rid)
            if n is None or rid in new_ids:  # not scheduled in this step, or counted above
                continue
            p = self._advance(rid, start, n, boundary)
            pre += p
            n_pre += p > 0
        return _shape(n_pre, len(nst) - n_pre, pre, int(so.total_num_scheduled_tokens) - pre, ctx)

    def _advance(self, rid: str, start: int, n: int, boundary: int) -> int:
        """Prefill tokens of positions [start, start+n) before `boundary`; keeps the request in `prefilling`
        while positions before the boundary remain."""
        if start + n < boundary:
            self.prefilling[rid] = (start + n, boundary)
        else:
            self.prefilling.pop(rid, None)
        return max(0, min(start + n, boundary) - start)


class WorkerHooks:
    """Instance wrappers on one vLLM `Worker` (one TP rank): one Step per engine step."""

    def __init__(self, worker: Any) -> None:
        cfg = worker.vllm_config
        tp, pp, dp_rank = _ranks(cfg)
        self.rank = dp_rank * tp * pp + int(getattr(worker, "rank", 0) or 0) % (tp * pp)
        labels = engine_side_labels(cfg)
        device = None
        try:
            import torch

            dev = getattr(worker, "device", None)
            if getattr(dev, "type", "") == "cuda" and torch.cuda.is_available():
                device = dev
        except Exception as exc:  # noqa: BLE001 - no CUDA timing, host time only
            fail("cuda_events", exc)
        self.probe = channel("worker", self.rank, tp * pp * max(1, int(labels.get("dp", "1"))),
                             _model_name(cfg), labels, device=device)
        self.shaper = StepShaper()
        self._open = False  # a step is open (begin_step called, end_step not yet)
        self._label_weights(worker, tp * pp)
        self._label_backend(cfg)
        self._warmup = True  # vLLM's kernel warm-up batches come before the first real step only
        self._install(worker)

    @property
    def step_id(self) -> int:
        """Steps this worker has recorded (the engine's step ids: identical on every rank)."""
        return self.probe.steps

    def shape(self, so: Any) -> StepShape:
        """Token counts of one SchedulerOutput (identical on every rank)."""
        return self.shaper.shape(so)

    def _label_weights(self, worker: Any, ranks: int) -> None:
        """Weight bytes/params (whole model at one rank; per rank otherwise) and the GPU's name."""
        try:
            params = list(worker.model_runner.get_model().parameters())
            n = sum(p.numel() for p in params)
            nbytes = sum(p.numel() * p.element_size() for p in params)
            if ranks == 1:
                self.probe.label(model_params=n, weight_bytes=nbytes)
            else:
                self.probe.label(weight_bytes_per_rank=nbytes)
            dev = params[0].device if params else None
            if dev is not None and dev.type == "cuda":
                import torch

                props = torch.cuda.get_device_properties(dev)
                self.probe.label(gpu_name=props.name, gpu_mem_bytes=props.total_memory)
        except Exception as exc:  # noqa: BLE001 - labels are optional
            fail("model_weights", exc)

    def _label_backend(self, cfg: Any) -> None:
        """The attention backend's limits, read from the runtime (what the analyzers' advice must respect):
        `vllm_attention_backend`, `vllm_block_sizes` (block_size_rule) and `vllm_kv_cache_dtypes`."""
        try:
            layers = cfg.compilation_config.static_forward_context.values()
            backend = next(b for b in (getattr(x, "attn_backend", None) for x in layers) if b is not None)
            dtypes = [str(d) for d in getattr(backend, "supported_kv_cache_dtypes", ())]
            if backend.get_name() == "CPU_ATTN" and not _cpu_has_fp8_kv():
                dtypes = [d for d in dtypes if not d.startswith("fp8")]
            with _config_context(cfg):  # vLLM 0.24's FlashAttention reads its block sizes from the current config
                sizes = backend.get_supported_kernel_block_sizes()
            self.probe.label(vllm_attention_backend=backend.get_name(), vllm_block_sizes=block_size_rule(sizes),
                             vllm_kv_cache_dtypes=",".join(dtypes)[:96])
        except Exception as exc:  # noqa: BLE001 - labels are optional: the analyzers fall back to their table
            fail("attention_backend", exc)

    def _install(self, worker: Any) -> None:
        """Instance wrappers on `execute_model` (opens the step) and `sample_tokens` (closes it), written out
        rather than through `common.wrap`: the only hooks on every step of the worker, so one Python frame
        each around vLLM's call, no before/after dispatch. A method this vLLM lacks: counted, not hooked."""
        try:
            execute, sample = worker.execute_model, worker.sample_tokens
        except AttributeError as exc:
            fail("execute_model/sample_tokens", exc)
            return
        probe, shape, begin_shape = self.probe, self.shaper.shape, self.probe.begin_shape

        def execute_model(*a: Any, **k: Any) -> Any:  # any call form vLLM uses goes through unchanged
            try:  # `_begin` written out: the every-step path keeps one frame of ours around vLLM's call
                so = a[0] if a else k["scheduler_output"]
                if self._open:  # the last step's sample_tokens never came
                    self._open = False
                    probe.end_step()
                if so.total_num_scheduled_tokens > 0 and not (self._warmup and self._warming(so)):
                    begin_shape(shape(so))
                    self._open = True
            except Exception as exc:  # noqa: BLE001 - never into vLLM
                probe._error(exc)
            result = execute(*a, **k)
            if result is not None and self._open:  # no sample_tokens half for this step
                self._open = False
                probe.end_step()
            return result

        def sample_tokens(*a: Any, **k: Any) -> Any:
            result = sample(*a, **k)
            if self._open:
                self._open = False
                probe.end_step()  # never raises
            return result

        execute_model.__wrapped__ = execute  # type: ignore[attr-defined]
        sample_tokens.__wrapped__ = sample  # type: ignore[attr-defined]
        hook(worker, "execute_model", execute_model, "worker")
        hook(worker, "sample_tokens", sample_tokens, "worker")

    def _warming(self, so: Any) -> bool:
        """Whether `so` is vLLM's own kernel warm-up at start (model runner V2), not an engine step; the first
        real step ends the warm-up."""
        if str(next(iter(so.num_scheduled_tokens), "")).startswith(WARMUP_PREFIX):
            return True
        self._warmup = False
        return False
