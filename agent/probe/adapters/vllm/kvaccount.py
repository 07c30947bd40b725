"""KV accounting of one vLLM engine (EngineCore process): paged-KV figures kept incrementally from the block pool's
own counts, and a full walk of the block tables now and then as a cross-check.

Per step (`snapshot`, O(1)): used pages = total - the pool's free count; cached pages, pages allocated and freed,
and live tokens are kept by wrappers whose work is O(1) per call:
- `free_blocks` (a request finished or was preempted): the pool's free count before and after gives the pages
  freed; `free_block_queue.append_n` (hashed pages that stay cached) gives the cached ones;
- `touch` (a prefix hit takes pages, some back from the cache): the free count's drop is the cached pages reused;
- `get_new_blocks`: the hash map's size before and after gives the cached pages it evicted (their hashes and ids,
  for the prefix table and the sampled page lifecycles, are read off the free queue's head only when an eviction
  is certain: vLLM keeps unhashed free pages ahead of hashed ones);
- `kv_cache_manager.free(request)`: the request's computed tokens leave the live sum.
Each method gets one wrapper (`_install`): the counts inline around vLLM's call, made once; per-page work (the
eviction peek, the sampled lifecycles) only while page lifecycles or the prefix table are on (the budget's levels 1
and 3 turn them off). Live tokens = Σ computed tokens of the requests holding pages - P x (references - used pages): a page shared by k
requests is counted once. `allocated_total - freed_total = used` holds on every snapshot.

The walk (`walk`, O(used pages)) recomputes everything from the block tables; where the kept figures differ, the
walk's win and the difference is counted (`kv_recount_off` label). Shared pages and the largest free run come only
from the walk (the latest one, the free run never above the free pages now).
"""

from __future__ import annotations

import operator
import time
from typing import Any, Callable

from ....records.events import KVSnapshot
from ....records.kvmath import PageStats
from ...pagetrack import PageLife, PrefixTable
from .common import Meter, fail, hook
from .kvwalk import cached_pages, pool_stats

_perf = time.perf_counter_ns
_new = tuple.__new__
ENV_PAGE_SAMPLE = "PHASESCOPE_PAGE_SAMPLE_EVERY"  # follow one KV page id in N (0: no PageEvents; default ~1024 pages)


class KvAccount:
    """Incremental page accounting of one block pool (see the module docstring)."""

    def __init__(self, scheduler: Any, kvm: Any, probe_ref: Callable[[], Any], meter: Meter, rank0: int,
                 page_sample_every: str) -> None:
        self.sched = scheduler
        self.kvm = kvm
        self.pool = kvm.block_pool
        self.manager = kvm.coordinator.single_type_managers[0]
        self.page_size = int(self.manager.block_size)
        group = scheduler.kv_cache_config.kv_cache_groups[0]
        self.page_bytes = int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
        self.kv_dtype = str(getattr(group.kv_cache_spec, "dtype", "")).replace("torch.", "")[:12]
        self.total = self.pool.num_gpu_blocks - 1  # block 0 is the null block
        self.free_queue = self.pool.free_block_queue
        int(self.free_queue.num_free_blocks)  # read unguarded by the fast paths: another vLLM fails here (counted)
        hm = self.pool.cached_block_hash_to_block
        self._hashes = hm.__len__ if hasattr(type(hm), "__len__") else hm._cache.__len__  # cached hashes now
        self.caching = bool(getattr(self.pool, "enable_caching", True))
        self.table: PrefixTable | None = None  # set by the engine: evictions mark the hashes they drop
        every = int(page_sample_every) if page_sample_every.strip() else max(1, -(-self.total // 1024))
        self.life = PageLife(probe_ref().emit, rank0, every) if every > 0 else None
        self.allocated = self.freed = self.evicted = 0
        self.cached = self.cached_pages()  # hashed pages no request references (evictable)
        self.refs = 0  # page references held by requests (Σ ref_cnt of the non-null pages)
        self.computed = 0  # Σ computed tokens of the requests holding pages
        self.shared = self.shared_refs = 0  # from the latest walk
        self.free_run = self.total
        self.walks = 0
        self.recount_off = 0
        self._meter = meter
        self._probe_ref = probe_ref
        self._install(self.pool, "get_new_blocks", self._hook_new)
        self._fast_new()
        self._install(self.pool, "touch", self._hook_touch)
        self._install(self.pool, "free_blocks", self._hook_free)
        self._install(self.free_queue, "append_n", self._hook_append)
        self._install(kvm, "free", self._hook_request_free)

    def _install(self, obj: Any, name: str, counts: Callable[..., Any]) -> None:
        """Replace `obj.name` by `counts(original, *args)`: the counts in one Python frame around vLLM's call, made
        exactly once; the hooks guard their own work, never vLLM's. On a measured step (Meter) the hook's time less
        vLLM's call is added to the meter's "kv_pool". A call with keywords (not vLLM's way) goes to vLLM unhooked
        and is counted as a probe error. A method this vLLM lacks: counted, not hooked."""
        try:
            original = getattr(obj, name)
        except AttributeError as exc:
            fail(name, exc)
            return
        meter = self._meter

        def hooked(*args: Any, **kw: Any) -> Any:
            if kw or not args:
                self._error(TypeError(f"{name} called with keywords: not counted"))
                return original(*args, **kw)
            if not meter.on:
                return counts(original, *args)
            inner = [0]

            def timed(*a: Any) -> Any:
                t = _perf()
                try:
                    return original(*a)
                finally:
                    inner[0] += _perf() - t

            t0 = _perf()
            result = counts(timed, *args)
            meter.ns["kv_pool"] += _perf() - t0 - inner[0]
            return result

        hooked.__wrapped__ = original  # type: ignore[attr-defined]
        hook(obj, name, hooked)

    def _fast_new(self) -> None:
        """`get_new_blocks` is the pool call made most (~17 a step at batch 256): while neither page lifecycles
        nor the prefix table need its pages (the budget's levels 1 and 3) and the step is not measured, its counts
        run in one frame around vLLM's call; otherwise the full hook above."""
        pool = self.pool
        full = getattr(pool, "get_new_blocks", None)  # our hook, if installed (never pool.__dict__: shadow.py)
        original = getattr(full, "__wrapped__", None)
        if original is None:  # not hooked (another vLLM): nothing to speed up
            return
        hashes, meter = self._hashes, self._meter

        def get_new_blocks(n: int, *a: Any, **kw: Any) -> Any:
            if kw or meter.on or self.table is not None or self.life is not None:
                return full(n, *a, **kw)
            h0 = hashes()
            blocks = original(n, *a)
            try:
                gone = h0 - hashes()  # cached pages popped from the free queue are evicted
                self.allocated += n
                self.refs += n
                if gone > 0:
                    self.evicted += gone
                    self.cached -= gone
            except Exception as exc:  # noqa: BLE001 - never into vLLM
                self._error(exc)
            return blocks

        get_new_blocks.__wrapped__ = original  # type: ignore[attr-defined]
        hook(pool, "get_new_blocks", get_new_blocks)

    def _error(self, exc: BaseException) -> None:
        p = self._probe_ref()
        if p is not None:
            p._error(exc)
        else:
            fail("hook", exc)

    # --- the hooks: O(1) counts per call; per-page work only while page lifecycles or the prefix table are on --
    def _free_count(self) -> int:
        return self.free_queue.num_free_blocks

    def _hook_new(self, original: Callable, n: int, *a: Any) -> Any:
        h0 = self._hashes()
        peek = None
        if self.table is not None or self.life is not None:
            try:
                peek = self._peek_evictions(n)
            except Exception as exc:  # noqa: BLE001 - never into vLLM
                self._error(exc)
        blocks = original(n, *a)
        try:
            gone = h0 - self._hashes()  # cached pages popped from the free queue are evicted
            self.allocated += n
            self.refs += n
            if gone > 0:
                self.evicted += gone
                self.cached -= gone
            if peek or self.life is not None:
                self._note_new(blocks, peek)
        except Exception as exc:  # noqa: BLE001
            self._error(exc)
        return blocks

    def _peek_evictions(self, n: int) -> list[tuple[int, Any]]:
        """(block id, hash) of the cached pages `get_new_blocks(n)` is about to evict: vLLM pops the free queue's
        head and keeps unhashed free pages ahead of hashed ones, so there are some only when n exceeds those."""
        out: list[tuple[int, Any]] = []
        if n <= self._free_count() - self.cached:
            return out
        head = getattr(self.free_queue, "fake_free_list_head", None)  # another vLLM: no peek, counts still kept
        block = head.next_free_block if head is not None else None
        for _ in range(n):
            if block is None or block.next_free_block is None:  # vLLM's fake tail: the queue's end
                break
            if block.block_hash is not None:
                out.append((block.block_id, block.block_hash))
            block = block.next_free_block
        return out

    def _note_new(self, blocks: Any, peek: list | None) -> None:
        now = time.monotonic_ns()
        if peek:
            if self.table is not None:
                self.table.mark_evicted([bytes(h[:-4]) for _, h in peek], now)
            if self.life is not None:
                self.life.evicted([i for i, _ in peek], now)
        if self.life is not None:
            self.life.allocated([b.block_id for b in blocks], now)

    def _hook_touch(self, original: Callable, blocks: Any, *a: Any) -> Any:
        f0 = self._free_count()
        if self.life is not None:
            try:
                idle = [b.block_id for b in blocks if b.ref_cnt == 0 and not b.is_null]
                if idle:
                    self.life.reused(idle, time.monotonic_ns())
            except Exception as exc:  # noqa: BLE001
                self._error(exc)
        result = original(blocks, *a)
        try:
            taken = f0 - self._free_count()  # cached pages a prefix hit took back from the free queue
            self.allocated += taken
            self.cached -= taken
            self.refs += len(blocks)
        except Exception as exc:  # noqa: BLE001
            self._error(exc)
        return result

    def _hook_free(self, original: Callable, ordered: Any, *a: Any) -> Any:
        life = self.life
        n = -1 if life is not None else operator.length_hint(ordered, -1)  # vLLM passes reversed(list): free
        if n < 0:  # lifecycles need the pages after the call, or an iterator that cannot say: copy it (both see all)
            ordered = list(ordered)
            n = sum(1 for b in ordered if not getattr(b, "is_null", False))
        f0 = self._free_count()
        result = original(ordered, *a)
        try:
            self.freed += self._free_count() - f0
            self.refs -= n
            if life is not None:
                now = time.monotonic_ns()
                idle = [b for b in ordered if b.ref_cnt == 0 and not b.is_null]
                life.cached([b.block_id for b in idle if b.block_hash is not None], now)
                life.freed([b.block_id for b in idle if b.block_hash is None], now)
        except Exception as exc:  # noqa: BLE001
            self._error(exc)
        return result

    def _hook_append(self, original: Callable, blocks: Any, *a: Any) -> Any:
        if self.caching:  # free_blocks appends the hashed pages it frees (they stay cached); the rest go first
            try:
                self.cached += len(blocks)
            except Exception as exc:  # noqa: BLE001
                self._error(exc)
        return original(blocks, *a)

    def _hook_request_free(self, original: Callable, request: Any, *a: Any) -> Any:
        try:
            self.computed -= int(request.num_computed_tokens)
        except Exception as exc:  # noqa: BLE001
            self._error(exc)
        return original(request, *a)

    def admitted(self, computed_tokens: int) -> None:
        """A request (new or resumed) was scheduled holding `computed_tokens` tokens of KV before this step."""
        self.computed += computed_tokens

    # --- records --------------------------------------------------------------------------------------------
    def snapshot(self, now: int, rank: int) -> KVSnapshot:
        """This step's KV snapshot of one rank, from the kept counts (O(1))."""
        free = self._free_count()
        used = self.total - free
        P = self.page_size
        live = self.computed - P * (self.refs - used)
        live = 0 if live < 0 else min(live, used * P)
        # tuple.__new__: the record without the namedtuple's Python-level __new__ frame (~0.2 us a step)
        return _new(KVSnapshot, (now, rank, P, self.total, used, free, self.cached, self.shared, self.shared_refs,
                                 len(self.manager.req_to_blocks), live, min(self.free_run, free), self.freed + used,
                                 self.freed, used * self.page_bytes, self.kv_dtype))

    def walk(self) -> PageStats:
        """Every figure from the block tables (O(used pages)); the kept counts are corrected to it."""
        stats = pool_stats(self.pool, self.manager.req_to_blocks, self.sched.requests, self.page_size,
                           self.cached_pages())
        self.walks += 1
        refs = stats.used_pages + stats.shared_refs - stats.shared_pages
        computed = stats.live_tokens + self.page_size * (refs - stats.used_pages)
        off = (stats.cached_pages != self.cached) + (refs != self.refs) + (computed != self.computed)
        if off:
            self.recount_off += 1
        self.cached, self.refs, self.computed = stats.cached_pages, refs, computed
        self.shared, self.shared_refs, self.free_run = stats.shared_pages, stats.shared_refs, stats.largest_free_run
        return stats

    def cached_pages(self) -> int:
        return cached_pages(self.pool)


def make(scheduler: Any, probe_ref: Callable[[], Any], meter: Meter, rank0: int, page_sample_every: str
         ) -> KvAccount | None:
    """The engine's KV accounting, or None (counted) where this vLLM's block pool is not what it knows."""
    try:
        return KvAccount(scheduler, scheduler.kv_cache_manager, probe_ref, meter, rank0, page_sample_every)
    except Exception as exc:  # noqa: BLE001 - another vLLM: no KV figures, vLLM runs on
        fail("block_pool", exc)
        return None
