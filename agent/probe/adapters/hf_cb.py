"""HF transformers continuous batching (`init_continuous_batching`, `generate_batch`).

Instruments a `ContinuousBatchingManager` and, once its generation thread has
built it, the batch processor: scheduler, `PagedAttentionCache`, its cache pool
and the offloading manager. Everything runs on the generation thread, between
steps, except `add_request` / `cancel_request` (the caller's thread).

What is recorded, and when:
- arrival: inside `add_request` (prompt tokens);
- scheduled: just before the forward that first computes the request (cached
  tokens = the prefix-cache hit of its admission lookup);
- token / finished / aborted: right after `update_batch`, i.e. when outputs are
  handed to the caller;
- preempted: when the offloading manager evicts a request (CPU offload or soft
  reset; a soft-reset request's re-prefill counts as recomputed tokens, never
  as prefix hits);
- a KV snapshot and the prefix counters just before every `kv_every_steps`-th
  forward: the block tables are final for that step and `position_offset`
  already counts the tokens the forward writes.

HF's vocabulary: a "block" holds `page_size` tokens of every layer of one
attention group (vLLM's block, our page); HF's "page" is one layer's share.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ...events import PHASE_DECODE, PHASE_MIXED, PHASE_PREFILL
from ..kvmath import PageStats, largest_run, page_stats_fast
from ..phases import StepShape
from ..probe import Probe
from .base import RuntimeAdapter

log = logging.getLogger("phasescope.adapters.hf_cb")


def cb_config(page_size: int, num_blocks: int, max_batch_tokens: int, **extra: Any) -> Any:
    """A transformers `ContinuousBatchingConfig` across versions (`page_size` was `block_size` before 5.17)."""
    import dataclasses

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    size_key = "page_size" if "page_size" in names else "block_size"
    return ContinuousBatchingConfig(**{size_key: page_size}, num_blocks=num_blocks,
                                    max_batch_tokens=max_batch_tokens, **extra)


def _main_allocator(cache: Any) -> Any:
    allocators = cache.cache_allocators
    return allocators.get("full_attention") or next(iter(allocators.values()))


def free_block_ids(cache: Any, allocator: Any) -> list[int]:
    """Free block ids of `allocator`: loose free blocks plus every block of unassigned sectors. O(free)."""
    pool = cache.pool
    per_sector = allocator.blocks_per_sector
    ids = [b for tree in pool._free_blocks[allocator.index].trees.values() for b in tree]
    if per_sector == 1:
        ids.extend(pool.free_sectors)
    else:
        for sector in pool.free_sectors:
            ids.extend(range(sector * per_sector, (sector + 1) * per_sector))
    return ids


def hf_page_stats(cache: Any, active_requests: dict[str, Any], largest_free_run: int | None = None) -> PageStats:
    """Page accounting of a PagedAttentionCache from its own block table, ledger and pool.

    O(sequences + shared pages), except the largest free run, which needs every free
    id (O(free pages)): pass the last known value to skip that scan.
    """
    alloc = _main_allocator(cache)
    pool = cache.pool
    free = pool.count_free_blocks(alloc.index) + len(pool.free_sectors) * alloc.blocks_per_sector
    if largest_free_run is None:
        largest_free_run = largest_run(free_block_ids(cache, alloc))
    tables = ((len(t), active_requests[rid].position_offset if rid in active_requests else 0)
              for rid, t in alloc.block_table.items())
    return page_stats_fast(
        page_size=alloc.tokens_per_page,
        total_pages=alloc.num_blocks,
        tables=tables,
        shared_refs=alloc.ledger.shared_ref_counts,
        free_pages=free,
        cached_pages=len(alloc.ledger.cached_blocks),
        largest_free_run=largest_free_run,
    )


class HFContinuousBatching(RuntimeAdapter):
    """Request lifecycle, paged-KV snapshots and prefix counters for HF continuous batching.

        probe = attach(model, runtime="hf-cb")
        adapter = HFContinuousBatching(probe).instrument_model(model)   # covers generate_batch too
        # or: adapter.instrument_manager(model.init_continuous_batching(...))
    """

    runtime = "hf-cb"

    def __init__(
        self,
        probe: Probe,
        kv_every_steps: int = 1,
        free_run_every: int | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        """`kv_every_steps`: snapshot cadence in forwards. `free_run_every`: rescan the free
        list for the largest contiguous run every this many snapshots (the other
        figures are exact at every snapshot); default 1 up to 4096 pages, else 16."""
        super().__init__(probe)
        if kv_every_steps < 1 or (free_run_every is not None and free_run_every < 1):
            raise ValueError("kv_every_steps and free_run_every must be >= 1")
        self.kv_every_steps = kv_every_steps
        self.free_run_every = free_run_every
        self._snapshots = 0
        self._clock_ns = clock_ns
        self._steps = 0
        self._processors: set[int] = set()
        self._managers: set[int] = set()
        self._scheduled: set[str] = set()  # requests seen in a forward since their (re)admission
        self._lookup: dict[str, tuple[int, int]] = {}  # rid -> (queried, hit) of its latest admission lookup
        self._lost: dict[str, int] = {}  # soft-reset rid -> tokens of computed KV it lost (to be recomputed)
        self._computed: dict[str, int] = {}  # rid -> tokens whose KV some forward has computed (max position)
        self._emitted: dict[str, int] = {}  # rid -> output tokens reported so far
        self._open: set[str] = set()  # arrivals whose end (finished/aborted) has not been reported
        self.last_stats: PageStats | None = None
        self.supported = True  # False once a processor of an unsupported transformers version was seen

    def _forget(self, rid: str) -> None:
        """Drop the per-request state of a request that ended."""
        self._open.discard(rid)
        self._emitted.pop(rid, None)
        self._scheduled.discard(rid)
        self._computed.pop(rid, None)
        self._lost.pop(rid, None)
        self._lookup.pop(rid, None)

    def _arrival(self, rid: str, ts: int, prompt_tokens: int) -> None:
        """A request arrives. Runtime ids are labels that calls reuse (`generate_batch` names every call's
        requests req_0, req_1, ...): an arrival starts a fresh request. If an earlier arrival under this
        id never reported its end (its manager stopped with it in flight), it is closed as aborted first,
        so each arrival's events are one bracket [arrival .. finished|aborted] and per-request state
        (scheduled, cached tokens, output count) never carries over."""
        if rid in self._open:
            self.probe.request_event(rid, "aborted", ts, tokens=self._emitted.get(rid, 0))
            self._forget(rid)
        self._open.add(rid)
        self.probe.request_event(rid, "arrival", ts, tokens=prompt_tokens)

    # --- entry points ---

    def instrument_model(self, model: Any) -> "HFContinuousBatching":
        """Instrument every manager `model.init_continuous_batching` returns (generate_batch uses it)."""

        def make(orig: Callable) -> Callable:
            def init_continuous_batching(*a: Any, **k: Any) -> Any:
                manager = orig(*a, **k)
                self.instrument_manager(manager)
                return manager

            return init_continuous_batching

        self.patch(model, "init_continuous_batching", make)
        return self

    def instrument_manager(self, manager: Any) -> "HFContinuousBatching":
        """Instrument one manager (before or after start())."""
        if id(manager) in self._managers:
            return self
        self._managers.add(id(manager))
        emit = self.probe.request_event
        clock = self._clock_ns

        def make_add(orig: Callable) -> Callable:
            def add_request(input_ids: Any, *a: Any, **k: Any) -> Any:
                ts = clock()
                rid = orig(input_ids, *a, **k)
                if rid is not None:
                    self._arrival(rid, ts, len(input_ids))
                return rid

            return add_request

        self.patch(manager, "add_request", make_add)

        def make_create(orig: Callable) -> Callable:
            def _create_batch_processor() -> Any:
                bp = orig()
                self.guarded(self.instrument_processor)(bp)
                return bp

            return _create_batch_processor

        self.patch(manager, "_create_batch_processor", make_create)
        if getattr(manager, "batch_processor", None) is not None:
            self.instrument_processor(manager.batch_processor)
        return self

    def instrument_processor(self, bp: Any) -> None:
        """Instrument a ContinuousBatchProcessor (called on the generation thread)."""
        if id(bp) in self._processors:
            return
        self._processors.add(id(bp))
        missing = [n for n, obj in (("cache.cache_allocators", getattr(bp.cache, "cache_allocators", None)),
                                    ("cache.pool", getattr(bp.cache, "pool", None)),
                                    ("scheduler.active_requests", getattr(bp.scheduler, "active_requests", None)))
                   if obj is None]
        if missing:
            import transformers

            self.supported = False
            log.warning("phasescope: HF continuous batching of transformers %s lacks %s; request lifecycle, KV "
                        "and prefix instrumentation need transformers >= 5.24 (steps are still measured)",
                        transformers.__version__, ", ".join(missing))
            # a run label, so the store and diagnose say these figures are absent, not zero
            self.probe.label(adapter_missing=",".join(missing)[:96])
            return
        from transformers.generation.continuous_batching.requests import RequestStatus

        FINISHED, FAILED = RequestStatus.FINISHED, RequestStatus.FAILED
        cache, sched = bp.cache, bp.scheduler
        alloc = _main_allocator(cache)
        index = alloc.index
        bytes_per_page = alloc.bytes_per_block
        dtype = str(getattr(cache, "dtype", "")).replace("torch.", "")
        emit = self.probe.request_event
        clock = self._clock_ns
        prefix = self.prefix
        guarded = self.guarded

        # prefix lookups: remembered per request, counted once it is actually scheduled
        def make_search(orig: Callable) -> Callable:
            def search_prefix_match(request_id: str, prompt_ids: list[int]) -> int:
                hit = orig(request_id, prompt_ids)
                self._lookup[request_id] = (len(prompt_ids), hit)
                return hit

            return search_prefix_match

        self.patch(cache, "search_prefix_match", make_search)

        def make_evict(orig: Callable) -> Callable:
            def evict_cached_blocks() -> bool:
                before = len(alloc.ledger.cached_blocks)
                out = orig()
                prefix.evicted_blocks += before - len(alloc.ledger.cached_blocks)
                return out

            return evict_cached_blocks

        self.patch(cache, "evict_cached_blocks", make_evict)

        pool = cache.pool

        def make_get(orig: Callable) -> Callable:
            def get_free_blocks(idx: int, num_blocks: int) -> list[int]:
                out = orig(idx, num_blocks)
                if idx == index:
                    self.pages_allocated += len(out)
                return out

            return get_free_blocks

        def make_free(orig: Callable) -> Callable:
            def free_blocks(idx: int, block_ids: list[int]) -> None:
                orig(idx, block_ids)
                if idx == index:
                    self.pages_freed += len(block_ids)

            return free_blocks

        self.patch(pool, "get_free_blocks", make_get)
        self.patch(pool, "free_blocks", make_free)

        def before_forward() -> None:
            ts = clock()
            io = bp.inputs_and_outputs
            computed = self._computed
            n_pre = n_dec = t_pre = t_dec = context = 0
            for fs in getattr(io, "requests_in_batch", ()):
                state = fs.state
                rid = state.request_id
                end = state.position_offset  # already counts the tokens this forward computes
                start = end - fs.query_length
                # exact phase of this sequence's tokens: prompt (or re-prefill) tokens vs generated ones
                prompt = min(end, len(state.initial_tokens)) - start
                if prompt > 0:
                    n_pre += 1
                    t_pre += prompt
                    t_dec += fs.query_length - prompt
                else:
                    n_dec += 1
                    t_dec += fs.query_length
                context += start
                if rid.startswith("__warmup_"):
                    continue
                if rid not in self._scheduled:
                    self._scheduled.add(rid)
                    queried, hit = self._lookup.pop(rid, (0, 0))
                    # a re-prefill after a soft reset is not a prefix-cache query (nor its hits)
                    if rid not in self._lost and cache.use_prefix_sharing:
                        prefix.queried_tokens += queried
                        prefix.hit_tokens += hit
                    emit(rid, "scheduled", ts, cached_tokens=hit)
                lost = self._lost.get(rid)
                if lost is not None:
                    # recomputation as executed: the part of this chunk whose KV existed before the reset
                    prefix.recomputed_tokens += max(0, min(end, lost) - start)
                    if end >= lost:
                        del self._lost[rid]
                if end > computed.get(rid, 0):
                    computed[rid] = end
            if n_pre or n_dec:
                phase = PHASE_MIXED if n_pre and n_dec else (PHASE_PREFILL if n_pre else PHASE_DECODE)
                self.probe.next_shape = StepShape(phase, n_pre + n_dec, t_pre, t_dec, context)
            self._steps += 1
            if (self._steps - 1) % self.kv_every_steps == 0:
                every = self.free_run_every or (1 if alloc.num_blocks <= 4096 else 16)
                last = self.last_stats
                rescan = last is None or self._snapshots % every == 0
                self._snapshots += 1
                stats = hf_page_stats(cache, sched.active_requests, None if rescan else last.largest_free_run)
                self.last_stats = stats
                self.emit_kv(ts, stats, bytes_per_page, dtype)
                self.emit_prefix(ts)

        def make_step(orig: Callable) -> Callable:
            def _generation_step(model: Any) -> Any:
                guarded(before_forward)()
                return orig(model)

            return _generation_step

        self.patch(bp, "_generation_step", make_step)

        def after_update(before: list[tuple[Any, int]]) -> None:
            ts = clock()
            for state, n0 in before:
                rid = state.request_id
                n1 = len(state.generated_tokens)
                if n1 > n0:
                    emit(rid, "token", ts, tokens=n1 - n0)
                    self._emitted[rid] = self._emitted.get(rid, 0) + (n1 - n0)
                status = state.status
                if status == FINISHED and rid not in sched.active_requests:
                    emit(rid, "finished", ts, tokens=self._emitted.pop(rid, 0))
                    self._forget(rid)
                elif status == FAILED:
                    emit(rid, "aborted", ts, tokens=self._emitted.pop(rid, 0))
                    self._forget(rid)

        def make_update(orig: Callable) -> Callable:
            def update_batch() -> Any:
                before = [(s, len(s.generated_tokens)) for s in list(sched.active_requests.values())]
                out = orig()
                guarded(after_update)(before)
                return out

            return update_batch

        self.patch(bp, "update_batch", make_update)

        def make_cancel(orig: Callable) -> Callable:
            def clear_cancelled_requests() -> list:
                states = orig()
                ts = clock()
                for state in states:
                    rid = state.request_id
                    emit(rid, "aborted", ts, tokens=self._emitted.pop(rid, 0))
                    self._forget(rid)
                return states

            return clear_cancelled_requests

        self.patch(sched, "clear_cancelled_requests", make_cancel)

        offm = getattr(bp, "offloading_manager", None)
        if offm is not None:

            def after_offload(before: set[str]) -> None:
                ts = clock()
                for rid in before - set(sched.active_requests):
                    state = sched.waiting_requests.get(rid)
                    if state is None:
                        continue
                    emit(rid, "preempted", ts)
                    self._scheduled.discard(rid)
                    computed = self._computed.get(rid, 0)
                    if not getattr(state, "is_cpu_offloaded", False) and computed > 0:
                        # soft reset: computed KV is gone and will be recomputed
                        self._lost[rid] = max(computed, self._lost.get(rid, 0))

            def make_offload(orig: Callable) -> Callable:
                def offload_requests() -> bool:
                    before = set(sched.active_requests)
                    out = orig()
                    guarded(after_offload)(before)
                    return out

                return offload_requests

            self.patch(offm, "offload_requests", make_offload)
