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
  already counts the tokens the forward writes;
- a `PrefixLookup` per admission lookup (emitted with its `scheduled` event):
  the prompt's page-hash chain is computed once, in `search_prefix_match`,
  against a bounded table of earlier prompts (`pagetrack.PrefixTable`);
  evictions (`evict_cached_blocks`, and the uncached frees of a soft reset)
  mark the hashes they drop;
- `PageEvent`s of one page id in `page_sample_every` (allocation in the pool,
  cached when its last request frees it, reused by a prefix hit, evicted, freed).

HF's vocabulary: a "block" holds `page_size` tokens of every layer of one
attention group (vLLM's block, our page); HF's "page" is one layer's share.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

from ...records.events import PHASE_DECODE, PHASE_MIXED, PHASE_PREFILL, PrefixLookup, short_id
from ...records.kvmath import PageStats, largest_run, page_stats_fast
from ..pagetrack import PageLife, PrefixTable
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
        prefix_table_pages: int = 16384,
        page_sample_every: int | None = None,
        page_events_per_s: int = 1000,
    ) -> None:
        """`kv_every_steps`: snapshot cadence in forwards. `free_run_every`: rescan the free
        list for the largest contiguous run every this many snapshots (the other
        figures are exact at every snapshot); default 1 up to 4096 pages, else 16.
        `prefix_table_pages`: cap of the table of earlier prompts' page hashes (0: no
        `PrefixLookup` records). `page_sample_every`: follow one page id in this many
        (default: all up to 1024 pages, else about 1024 of them; 0: no `PageEvent`s);
        `page_events_per_s`: cap on page events a second (the rest are counted as dropped)."""
        super().__init__(probe)
        if kv_every_steps < 1 or (free_run_every is not None and free_run_every < 1):
            raise ValueError("kv_every_steps and free_run_every must be >= 1")
        if prefix_table_pages < 0 or (page_sample_every is not None and page_sample_every < 0) \
                or page_events_per_s < 1:
            raise ValueError("prefix_table_pages and page_sample_every must be >= 0, page_events_per_s >= 1")
        self.prefix_table_pages = prefix_table_pages
        self.page_sample_every = page_sample_every
        self.page_events_per_s = page_events_per_s
        self.prefix_table: PrefixTable | None = None
        self.page_life: PageLife | None = None
        self._chains: dict[str, tuple[int, list[int], int]] = {}  # rid -> (prompt length, page-hash chain, shared)
        self._plookup: dict[str, tuple] = {}  # rid -> PrefixLookup fields of its latest lookup (ts first)
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
        self._chains.pop(rid, None)
        self._plookup.pop(rid, None)

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
        self.around(model, "init_continuous_batching", self._init_continuous_batching)
        return self

    def instrument_manager(self, manager: Any) -> "HFContinuousBatching":
        """Instrument one manager (before or after start())."""
        if id(manager) in self._managers:
            return self
        self._managers.add(id(manager))
        self.around(manager, "add_request", self._add_request)
        self.around(manager, "_create_batch_processor", self._create_batch_processor)
        if getattr(manager, "batch_processor", None) is not None:
            self.instrument_processor(manager.batch_processor)
        return self

    def _init_continuous_batching(self, orig: Callable, *a: Any, **k: Any) -> Any:
        manager = orig(*a, **k)
        self.instrument_manager(manager)
        return manager

    def _add_request(self, orig: Callable, input_ids: Any, *a: Any, **k: Any) -> Any:
        ts = self._clock_ns()
        rid = orig(input_ids, *a, **k)
        if rid is not None:
            self._arrival(rid, ts, len(input_ids))
        return rid

    def _create_batch_processor(self, orig: Callable) -> Any:
        bp = orig()
        self.guarded(self.instrument_processor)(bp)
        return bp

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
        ProcessorHooks(self, bp).install()
        self.guarded(self._label_config)(bp)

    def _label_config(self, bp: Any) -> None:
        """The run's knobs as labels (zero-code runs have no others): advice then names their values."""
        alloc = _main_allocator(bp.cache)
        budget = getattr(bp.cache, "max_batch_tokens", None)
        self.probe.label(page_size=alloc.tokens_per_page, num_pages=alloc.num_blocks,
                         **({"max_batch_tokens": int(budget)} if budget is not None else {}))


class ProcessorHooks:
    """The hooks on one ContinuousBatchProcessor: its cache (prefix lookups, evictions, frees), cache pool
    (page allocation), step (shape, scheduling, KV snapshot), batch update (tokens, ends), scheduler
    (cancellations) and offloading manager (preemptions). Per-request state lives on the adapter, which
    outlives processors; each `_hook(original, ...)` replaces one method of the runtime's instance."""

    def __init__(self, adapter: HFContinuousBatching, bp: Any) -> None:
        from transformers.generation.continuous_batching.requests import RequestStatus

        self.a = adapter
        self.bp, self.cache, self.sched = bp, bp.cache, bp.scheduler
        self.finished, self.failed = RequestStatus.FINISHED, RequestStatus.FAILED
        self.alloc = alloc = _main_allocator(self.cache)
        self.index = alloc.index
        self.bytes_per_page = alloc.bytes_per_block
        self.dtype = str(getattr(self.cache, "dtype", "")).replace("torch.", "")
        self.page = alloc.tokens_per_page
        self.ledger = alloc.ledger
        self.rank = adapter.probe.rank
        self.emit = adapter.probe.request_event
        self.clock = adapter._clock_ns
        self.table = self.life = None
        if adapter.prefix_table_pages:
            from transformers.generation.continuous_batching.cache_allocators.cache_allocator import (
                compute_block_hash)

            self.table = adapter.prefix_table = PrefixTable(self.page, compute_block_hash, adapter.prefix_table_pages)
        every = adapter.page_sample_every
        if every is None:
            every = max(1, -(-alloc.num_blocks // 1024))
        if every:
            self.life = adapter.page_life = PageLife(adapter.probe.emit, self.rank, every, adapter.page_events_per_s)

    def install(self) -> None:
        a, cache, pool = self.a, self.cache, self.cache.pool
        a.around(cache, "search_prefix_match", self._search_prefix_match)
        a.around(cache, "evict_cached_blocks", self._evict_cached_blocks)
        if self.table is not None or self.life is not None:
            a.around(cache, "free_blocks", self._cache_free_blocks)
        a.around(pool, "get_free_blocks", self._get_free_blocks)
        a.around(pool, "free_blocks", self._pool_free_blocks)
        a.around(self.bp, "_generation_step", self._generation_step)
        a.around(self.bp, "update_batch", self._update_batch)
        a.around(self.sched, "clear_cancelled_requests", self._clear_cancelled_requests)
        offm = getattr(self.bp, "offloading_manager", None)
        if offm is not None:
            a.around(offm, "offload_requests", self._offload_requests)

    # --- prefix lookups: remembered per request, counted once it is actually scheduled ---

    def _search_prefix_match(self, orig: Callable, request_id: str, prompt_ids: list[int]) -> int:
        hit = orig(request_id, prompt_ids)
        self.a._lookup[request_id] = (len(prompt_ids), hit)
        if self.table is not None or self.life is not None:
            self.a.guarded(self.after_search)(request_id, prompt_ids, hit)
        return hit

    def after_search(self, rid: str, prompt_ids: list[int], hit: int) -> None:
        ts = self.clock()
        if self.life is not None and hit:
            self.life.reused(self.alloc.block_table.get(rid, ())[:hit // self.page], ts)
        if self.table is not None:
            self.note_lookup(rid, prompt_ids, hit, ts)

    def note_lookup(self, rid: str, prompt_ids: list[int], hit: int, ts: int) -> None:
        a, table, page = self.a, self.table, self.page
        readmit = rid in a._lost
        n = len(prompt_ids)
        known = a._chains.get(rid)
        if known is None or known[0] != n:
            chain = table.chain(prompt_ids)
            shared = table.shared(prompt_ids, chain)
            if not readmit:
                table.register(prompt_ids, chain)
            a._chains[rid] = known = (n, chain, shared)
        _, chain, shared = known
        cacheable = (n - 1) // page * page if n else 0
        stop = max(min(max(shared, hit) // page * page, cacheable), hit) // page
        evicted, gap = table.evicted_run(chain, hit // page, stop, ts)
        # a re-admission's cacheable tokens are the positions its reset dropped: its recomputation (the miss
        # split's `readmission`) is then max(0, min(n, dropped) - hit), the figure recomputed_tokens counts
        a._plookup[rid] = (ts, "readmit" if readmit else "first", page, n,
                           min(n, a._lost[rid]) if readmit else cacheable, hit, shared,
                           evicted, gap, len(table.pages), table.dropped)

    # --- evictions and frees of the cache ---

    def _evict_cached_blocks(self, orig: Callable) -> bool:
        cached = self.ledger.cached_blocks
        before = len(cached)
        if before and (self.table is not None or self.life is not None):
            self.a.guarded(self.before_evict)()
        out = orig()
        self.a.prefix.evicted_blocks += before - len(self.ledger.cached_blocks)
        return out

    def before_evict(self) -> None:
        ts = self.clock()
        ledger = self.ledger
        cached = list(ledger.cached_blocks)
        if self.table is not None:
            self.table.mark_evicted([ledger.block_to_hash[b] for b in cached if b in ledger.block_to_hash], ts)
        if self.life is not None:
            self.life.evicted(cached, ts)

    def _cache_free_blocks(self, orig: Callable, request_id: str, no_cache: bool = False) -> None:
        blocks = list(self.alloc.block_table.get(request_id, ()))
        hashes = [self.ledger.block_to_hash.get(b) for b in blocks] if no_cache else []
        orig(request_id, no_cache)
        if blocks:
            self.a.guarded(self.after_free)(blocks, hashes, no_cache)

    def after_free(self, blocks: list[int], hashes: list[int | None], no_cache: bool) -> None:
        ts = self.clock()
        ledger = self.ledger
        if self.life is not None:
            self.life.cached([b for b in blocks if b in ledger.cached_blocks], ts)
        if self.table is not None and no_cache:
            # a soft reset frees its pages uncached: hashes no other request holds are gone
            self.table.mark_evicted([h for h in hashes if h is not None and h not in ledger.hash_to_block], ts)

    # --- the cache pool: pages allocated and freed ---

    def _get_free_blocks(self, orig: Callable, idx: int, num_blocks: int) -> list[int]:
        out = orig(idx, num_blocks)
        if idx == self.index:
            self.a.pages_allocated += len(out)
            if self.life is not None:
                self.a.guarded(self.life.allocated)(out, self.clock())
        return out

    def _pool_free_blocks(self, orig: Callable, idx: int, block_ids: list[int]) -> None:
        orig(idx, block_ids)
        if idx == self.index:
            self.a.pages_freed += len(block_ids)
            if self.life is not None:
                self.a.guarded(self.life.freed)(block_ids, self.clock())

    # --- each step: its shape, first schedulings, recomputation, the KV snapshot ---

    def _generation_step(self, orig: Callable, model: Any) -> Any:
        self.a.guarded(self.before_forward)()
        return orig(model)

    def before_forward(self) -> None:
        a, probe, cache = self.a, self.a.probe, self.cache
        ts = self.clock()
        computed = a._computed
        n_pre = n_dec = t_pre = t_dec = context = 0
        for fs in getattr(self.bp.inputs_and_outputs, "requests_in_batch", ()):
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
            if rid not in a._scheduled:
                self.first_scheduled(rid, state, ts)
            lost = a._lost.get(rid)
            if lost is not None:
                # recomputation as executed: the part of this chunk whose KV existed before the reset
                a.prefix.recomputed_tokens += max(0, min(end, lost) - start)
                if end >= lost:
                    del a._lost[rid]
            if end > computed.get(rid, 0):
                computed[rid] = end
        if n_pre or n_dec:
            phase = PHASE_MIXED if n_pre and n_dec else (PHASE_PREFILL if n_pre else PHASE_DECODE)
            probe.next_shape = StepShape(phase, n_pre + n_dec, t_pre, t_dec, context)
        a._steps += 1
        if (a._steps - 1) % a.kv_every_steps == 0:
            every = a.free_run_every or (1 if self.alloc.num_blocks <= 4096 else 16)
            last = a.last_stats
            rescan = last is None or a._snapshots % every == 0
            a._snapshots += 1
            stats = hf_page_stats(cache, self.sched.active_requests, None if rescan else last.largest_free_run)
            a.last_stats = stats
            a.emit_kv(ts, stats, self.bytes_per_page, self.dtype)
            a.emit_prefix(ts)

    def first_scheduled(self, rid: str, state: Any, ts: int) -> None:
        """`rid` is in a forward for the first time since its (re)admission: its lookup counts now."""
        a, cache = self.a, self.cache
        a._scheduled.add(rid)
        queried, hit = a._lookup.pop(rid, (0, 0))
        # a re-prefill after a soft reset is not a prefix-cache query (nor its hits)
        if rid not in a._lost and cache.use_prefix_sharing:
            a.prefix.queried_tokens += queried
            a.prefix.hit_tokens += hit
        self.emit(rid, "scheduled", ts, cached_tokens=hit)
        looked = a._plookup.pop(rid, None)
        if looked is not None:
            a.probe.emit(PrefixLookup(looked[0], self.rank, short_id(rid), *looked[1:]))
        elif self.table is not None and not cache.use_prefix_sharing and rid not in a._lost:
            n = len(state.initial_tokens)
            a.probe.emit(PrefixLookup(ts, self.rank, short_id(rid), "disabled", self.page, n, 0, 0, 0, 0,
                                      math.nan, 0, 0))

    # --- outputs handed to the caller: tokens and ends ---

    def _update_batch(self, orig: Callable) -> Any:
        before = [(s, len(s.generated_tokens)) for s in list(self.sched.active_requests.values())]
        out = orig()
        self.a.guarded(self.after_update)(before)
        return out

    def after_update(self, before: list[tuple[Any, int]]) -> None:
        a, emit = self.a, self.emit
        ts = self.clock()
        for state, n0 in before:
            rid = state.request_id
            n1 = len(state.generated_tokens)
            if n1 > n0:
                emit(rid, "token", ts, tokens=n1 - n0)
                a._emitted[rid] = a._emitted.get(rid, 0) + (n1 - n0)
            status = state.status
            if status == self.finished and rid not in self.sched.active_requests:
                emit(rid, "finished", ts, tokens=a._emitted.pop(rid, 0))
                a._forget(rid)
            elif status == self.failed:
                emit(rid, "aborted", ts, tokens=a._emitted.pop(rid, 0))
                a._forget(rid)

    def _clear_cancelled_requests(self, orig: Callable) -> list:
        states = orig()
        ts = self.clock()
        for state in states:
            rid = state.request_id
            self.emit(rid, "cancelled", ts, tokens=self.a._emitted.pop(rid, 0))  # cancel_request: the client's
            self.a._forget(rid)
        return states

    # --- preemptions: CPU offload or soft reset ---

    def _offload_requests(self, orig: Callable) -> bool:
        before = set(self.sched.active_requests)
        out = orig()
        self.a.guarded(self.after_offload)(before)
        return out

    def after_offload(self, before: set[str]) -> None:
        a, sched = self.a, self.sched
        ts = self.clock()
        for rid in before - set(sched.active_requests):
            state = sched.waiting_requests.get(rid)
            if state is None:
                continue
            self.emit(rid, "preempted", ts)
            a._scheduled.discard(rid)
            computed = a._computed.get(rid, 0)
            if not getattr(state, "is_cpu_offloaded", False) and computed > 0:
                # soft reset: computed KV is gone and will be recomputed
                a._lost[rid] = max(computed, a._lost.get(rid, 0))
