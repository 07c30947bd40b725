"""vLLM V1 adapter: records from vLLM's scheduler, block pool and workers (vllm 0.32; 0.24 on GPU).

Where each figure comes from (see docs: vLLM section of the README):

- EngineCore process (`Scheduler` instance): request lifecycle (`add_request`,
  `schedule`, `update_from_output`, `_preempt_request`, `finish_requests`), prefix
  lookups (`kv_cache_manager.record_prefix_cache_stats`; on vLLM 0.24, which has no
  such method, `get_computed_blocks`: resumed-after-preemption
  lookups kept apart, exactly as vLLM's `/metrics` counts), KV snapshots from the
  block pool after every step (cost O(used pages): gaps between used ids, never a
  free-list walk), page churn (`get_new_blocks`, `touch`, `free_blocks`) and
  evictions (`_maybe_evict_cached_block`); one `PrefixLookup` per lookup, from
  vLLM's own per-request block hashes against a bounded table of earlier
  prompts' (evictions mark the hashes they drop); `PageEvent`s of one block id
  in `PHASESCOPE_PAGE_SAMPLE_EVERY` (allocated by `get_new_blocks`, cached when
  freed with a hash, reused by `touch`, evicted, freed unhashed).
- Worker process, one per TP rank (`Worker` instance): one `Step` per engine step
  timed around `execute_model` + `sample_tokens` (host time; on CUDA also events
  recorded on the current stream and completed by a poller thread, which also
  covers steps that replay full CUDA graphs); token counts from the
  `SchedulerOutput` every rank receives.

Everything is wrapped on instances; the classes are touched only to catch their
first instance and are put back at once. Every wrapper is guarded: an exception
is counted as a probe error, logged once, and vLLM runs on untouched.
Imports nothing from vLLM at module import; `install()` does.
"""

from __future__ import annotations

import atexit
import collections
import functools
import logging
import math
import os
import threading
import time
import uuid
from typing import Any, Callable

from ...records.events import (
    PHASE_DECODE, PHASE_IDLE, PHASE_MIXED, PHASE_PREFILL, PrefixCounters, PrefixLookup, RequestEvent, ServerMetric,
    Step, REQ_ABORTED, REQ_ARRIVAL, REQ_CANCELLED, REQ_FINISHED, REQ_QUEUED, REQ_PREEMPTED, REQ_SCHEDULED, REQ_TOKEN,
    VLLM_OUTPUT_ITERATIONS, MAX_TOKENS, short_id,
)
from ...records.kvmath import PageStats, largest_gap
from ...settings import ENV_RUN_ID, ProbeSettings, from_env
from ..pagetrack import PageLife, PrefixTable
from ..phases import StepShape
from ..probe import Probe
from .base import kv_record, observe

log = logging.getLogger("phasescope.vllm")

ENV_TOKENS_AT = "PHASESCOPE_VLLM_TOKENS_AT"  # "frontend": the frontend records token/finish events
ENV_KV_EVERY = "PHASESCOPE_VLLM_KV_EVERY"  # take a KV snapshot every N engine steps (default 1)
ENV_PREFIX_TABLE = "PHASESCOPE_PREFIX_TABLE_PAGES"  # cap of the table of earlier prompts' block hashes (0: off)
ENV_PAGE_SAMPLE = "PHASESCOPE_PAGE_SAMPLE_EVERY"  # follow one KV page id in N (0: no PageEvents; default ~1024 pages)
# the cached-page count is kept by the block-pool wrappers; every N snapshots it is recounted from the hash map
# (O(cached pages): ~1 ms at 20k pages, which per step cost a host-bound H200 decode a third of its throughput)
CACHED_RECOUNT_EVERY = 512
RUNTIME = "vllm"
WARMUP_PREFIX = "_warmup_"  # request ids of vLLM's kernel warm-up batches (0.24: v1/worker/gpu/warmup.py)
NAN = float("nan")

_STATE_LOCK = threading.Lock()
_CHANNELS: dict[str, Probe] = {}  # role -> this process's record channel
_FAILURES = collections.Counter()  # install-time failures by hook name (internals that moved)


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


def channel(role: str, rank: int, world_size: int, model: str, labels: dict[str, str], device: Any = None) -> Probe:
    """This process's probe for `role` ("engine", "worker", "frontend"), made once.

    A worker's probe on a CUDA `device` times the steps it is handed (`begin_step`/`end_step`)
    with sampled CUDA events, capture-safe (see probe.cuda_timing).
    """
    with _STATE_LOCK:
        p = _CHANNELS.get(role)
        if p is None:
            cuda = getattr(device, "type", "") == "cuda"
            p = Probe(_NoModule(), rank=rank, world_size=max(world_size, rank + 1), run_id=run_id(),
                      model_name=model, runtime=f"{RUNTIME}-{role}"[:16], cuda_timing=cuda,
                      device=device if cuda else None, labels=labels, **_env_timing())
            if not _CHANNELS:
                atexit.register(close_channels)
            _CHANNELS[role] = p
            if _FAILURES:
                p.label(adapter_missing=",".join(sorted(_FAILURES))[:96])
        return p


_TIMING_OPTIONS = ("flush_interval_s", "poll_interval_s", "buffer_records", "event_pool_size", "gpu_budget",
                   "gpu_min_rate")


def _env_timing() -> dict[str, Any]:
    """The probe's timing options set by PHASESCOPE_* variables (ProbeSettings); a bad value: the defaults."""
    try:
        opts = from_env(os.environ, ProbeSettings)
    except ValueError as exc:  # the user's variable, not vLLM's internals: say so, run on the defaults
        log.warning("phasescope: %s; the vLLM probes use the default timing options", exc)
        return {}
    return {k: v for k, v in opts.items() if k in _TIMING_OPTIONS}


def close_channels(timeout_s: float = 1.0) -> None:
    """Send what is buffered and stop (at exit: vLLM ends its processes on SIGTERM -> SystemExit)."""
    for p in list(_CHANNELS.values()):
        try:
            p.close(timeout_s)
        except Exception:  # noqa: BLE001
            pass


_FORKED = False  # this process is a forked child of a process that had armed the plugin


def reset_after_fork() -> None:
    """In a forked child the parent's flush threads are gone: forget its channels."""
    global _FORKED
    _FORKED = True
    _CHANNELS.clear()


def failures() -> dict[str, int]:
    """Hooks that could not be installed on this vLLM version (name -> count)."""
    return dict(_FAILURES)


def _fail(what: str, exc: BaseException) -> None:
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


def wrap(obj: Any, name: str, after: Callable[..., Any], probe_ref: Callable[[], Probe | None],
         before: Callable[..., Any] | None = None) -> bool:
    """Replace the bound method `obj.name` by a guarded wrapper on the instance (`base.observe`).

    `before(*args, **kw)` may return replacement args (a tuple) or None;
    `after(result, *args, **kw)` observes. Neither can raise into vLLM.
    """
    try:
        original = getattr(obj, name)
    except AttributeError as exc:
        _fail(name, exc)
        return False
    setattr(obj, name, observe(original, after, lambda exc: _err(probe_ref, exc), before))
    return True


def _err(probe_ref: Callable[[], Probe | None], exc: BaseException) -> None:
    p = probe_ref()
    if p is not None:
        p._error(exc)
    else:
        _fail("hook", exc)


# --- run labels -------------------------------------------------------------

# run label -> (the VllmConfig part it is read from, its attribute); "hf": the model's HF text config
CONFIG_LABELS: dict[str, tuple[str, str]] = {
    "model_layers": ("hf", "num_hidden_layers"),
    "model_heads": ("hf", "num_attention_heads"),
    "model_kv_heads": ("hf", "num_key_value_heads"),  # else model_heads
    "model_head_dim": ("hf", "head_dim"),  # else hidden // heads
    "model_hidden": ("hf", "hidden_size"),
    "model_intermediate": ("hf", "intermediate_size"),
    "model_vocab": ("hf", "vocab_size"),
    "model_dtype": ("model_config", "dtype"),  # torch.float16 -> float16
    "max_model_len": ("model_config", "max_model_len"),
    "enforce_eager": ("model_config", "enforce_eager"),
    "max_num_batched_tokens": ("scheduler_config", "max_num_batched_tokens"),
    "max_num_seqs": ("scheduler_config", "max_num_seqs"),
    "enable_chunked_prefill": ("scheduler_config", "enable_chunked_prefill"),
    "async_scheduling": ("scheduler_config", "async_scheduling"),
    "block_size": ("cache_config", "block_size"),
    "page_size": ("cache_config", "block_size"),
    "enable_prefix_caching": ("cache_config", "enable_prefix_caching"),
    "kv_cache_dtype": ("cache_config", "cache_dtype"),
    "gpu_memory_utilization": ("cache_config", "gpu_memory_utilization"),
    "num_gpu_blocks": ("cache_config", "num_gpu_blocks"),
    "tp": ("parallel_config", "tensor_parallel_size"),
    "pp": ("parallel_config", "pipeline_parallel_size"),
    "dp": ("parallel_config", "data_parallel_size"),
}


def config_labels(vllm_config: Any) -> dict[str, str]:
    """Run labels from a `VllmConfig`: model geometry and the vLLM flags the analyzers name (CONFIG_LABELS);
    a label whose part or attribute is missing, None or empty is left out."""
    out: dict[str, str] = {"runtime": RUNTIME}
    try:
        import vllm

        out["vllm_version"] = str(vllm.__version__)
    except Exception:  # noqa: BLE001
        pass
    parts = {part: getattr(vllm_config, part, None)
             for part in ("model_config", "scheduler_config", "cache_config", "parallel_config")}
    mc = parts["model_config"]
    parts["hf"] = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    fields = {label: getattr(parts[part], attr, None) for label, (part, attr) in CONFIG_LABELS.items()}
    heads, hidden = fields["model_heads"], fields["model_hidden"]
    fields["model_kv_heads"] = fields["model_kv_heads"] or heads
    fields["model_head_dim"] = fields["model_head_dim"] or (hidden // heads if hidden and heads else None)
    if mc is not None:  # str() of a torch dtype, without its module
        fields["model_dtype"] = str(getattr(mc, "dtype", "")).replace("torch.", "") or None
    for k, v in fields.items():
        if v is not None and v != "":
            out[k] = str(v)[:96]
    return out


def engine_side_labels(vllm_config: Any) -> dict[str, str]:
    """`config_labels` of an EngineCore or worker process: without `dp` unless the model is MoE. vLLM runs a
    dense model's DP engines as independent DP=1 engines (vllm/v1/engine/core.py calls
    `ParallelConfig.reconfigure_for_independent_dp_rank` before it builds the engine), so their config says
    data_parallel_size 1 whatever the server's; the API server's stat logger labels the run's true `dp`
    (vllm_plugin.StatLogger), which the DP skew reads as the engines to expect (agent/read/dp.py)."""
    labels = config_labels(vllm_config)
    try:
        moe = bool(getattr(getattr(vllm_config, "model_config", None), "is_moe", False))
    except Exception:  # noqa: BLE001 - a model config that cannot say: not MoE
        moe = False
    if not moe:
        labels.pop("dp", None)
    return labels


def _model_name(vllm_config: Any) -> str:
    mc = getattr(vllm_config, "model_config", None)
    return str(getattr(mc, "served_model_name", None) or getattr(mc, "model", "") or "vllm")


def _ranks(vllm_config: Any) -> tuple[int, int, int]:
    """(tp_size, pp_size, dp_rank) of this engine."""
    pc = getattr(vllm_config, "parallel_config", None)
    # an independent (non-MoE) DP engine is reconfigured as DP=1; data_parallel_index keeps its index
    index = getattr(pc, "data_parallel_index", None)
    if index is None:
        index = getattr(pc, "data_parallel_rank", 0)
    return (int(getattr(pc, "tensor_parallel_size", 1) or 1), int(getattr(pc, "pipeline_parallel_size", 1) or 1),
            int(index or 0))


def _cpu_has_fp8_kv() -> bool:
    """vLLM's CPU attention takes an fp8 KV cache only on x86 with AVX-512 or AMX (cpu_attn `_get_attn_isa`:
    "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"); the same two checks."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_supported())


def block_size_rule(supported: Any) -> str:
    """vLLM's `get_supported_kernel_block_sizes()` as a label: [MultipleOf(32)] -> "m32", [16, 32] -> "16,32"."""
    parts = [f"m{int(s.base)}" if hasattr(s, "base") else str(int(s)) for s in supported]
    multiples = [p for p in parts if p.startswith("m")]
    return multiples[0] if multiples else ",".join(parts)


# --- step shape (pure) --------------------------------------------------------

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
    phase = (PHASE_IDLE if n_pre + n_dec == 0 else PHASE_MIXED if n_pre and n_dec
             else PHASE_PREFILL if n_pre else PHASE_DECODE)
    return StepShape(phase, n_pre + n_dec, pre, dec, ctx)


# --- EngineCore: scheduler, block pool, prefix cache ----------------------------

class EngineHooks:
    """Instance wrappers on one `Scheduler` (EngineCore process)."""

    def __init__(self, scheduler: Any) -> None:
        cfg = scheduler.vllm_config
        self.tp, pp, self.dp_rank = _ranks(cfg)
        self.rank0 = self.dp_rank * self.tp * pp
        labels = engine_side_labels(cfg)
        labels["kv_imbalance_tp"] = "0 by construction (TP ranks share block ids)"
        labels["engine_process_start"] = "fork" if _FORKED else "spawn"
        self.probe = channel("engine", self.rank0, self.tp * pp * max(1, int(labels.get("dp", "1"))),
                             _model_name(cfg), labels)
        self.sched = scheduler
        self.kv_every = max(1, int(os.environ.get(ENV_KV_EVERY, "1") or 1))
        self.steps = 0
        # issue 27 item 6: iterations that produced output, as vLLM counts them (`vllm:iteration_tokens_total`
        # observes one per EngineCoreOutputs batch holding outputs): a chunk-only prefill step produces none
        self.output_iterations = 0
        self.seen: set[str] = set()  # requests scheduled at least once
        self.out_tokens: dict[str, int] = {}
        self.tokens_at_frontend = os.environ.get(ENV_TOKENS_AT) == "frontend"
        # prefix ledger: lookups by fresh requests (what /metrics counts) and by resumed ones, apart
        self.queried = self.hits = self.resumed_queried = self.resumed_hits = 0
        self.recomputed = self.evicted = 0
        self.lost: dict[str, int] = {}  # request id -> KV tokens its last preemption dropped
        self.allocated = self.freed = 0
        self.cached = 0  # hashed pages no request references, kept by the pool wrappers (see snapshot)
        self.cached_recounts_off = 0  # recounts that found the kept count off (then the recount wins)
        self._evicting_idle = False
        self.snapshot_ns_total = 0
        self.snapshots = 0
        # issue 13: per-lookup miss facts against a bounded table of earlier prompts' block hashes (vLLM's own,
        # `request.block_hashes`, computed at arrival: nothing is hashed here)
        self.table: PrefixTable | None = None
        self.life: PageLife | None = None  # sampled page lifecycles (PageEvent)
        self.caching = True
        self._last_prefix: tuple | None = None
        self.pool = None
        self.page_size = 0
        self.page_bytes = 0
        self.kv_dtype = ""
        ref = lambda: self.probe  # noqa: E731
        wrap(scheduler, "add_request", self._after_add, ref)
        wrap(scheduler, "schedule", self._after_schedule, ref)
        wrap(scheduler, "update_from_output", self._after_update, ref)
        wrap(scheduler, "_preempt_request", lambda r, *a, **k: None, ref, before=self._before_preempt)
        wrap(scheduler, "finish_requests", self._after_finish_requests, ref)
        kvm = getattr(scheduler, "kv_cache_manager", None)
        if kvm is None:
            _fail("kv_cache_manager", AttributeError("kv_cache_manager"))
            return
        if hasattr(kvm, "record_prefix_cache_stats"):  # vLLM 0.32: one call per lookup
            wrap(kvm, "record_prefix_cache_stats", self._after_prefix, ref)
        else:  # vLLM 0.24: get_computed_blocks does the lookup, records vLLM's stats, returns the hit tokens
            wrap(kvm, "get_computed_blocks", self._after_computed_blocks, ref)
        try:
            self.pool = kvm.block_pool
            self.page_size = int(kvm.coordinator.single_type_managers[0].block_size)
            group = scheduler.kv_cache_config.kv_cache_groups[0]
            self.page_bytes = int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
            self.kv_dtype = str(getattr(group.kv_cache_spec, "dtype", "")).replace("torch.", "")
        except Exception as exc:  # noqa: BLE001
            _fail("block_pool", exc)
            self.pool = None
            return
        self.probe.label(kv_page_bytes_per_rank=self.page_bytes, kv_total_pages=self.pool.num_gpu_blocks - 1,
                         kv_dtype=self.kv_dtype)
        self.caching = bool(getattr(kvm, "enable_caching", True))
        cap = int(os.environ.get(ENV_PREFIX_TABLE, "16384") or 0)
        if cap > 0 and self.page_size > 0:
            self.table = PrefixTable(self.page_size, lambda parent, tokens: 0, cap)  # chains come from vLLM
        every = os.environ.get(ENV_PAGE_SAMPLE, "")
        every = int(every) if every.strip() else max(1, -(-(self.pool.num_gpu_blocks - 1) // 1024))
        if every > 0:
            self.life = PageLife(self.probe.emit, self.rank0, every)
        wrap(self.pool, "get_new_blocks", self._after_new_blocks, ref)
        wrap(self.pool, "touch", lambda r, *a, **k: None, ref, before=self._before_touch)
        wrap(self.pool, "free_blocks", self._after_free, ref, before=self._before_free)
        wrap(self.pool, "_maybe_evict_cached_block", self._after_evict, ref, before=self._before_evict)
        self.cached = self._cached_pages()

    # lifecycle
    def _mono_of_wall(self, wall_s: float) -> int:
        return mono_of_wall(wall_s)

    def _event(self, ts: int, event: int, rid: str, tokens: int = 0, cached: int = 0) -> None:
        self.probe.emit(RequestEvent(ts, self.rank0, event, short_id(rid), tokens, cached))

    def _after_add(self, _res: Any, request: Any, *a: Any, **k: Any) -> None:
        rid = request.request_id
        if rid in self.out_tokens:  # a streaming-input update of a known request
            return
        self.out_tokens[rid] = 0
        arrival = getattr(request, "arrival_time", None)
        ts = self._mono_of_wall(arrival) if arrival else time.monotonic_ns()
        self._event(ts, REQ_ARRIVAL, rid, int(request.num_prompt_tokens))
        # vLLM's queue starts here, at the engine's QUEUED event (its own timestamp when it records events)
        self._event(_core_event_ns(request, "QUEUED") or time.monotonic_ns(), REQ_QUEUED, rid)

    def _after_schedule(self, so: Any, *a: Any, **k: Any) -> None:
        now = time.monotonic_ns()
        reqs = self.sched.requests
        for nr in so.scheduled_new_reqs:
            rid = nr.req_id
            if rid not in self.seen:
                self.seen.add(rid)
                req = reqs.get(rid)
                cached = getattr(req, "num_cached_tokens", -1) if req is not None else -1
                if cached is None or cached < 0:
                    cached = int(nr.num_computed_tokens)
                # vLLM's SCHEDULED timestamp where it records one: its queue and prefill times end/start there
                self._event(_core_event_ns(req, "SCHEDULED") or now, REQ_SCHEDULED, rid, 0, int(cached))
                if not self.caching and self.table is not None and req is not None \
                        and not getattr(req, "num_preemptions", 0):
                    n = int(req.num_prompt_tokens)
                    self.probe.emit(PrefixLookup(now, self.rank0, short_id(rid), "disabled", self.page_size, n, 0, 0,
                                                 0, 0, math.nan, 0, 0))

    def _after_update(self, outputs: Any, so: Any, *a: Any, **k: Any) -> None:
        now = time.monotonic_ns()
        produced = sum(1 for eco in (outputs or {}).values() if getattr(eco, "outputs", None))
        if produced:
            self.output_iterations += produced
            self.probe.emit(ServerMetric(now, self.dp_rank, VLLM_OUTPUT_ITERATIONS, "", float(self.output_iterations)))
        # token and finish times are the frontend's when it records them (vLLM's TTFT/E2E are measured there)
        for eco in (() if self.tokens_at_frontend else (outputs or {}).values()):
            for o in getattr(eco, "outputs", ()) or ():
                rid = o.request_id
                n = len(o.new_token_ids or ())
                if n:
                    self.out_tokens[rid] = self.out_tokens.get(rid, 0) + n
                    self._event(now, REQ_TOKEN, rid, n)
                if o.finish_reason is not None:
                    self._finished(now, rid, aborted=_is_abort(o.finish_reason))
        if getattr(so, "total_num_scheduled_tokens", 0) > 0:
            self.steps += 1
            if self.pool is not None and self.steps % self.kv_every == 0:
                self.snapshot(now)
        self._emit_prefix(now)

    def _finished(self, ts: int, rid: str, aborted: bool, cancelled: bool = False) -> None:
        if rid not in self.out_tokens:
            return
        n = self.out_tokens.pop(rid)
        self.seen.discard(rid)
        self._event(ts, REQ_CANCELLED if cancelled else REQ_ABORTED if aborted else REQ_FINISHED, rid, n)

    def _before_preempt(self, request: Any, *a: Any, **k: Any) -> None:
        # num_computed_tokens is reset inside: what it holds now is the KV this preemption loses
        lost = int(request.num_computed_tokens)
        self.lost[request.request_id] = lost
        self._event(time.monotonic_ns(), REQ_PREEMPTED, request.request_id, lost)

    def _after_finish_requests(self, aborted: Any, *a: Any, **k: Any) -> None:
        """`finish_requests(ids, status)`: named requests ended FINISHED_ABORTED are the client's cancels
        (`EngineCore.abort_requests`, a hang-up or an abort call); all requests at once (ids None: shutdown,
        pause) or any other status (FINISHED_ERROR) are the server's: failures."""
        now = time.monotonic_ns()
        ids = a[0] if a else k.get("request_ids")
        status = a[1] if len(a) > 1 else k.get("finished_status")
        cancelled = ids is not None and "ABORTED" in str(status).upper()
        for req in aborted or ():
            self._finished(now, req.request_id, aborted=True, cancelled=cancelled)

    # prefix cache
    def _after_prefix(self, _res: Any, request: Any, num_hits: int, *a: Any, **k: Any) -> None:
        kvm = self.sched.kv_cache_manager
        enabled = getattr(kvm, "prefix_cache_lookup_enabled", None)
        if callable(enabled) and not enabled(request):
            return
        q, h = int(request.num_tokens), int(num_hits)
        resumed = getattr(request, "num_preemptions", 0) > 0
        # recomputed (README Definitions): positions whose KV the preemption dropped (vLLM's num_computed_tokens
        # then: after a decode, 1 short of num_tokens, as the latest sampled token was never computed) and the
        # cache did not give back, counted at the first lookup after the preemption (vLLM 0.24 looks a waiting
        # request up again every step until its pages fit; each of those lookups is still one for vLLM's
        # counters and for ours). The lookup record carries the same figure (`readmission` of the miss split).
        lost = self.lost.pop(request.request_id, None) if resumed else None
        dropped = min(q, lost) if lost is not None else 0
        if self.table is not None:
            self._lookup(request, q, h, dropped)
        if resumed:
            self.resumed_queried += q
            self.resumed_hits += h
            self.recomputed += max(0, dropped - h)
        else:
            self.queried += q
            self.hits += h

    def _after_computed_blocks(self, result: Any, request: Any, *a: Any, **k: Any) -> None:
        # vLLM 0.24 counts a lookup here unless caching is off or the request skips reading the cache
        if not self.sched.kv_cache_manager.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
            return
        self._after_prefix(None, request, int(result[1]))

    def _lookup(self, request: Any, n: int, hit: int, dropped: int = 0) -> None:
        """One PrefixLookup: vLLM's block hashes of the request against the table of earlier prompts'. A
        re-admission's `cacheable_tokens` are the `dropped` positions its preemption lost (0 on a repeated lookup
        of the same re-admission), so that its recomputation is `max(0, min(prompt, cacheable) - hit)`."""
        now, P, table = time.monotonic_ns(), self.page_size, self.table
        readmit = getattr(request, "num_preemptions", 0) > 0
        chain = [bytes(h) for h in list(request.block_hashes)[: n // P]]
        tokens = list(request.all_token_ids[: (len(chain) + 1) * P])
        shared = table.shared(tokens, chain)
        if not readmit:
            table.register(tokens[:n], chain)
        cacheable = (n - 1) // P * P if n else 0  # vLLM always computes the last token
        stop = max(min(max(shared, hit) // P * P, cacheable), hit) // P
        evicted, gap = table.evicted_run(chain, hit // P, stop, now)
        self.probe.emit(PrefixLookup(now, self.rank0, short_id(request.request_id), "readmit" if readmit else "first",
                                     P, n, dropped if readmit else cacheable, hit, shared, evicted, gap,
                                     len(table.pages), table.dropped))

    def _emit_prefix(self, now: int) -> None:
        state = (self.queried, self.hits, self.recomputed, self.evicted)
        if state == self._last_prefix:
            return
        self._last_prefix = state
        # one prefix cache per engine (the scheduler's), so one series: the engine's first rank
        self.probe.emit(PrefixCounters(now, self.rank0, *state))
        self.probe.label(prefix_resumed_queried_tokens=self.resumed_queried,
                         prefix_resumed_hit_tokens=self.resumed_hits)

    # block pool counters
    def _after_new_blocks(self, blocks: Any, *a: Any, **k: Any) -> None:
        self.allocated += len(blocks)
        if self.life is not None:
            self.life.allocated([b.block_id for b in blocks], time.monotonic_ns())

    def _before_touch(self, blocks: Any, *a: Any, **k: Any) -> None:
        idle = [b for b in blocks if b.ref_cnt == 0 and not b.is_null]  # cached blocks a prefix hit takes back
        self.allocated += len(idle)
        self.cached -= sum(1 for b in idle if b.block_hash is not None)
        if self.life is not None and idle:
            self.life.reused([b.block_id for b in idle], time.monotonic_ns())

    def _before_free(self, ordered_blocks: Any, *a: Any, **k: Any) -> tuple:
        blocks = list(ordered_blocks)  # vLLM passes iterators: copy so both sides see every block
        self._freeing = blocks
        return (blocks, *a)

    def _after_free(self, _res: Any, *a: Any, **k: Any) -> None:
        blocks, self._freeing = getattr(self, "_freeing", ()), ()
        idle = [b for b in blocks if b.ref_cnt == 0 and not b.is_null]
        self.freed += len(idle)
        self.cached += sum(1 for b in idle if b.block_hash is not None)  # a hashed page stays cached when freed
        if self.life is not None and idle:
            now = time.monotonic_ns()
            # a hashed block stays cached (evictable) until reused or evicted; an unhashed one is simply free
            self.life.cached([b.block_id for b in idle if b.block_hash is not None], now)
            self.life.freed([b.block_id for b in idle if b.block_hash is None], now)

    def _before_evict(self, block: Any, *a: Any, **k: Any) -> None:
        key = block.block_hash  # BlockHashWithGroupId: the block hash and a 4-byte group id; None if not cached
        self._evicting_idle = key is not None and block.ref_cnt == 0
        if key is not None and (self.table is not None or self.life is not None):
            now = time.monotonic_ns()
            if self.table is not None:
                self.table.mark_evicted((bytes(key[:-4]),), now)
            if self.life is not None:
                self.life.evicted((block.block_id,), now)

    def _after_evict(self, evicted: Any, *a: Any, **k: Any) -> None:
        if evicted:
            self.evicted += 1
            if self._evicting_idle:
                self.cached -= 1
        self._evicting_idle = False

    # KV snapshot
    def snapshot(self, now: int) -> None:
        """One KVSnapshot per TP rank from the block pool, in O(used pages) (and O(cached) every
        CACHED_RECOUNT_EVERY snapshots)."""
        t0 = time.perf_counter_ns()
        if self.snapshots % CACHED_RECOUNT_EVERY == 0:
            exact = self._cached_pages()
            if exact != self.cached:  # e.g. after reset_prefix_cache, which no wrapper sees
                self.cached_recounts_off += 1
                self.probe.label(kv_cached_recounts_off=self.cached_recounts_off)
                self.cached = exact
        stats = pool_stats(self.pool, self.sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks,
                           self.sched.requests, self.page_size, self.cached)
        for r in range(self.tp):
            self.probe.emit(kv_record(now, self.rank0 + r, stats, self.allocated, self.freed, self.page_bytes,
                                      self.kv_dtype))
        self.snapshot_ns_total += time.perf_counter_ns() - t0
        self.snapshots += 1
        if self.snapshots in (10, 100) or self.snapshots % 1000 == 0:  # what the snapshots cost, now and then
            self.probe.label(kv_snapshot_mean_us=round(self.snapshot_ns_total / self.snapshots / 1e3, 1))

    def _cached_pages(self) -> int:
        return cached_pages(self.pool)


def pool_stats(pool: Any, tables: dict[str, list], reqs: dict[str, Any], P: int, cached: int) -> PageStats:
    """Page statistics of vLLM's block pool: `tables` (request id -> its blocks, the null block skipped),
    `reqs` (request id -> request: its computed tokens are the live ones), `P` tokens per page, `cached`
    hashed pages no request references (kept by the pool wrappers). O(used pages)."""
    total = pool.num_gpu_blocks - 1  # block 0 is the null block
    free = int(pool.free_block_queue.num_free_blocks)
    used_ids: set[int] = set()
    shared: dict[int, int] = {}
    live = seqs = 0
    for rid, blocks in tables.items():
        if not blocks:
            continue
        seqs += 1
        n_real = 0
        for b in blocks:
            if b.is_null:
                continue
            n_real += 1
            used_ids.add(b.block_id)
            if b.ref_cnt > 1:
                shared[b.block_id] = b.ref_cnt
        req = reqs.get(rid)
        ncomp = int(req.num_computed_tokens) if req is not None else n_real * P
        live += min(ncomp, n_real * P)
    live -= sum((refs - 1) * P for refs in shared.values())
    run = largest_gap(used_ids, 0, pool.num_gpu_blocks) if free else 0  # block 0 (null) is never free
    return PageStats(P, total, total - free, free, cached, len(shared), sum(shared.values()), seqs, max(live, 0), run)


def cached_pages(pool: Any) -> int:
    """Hashed pages no request references (evictable prefix-cache pages), counted from the hash map."""
    cache = getattr(pool.cached_block_hash_to_block, "_cache", None)
    if cache is None:
        return 0
    n = 0
    for v in cache.values():
        if isinstance(v, dict):
            n += sum(1 for b in v.values() if b.ref_cnt == 0)
        elif v.ref_cnt == 0:
            n += 1
    return n


def _core_event_ns(request: Any, kind: str) -> int | None:
    """The latest EngineCoreEvent `kind` (QUEUED, SCHEDULED) vLLM recorded on `request`, in monotonic ns (vLLM
    stamps them with time.monotonic() in this process); None when it records none (log stats off)."""
    for ev in reversed(getattr(request, "events", None) or ()):
        t = getattr(ev, "type", None)
        if str(getattr(t, "name", t)).upper() == kind:
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


def _is_abort(reason: Any) -> bool:
    """An output's finish reason that is no success: ABORT (reaching outputs only from the engine's own aborts:
    shutdown, pause; a client's abort never produces one) or ERROR (a request-level internal error)."""
    name = str(reason).upper()
    return "ABORT" in name or "ERROR" in name


# --- frontend: token and finish times where vLLM measures them ------------------

class FrontendHooks:
    """Instance wrapper on the frontend's `OutputProcessor` (`vllm serve`, `LLM`): token and
    finish events stamped when the frontend receives them, as vLLM's own TTFT/ITL/E2E are.
    Aborts are still recorded by the EngineCore (`finish_requests`)."""

    def __init__(self, processor: Any) -> None:
        os.environ[ENV_TOKENS_AT] = "frontend"  # read by the EngineCore, started after this
        self.probe = channel("frontend", 0, 1, "vllm", {"runtime": RUNTIME})
        self.out_tokens: dict[str, int] = {}
        self.states = getattr(processor, "request_states", None)  # vLLM's live requests (aborted ones leave it)
        wrap(processor, "process_outputs", lambda r, *a, **k: None, lambda: self.probe, before=self._before)

    def _before(self, outputs: Any, *a: Any, **k: Any) -> None:
        now = time.monotonic_ns()
        # issue 27 item 3: vLLM's ITL (and decode time) runs on the EngineCore's output timestamp (time.monotonic()
        # there: one clock per host), its TTFT and E2E on the frontend's receive time. A token event keeps both:
        # ts_ns the receive time, cached_tokens the lead of the engine's stamp in whole microseconds, with ts_ns
        # rounded up to make ts_ns - 1000 * lead the engine's stamp to the nanosecond (engine_lead_us)
        eng = a[0] if a else k.get("engine_core_timestamp")
        # vLLM's TTFT and E2E end at IterationStats.iteration_timestamp (time.time() when the frontend took the
        # batch): the receive time is that stamp where vLLM makes one (log stats on; our stat logger forces it)
        stats = a[1] if len(a) > 1 else k.get("iteration_stats")
        its = getattr(stats, "iteration_timestamp", None)
        if its:
            now = mono_of_wall(its)
        lead = 0
        if eng:
            lead, now = engine_lead_us(now, int(eng * 1e9))
        states = self.states
        for o in outputs or ():
            rid = o.request_id
            if states is not None and rid not in states:
                # vLLM ignores outputs for an already-aborted request (output_processor.process_outputs): so do
                # we, or a hang-up's last tokens count once more than vLLM's generation tokens and ITL
                self.out_tokens.pop(rid, None)
                continue
            n = len(o.new_token_ids or ())
            if n:
                self.out_tokens[rid] = self.out_tokens.get(rid, 0) + n
                self.probe.emit(RequestEvent(now, 0, REQ_TOKEN, short_id(rid), n, lead))
            if o.finish_reason is not None:
                event = REQ_ABORTED if _is_abort(o.finish_reason) else REQ_FINISHED
                self.probe.emit(RequestEvent(now, 0, event, short_id(rid), self.out_tokens.pop(rid, 0), 0))


# --- workers: per-rank step time --------------------------------------------------

class WorkerHooks:
    """Instance wrappers on one vLLM `Worker` (one TP rank): one Step per engine step.

    A step is `execute_model` + `sample_tokens`, timed by the worker's probe with
    `begin_step`/`end_step` around them: host time always, CUDA events (sampled under the
    probe's budget, recorded outside any graph) on GPU, so steps that replay full CUDA
    graphs are timed too. Token counts come from the SchedulerOutput, never from padded
    graph inputs.
    """

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
            _fail("cuda_events", exc)
        self.probe = channel("worker", self.rank, tp * pp * max(1, int(labels.get("dp", "1"))),
                             _model_name(cfg), labels, device=device)
        self.prompt_len: dict[str, int] = {}
        self._open = False  # a step is open (begin_step called, end_step not yet)
        self._label_weights(worker, tp * pp)
        self._label_backend(cfg)
        ref = lambda: self.probe  # noqa: E731
        wrap(worker, "execute_model", self._after_execute, ref, before=self._before_execute)
        wrap(worker, "sample_tokens", self._after_sample, ref)

    @property
    def step_id(self) -> int:
        """Steps this worker has recorded (the engine's step ids: identical on every rank)."""
        return self.probe.steps

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
            _fail("model_weights", exc)

    def _label_backend(self, cfg: Any) -> None:
        """The attention backend's limits, read from the runtime (what the analyzers' advice must respect):
        `vllm_attention_backend`, `vllm_block_sizes` (block_size_rule) and `vllm_kv_cache_dtypes`."""
        try:
            layers = cfg.compilation_config.static_forward_context.values()
            backend = next(b for b in (getattr(x, "attn_backend", None) for x in layers) if b is not None)
            dtypes = [str(d) for d in getattr(backend, "supported_kv_cache_dtypes", ())]
            if backend.get_name() == "CPU_ATTN" and not _cpu_has_fp8_kv():
                dtypes = [d for d in dtypes if not d.startswith("fp8")]
            self.probe.label(vllm_attention_backend=backend.get_name(),
                             vllm_block_sizes=block_size_rule(backend.get_supported_kernel_block_sizes()),
                             vllm_kv_cache_dtypes=",".join(dtypes)[:96])
        except Exception as exc:  # noqa: BLE001 - labels are optional: the analyzers fall back to their table
            _fail("attention_backend", exc)

    def shape(self, so: Any) -> StepShape:
        """Token counts of one SchedulerOutput (identical on every rank)."""
        per_seq = []
        nst = so.num_scheduled_tokens
        for rid in so.finished_req_ids or ():
            self.prompt_len.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            plen = len(nr.prompt_token_ids) if nr.prompt_token_ids is not None else int(nr.num_computed_tokens)
            self.prompt_len[nr.req_id] = plen
            start, n = int(nr.num_computed_tokens), int(nst.get(nr.req_id, 0))
            per_seq.append((*split_tokens(start, n, plen, plen), start))
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            plen = self.prompt_len.get(rid, 0)
            start, n = int(cr.num_computed_tokens[i]), int(nst.get(rid, 0))
            num_tokens = plen + int(cr.num_output_tokens[i])
            per_seq.append((*split_tokens(start, n, plen, num_tokens), start))
        return step_shape(per_seq)

    def _before_execute(self, so: Any, *a: Any, **k: Any) -> None:
        self._close_open(None)  # a step whose sample_tokens never came
        if getattr(so, "total_num_scheduled_tokens", 0) <= 0:
            return None
        if str(next(iter(so.num_scheduled_tokens), "")).startswith(WARMUP_PREFIX):
            return None  # vLLM's own kernel warm-up at start (model runner V2), not an engine step
        self.probe.begin_step(*self.shape(so))
        self._open = True
        return None

    def _after_execute(self, result: Any, *a: Any, **k: Any) -> None:
        if result is not None:  # no sample_tokens half for this step
            self._close_open(None)

    def _after_sample(self, result: Any, *a: Any, **k: Any) -> None:
        self._close_open(None)

    def _close_open(self, _: Any) -> None:
        if self._open:
            self._open = False
            self.probe.end_step()


# --- install: catch the first Scheduler and Worker ------------------------------------

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
                _fail(f"{cls.__name__}.{method}", exc)
        return result

    catcher._phasescope_catch = True  # type: ignore[attr-defined]
    setattr(cls, method, catcher)


def install() -> None:
    """Arm the one-shot catchers for the scheduler (EngineCore) and the worker (each rank)."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler

        _catch_first(Scheduler, "__init__", EngineHooks)
    except Exception as exc:  # noqa: BLE001
        _fail("Scheduler", exc)
    try:
        from vllm.v1.engine.output_processor import OutputProcessor

        _catch_first(OutputProcessor, "__init__", FrontendHooks)
    except Exception as exc:  # noqa: BLE001
        _fail("OutputProcessor", exc)
    try:
        from vllm.v1.worker.gpu_worker import Worker

        _catch_first(Worker, "load_model", WorkerHooks)
    except Exception as exc:  # noqa: BLE001
        _fail("Worker", exc)
