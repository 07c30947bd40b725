"""The vLLM adapter's pure parts and guards (no vLLM needed): token split per step,
phase, guarded wrappers, the one-shot class catcher, the plugin switched off without
PHASESCOPE_AGENT. The real-vLLM checks are in test_vllm_integration.py."""

from __future__ import annotations

import sys

import pytest

from phasescope.agent.records.events import PHASE_DECODE, PHASE_IDLE, PHASE_MIXED, PHASE_PREFILL
from phasescope.agent.probe.adapters import vllm as adapter
from phasescope.agent.probe.adapters.vllm import common as vllm_common
from phasescope.agent.probe.adapters.vllm import wrappers as vllm_wrappers
from phasescope.agent.probe.adapters import vllm_plugin


@pytest.mark.parametrize("start,n,prompt,tokens,expected", [
    (0, 240, 240, 240, (240, 0)),  # whole prompt
    (192, 48, 240, 240, (48, 0)),  # the rest of a prompt after a prefix hit
    (0, 128, 240, 240, (128, 0)),  # first chunk of a chunked prefill
    (240, 1, 240, 241, (0, 1)),  # decode of the first output token
    (250, 1, 240, 251, (0, 1)),  # later decode
    (192, 64, 240, 256, (63, 1)),  # resumed after preemption: 63 recomputed, then the latest token decodes
])
def test_split_tokens(start, n, prompt, tokens, expected):
    assert adapter.split_tokens(start, n, prompt, tokens) == expected


def test_step_shape_phases_and_counts():
    assert adapter.step_shape([]) == (PHASE_IDLE, 0, 0, 0, 0)
    assert adapter.step_shape([(240, 0, 0), (48, 0, 192)]) == (PHASE_PREFILL, 2, 288, 0, 192)
    assert adapter.step_shape([(0, 1, 240), (0, 1, 250)]) == (PHASE_DECODE, 2, 0, 2, 490)
    assert adapter.step_shape([(100, 0, 0), (0, 1, 240)]) == (PHASE_MIXED, 2, 100, 1, 240)


class _Target:
    def __init__(self):
        self.calls = []

    def work(self, x, *, y=0):
        self.calls.append((x, y))
        return x + y


class _Probe:
    def __init__(self):
        self.errors = 0

    def _error(self, exc):
        self.errors += 1


def test_wrap_never_raises_into_the_host_and_returns_its_result():
    t, p = _Target(), _Probe()
    seen = []

    def boom(*a, **k):
        raise RuntimeError("adapter bug")

    assert adapter.wrap(t, "work", lambda r, *a, **k: seen.append(r), lambda: p, before=boom)
    assert t.work(2, y=3) == 5 and seen == [5] and p.errors == 1
    adapter.wrap(t, "work", boom, lambda: p)
    assert t.work(1) == 1 and p.errors == 3  # both layers of wrappers failed, the host did not notice
    assert t.calls == [(2, 3), (1, 0)]


def test_wrap_before_may_replace_the_arguments():
    class Pool:
        def free(self, blocks):
            return sum(blocks)

    pool, p, seen = Pool(), _Probe(), []
    # vLLM passes iterators: `before` copies them so the host and the hook both see every item
    adapter.wrap(pool, "free", lambda r, blocks: seen.append(list(blocks)), lambda: p,
                 before=lambda blocks: (list(blocks),))
    assert pool.free(iter([1, 2])) == 3 and seen == [[1, 2]] and p.errors == 0


def test_missing_internals_are_counted_not_raised():
    before = adapter.failures().get("no_such_method", 0)
    assert not adapter.wrap(_Target(), "no_such_method", lambda *a, **k: None, lambda: None)
    assert adapter.failures()["no_such_method"] == before + 1


def test_catch_first_wraps_once_then_puts_the_class_back():
    class Engine:
        def __init__(self, n):
            self.n = n

    original = Engine.__dict__["__init__"]
    caught = []
    adapter._catch_first(Engine, "__init__", lambda inst: caught.append(inst.n) or "hooks")
    assert Engine.__dict__["__init__"] is not original
    a = Engine(1)
    assert caught == [1] and Engine.__dict__["__init__"] is original
    Engine(2)
    assert caught == [1] and a.n == 1


def test_plugin_is_off_without_phasescope_agent(monkeypatch):
    monkeypatch.delenv("PHASESCOPE_AGENT", raising=False)
    assert not vllm_plugin.enabled()
    vllm_plugin.register()  # no-op, no vLLM import needed
    logger = vllm_plugin.StatLogger(vllm_config=None, engine_index=0)
    assert logger.probe is None
    logger.record(None, None)  # inert


def test_config_labels_from_a_config_shaped_object():
    class NS:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    cfg = NS(model_config=NS(hf_text_config=NS(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               hidden_size=128, intermediate_size=256, vocab_size=1024),
                             dtype="torch.float16", max_model_len=1024, enforce_eager=False),
             scheduler_config=NS(max_num_batched_tokens=512, max_num_seqs=8, enable_chunked_prefill=True,
                                 async_scheduling=False),
             cache_config=NS(block_size=16, enable_prefix_caching=True, cache_dtype="auto",
                             gpu_memory_utilization=0.9, num_gpu_blocks=None),
             parallel_config=NS(tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=1))
    labels = adapter.config_labels(cfg)
    assert labels["runtime"] == "vllm"
    assert (labels["model_layers"], labels["model_kv_heads"], labels["model_head_dim"]) == ("2", "2", "32")
    assert (labels["max_num_batched_tokens"], labels["max_num_seqs"], labels["block_size"], labels["tp"]) == (
        "512", "8", "16", "2")
    assert labels["model_dtype"] == "float16" and "num_gpu_blocks" not in labels


def test_engine_side_labels_leave_dp_to_the_api_server_unless_moe():
    from types import SimpleNamespace as NS

    def cfg(moe: bool):  # an EngineCore's config after vLLM's reconfigure_for_independent_dp_rank: DP size 1
        return NS(model_config=NS(hf_text_config=None, is_moe=moe), scheduler_config=None, cache_config=None,
                  parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1))

    assert adapter.config_labels(cfg(False))["dp"] == "1"  # what the engine's own config says
    assert "dp" not in adapter.engine_side_labels(cfg(False))  # so a dense model's engine does not label it
    assert adapter.engine_side_labels(cfg(True))["dp"] == "1"  # an MoE engine keeps its config's DP size


# --- the block-pool wrappers on a pool shaped like vLLM's (no vLLM needed) -------------------------

class _Block:
    def __init__(self, i: int) -> None:
        self.block_id, self.ref_cnt, self.block_hash, self.is_null = i, 0, None, i == 0
        self.next_free_block = None


class _Queue:
    """vLLM's FreeKVCacheBlockQueue as the adapter reads it: a count, append_n / prepend_n, a linked head."""

    def __init__(self, blocks: list) -> None:
        self.blocks = list(blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.blocks)

    def append_n(self, blocks: list) -> None:
        self.blocks.extend(blocks)

    def prepend_n(self, blocks: list) -> None:
        self.blocks[:0] = blocks

    @property
    def fake_free_list_head(self):
        from types import SimpleNamespace

        tail = SimpleNamespace(block_id=-1, block_hash=None, next_free_block=None)
        nxt = tail
        for b in reversed(self.blocks):
            b.next_free_block, nxt = nxt, b
        return SimpleNamespace(next_free_block=nxt)


class _Pool:
    """vLLM's BlockPool semantics: unhashed free pages ahead of hashed (cached) ones, eviction when a cached free
    page is handed out again, a prefix hit taking cached pages back (0.32's block_pool.py)."""

    def __init__(self, n: int) -> None:
        from types import SimpleNamespace

        self.blocks = [_Block(i) for i in range(n)]
        self.num_gpu_blocks = n
        self.enable_caching = True
        self.free_block_queue = _Queue(self.blocks[1:])
        self.cached_block_hash_to_block = SimpleNamespace(_cache={})

    def _maybe_evict_cached_block(self, b: _Block) -> bool:
        if b.block_hash is None:
            return False
        del self.cached_block_hash_to_block._cache[b.block_hash]
        b.block_hash = None
        return True

    def get_new_blocks(self, k: int) -> list:
        q = self.free_block_queue
        out, q.blocks = q.blocks[:k], q.blocks[k:]
        for b in out:
            self._maybe_evict_cached_block(b)
            b.ref_cnt += 1
        return out

    def touch(self, blocks: list) -> None:
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_block_queue.blocks.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, blocks) -> None:
        first, last = [], []
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                (first if b.block_hash is None else last).append(b)
        self.free_block_queue.prepend_n(first)
        self.free_block_queue.append_n(last)

    def cache(self, b: _Block, h: bytes) -> None:
        b.block_hash = h
        self.cached_block_hash_to_block._cache[h] = b


def _engine(monkeypatch, tmp_path, pool: _Pool, scheduled: object = None, schedule=None, update=None):
    """EngineHooks on a scheduler shaped like vLLM 0.24's (no record_prefix_cache_stats); its schedule() returns
    `scheduled` (or is `schedule`), its update_from_output is `update` if given."""
    from types import SimpleNamespace as NS

    monkeypatch.setenv("PHASESCOPE_AGENT", f"unix:{tmp_path}/none.sock")  # nothing listens: records are dropped
    monkeypatch.setenv("PHASESCOPE_PREFIX_TABLE_PAGES", "0")
    monkeypatch.setattr(vllm_common, "_CHANNELS", {})
    kvm = NS(block_pool=pool, enable_caching=True, get_computed_blocks=lambda req: ([], req.hits), free=lambda r: None,
             coordinator=NS(single_type_managers=[NS(block_size=16, req_to_blocks={})]))
    sched = NS(vllm_config=NS(), kv_cache_manager=kvm, requests={},
               kv_cache_config=NS(kv_cache_groups=[NS(kv_cache_spec=NS(page_size_bytes=1024, dtype="bf16"),
                                                      layer_names=["l0"])]),
               add_request=lambda r: None, schedule=schedule or (lambda: scheduled),
               update_from_output=update or (lambda o, so: {}),
               _preempt_request=lambda r, t: None, finish_requests=lambda ids, st: [])
    return adapter.EngineHooks(sched), sched, kvm


@pytest.mark.parametrize("page_sample", ["", "0"], ids=["lifecycles-on", "counts-only-fast-path"])
def test_cached_pages_kept_by_the_wrappers_equal_a_recount(monkeypatch, tmp_path, page_sample):
    monkeypatch.setenv("PHASESCOPE_PAGE_SAMPLE_EVERY", page_sample)  # "0" and no prefix table: the fast wrappers
    pool = _Pool(12)
    hooks, _, _ = _engine(monkeypatch, tmp_path, pool)
    try:
        # get_new_blocks: the one-frame counts (KvAccount._fast_new) while neither lifecycles nor the table need pages
        fast = pool.__dict__["get_new_blocks"].__code__.co_name == "get_new_blocks" and hooks.kv.life is None \
            and hooks.kv.table is None
        assert fast == (page_sample == "0")
        a = pool.get_new_blocks(4)
        for i, b in enumerate(a[:3]):
            pool.cache(b, bytes([i + 1]) * 8)
        pool.free_blocks(iter(a))  # 3 hashed pages stay cached, 1 is simply free
        assert hooks.cached == hooks._cached_pages() == 3
        pool.touch(a[:2])  # a prefix hit takes two back
        assert hooks.cached == hooks._cached_pages() == 1
        b = pool.get_new_blocks(8)  # the 8 unhashed free pages come first: nothing evicted
        assert hooks.evicted == 0 and hooks.cached == hooks._cached_pages() == 1
        c = pool.get_new_blocks(1)  # the last free page is the cached one: evicted
        assert hooks.evicted == 1 and hooks.cached == hooks._cached_pages() == 0
        kv = hooks.kv
        assert (kv.allocated, kv.freed) == (4 + 2 + 9, 4 - 1 + 1)  # pages taken and given back (a touch takes too)
        pool.free_blocks(a[:2] + b + c)
        assert hooks.cached == hooks._cached_pages() == 2
        assert kv.freed == 4 + 11 == kv.allocated and kv.refs == 0  # every page back: allocated - freed = used = 0
    finally:
        adapter.close_channels(0.1)


def test_vllm_024_lookup_through_get_computed_blocks(monkeypatch, tmp_path):
    from types import SimpleNamespace as NS

    hooks, _, kvm = _engine(monkeypatch, tmp_path, _Pool(4))
    try:
        kvm.get_computed_blocks(NS(request_id="a", num_tokens=100, hits=64, num_preemptions=0,
                                   skip_reading_prefix_cache=False))
        kvm.get_computed_blocks(NS(request_id="b", num_tokens=50, hits=0, num_preemptions=0,
                                   skip_reading_prefix_cache=True))  # vLLM skips it: no lookup
        assert (hooks.queried, hooks.hits) == (100, 64)
        # a resumed request that waits is looked up again each step: one recomputation, every lookup counted
        hooks.lost["c"] = 80
        for _ in range(3):
            kvm.get_computed_blocks(NS(request_id="c", num_tokens=90, hits=32, num_preemptions=1,
                                       skip_reading_prefix_cache=False))
        assert (hooks.resumed_queried, hooks.resumed_hits, hooks.recomputed) == (270, 96, 48)
    finally:
        adapter.close_channels(0.1)


def test_vllm_kernel_warmup_is_not_an_engine_step(monkeypatch, tmp_path):
    from types import SimpleNamespace as NS

    monkeypatch.setenv("PHASESCOPE_AGENT", f"unix:{tmp_path}/none.sock")
    monkeypatch.setattr(vllm_common, "_CHANNELS", {})
    worker = NS(vllm_config=NS(), rank=0, device=None, execute_model=lambda so: None, sample_tokens=lambda g: "out",
                model_runner=NS(get_model=lambda: NS(parameters=lambda: iter(()))))
    hooks = adapter.WorkerHooks(worker)

    def step(req_ids: list) -> None:
        so = NS(total_num_scheduled_tokens=16 * len(req_ids), num_scheduled_tokens={r: 16 for r in req_ids},
                finished_req_ids=set(), scheduled_new_reqs=[NS(req_id=r, prompt_token_ids=[1] * 16,
                                                               num_computed_tokens=0) for r in req_ids],
                scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[], num_output_tokens=[]))
        worker.execute_model(so)
        worker.sample_tokens(None)

    try:
        step([f"_warmup_{i}_" for i in range(4)])  # vLLM 0.24's warmup_kernels calls the worker's execute_model
        assert hooks.step_id == 0
        step(["req-1"])
        assert hooks.step_id == 1
    finally:
        adapter.close_channels(0.1)


def test_client_cancels_are_told_from_server_aborts(monkeypatch, tmp_path):
    """Issue 27 item 4: `finish_requests(ids, FINISHED_ABORTED)` is EngineCore.abort_requests (a client's hang-up
    or abort call): 'cancelled'; all at once (ids None: shutdown, pause) or FINISHED_ERROR: 'aborted'."""
    from types import SimpleNamespace as NS

    from phasescope.agent.records.events import REQ_ABORTED, REQ_CANCELLED

    hooks, _, _ = _engine(monkeypatch, tmp_path, _Pool(4))
    seen: list = []
    hooks._event = lambda ts, event, rid, tokens=0, cached=0: seen.append((event, rid))
    try:
        for rid in ("a", "b", "c"):
            hooks.out_tokens[rid] = 0
        hooks._after_finish_requests([NS(request_id="a")], ["a"], "RequestStatus.FINISHED_ABORTED")
        hooks._after_finish_requests([NS(request_id="b")], ["b"], "RequestStatus.FINISHED_ERROR")
        hooks._after_finish_requests([NS(request_id="c")], None, "RequestStatus.FINISHED_ABORTED")
        assert seen == [(REQ_CANCELLED, "a"), (REQ_ABORTED, "b"), (REQ_ABORTED, "c")]
        assert adapter._is_abort("FinishReason.ERROR") and adapter._is_abort("FinishReason.ABORT")
        assert not adapter._is_abort("FinishReason.STOP") and not adapter._is_abort("FinishReason.LENGTH")
    finally:
        adapter.close_channels(0.1)


def test_frontend_drops_outputs_of_already_aborted_requests(monkeypatch, tmp_path):
    """Issue 27 item 1: vLLM's OutputProcessor ignores outputs for a request it already aborted (no longer in
    request_states); counting them gave 572 generation tokens against vLLM's 571."""
    from types import SimpleNamespace as NS

    from phasescope.agent.records.events import REQ_TOKEN

    monkeypatch.setenv("PHASESCOPE_AGENT", f"unix:{tmp_path}/none.sock")
    monkeypatch.setattr(vllm_common, "_CHANNELS", {})
    processor = NS(request_states={"live": object()}, process_outputs=lambda outputs, *a, **k: None)
    hooks = adapter.FrontendHooks(processor)
    emitted: list = []
    hooks.probe._push = emitted.append  # the ring append the frontend uses
    try:
        processor.process_outputs([NS(request_id="live", new_token_ids=[5, 6], finish_reason=None),
                                   NS(request_id="gone", new_token_ids=[7], finish_reason=None)])
        tokens = [(r.request_id, r.tokens) for r in emitted if r.event == REQ_TOKEN]
        assert tokens == [(adapter.short_id("live"), 2)]
    finally:
        adapter.close_channels(0.1)


def test_readmission_split_equals_recomputed_tokens(monkeypatch, tmp_path):
    """Issue 27 item 7: one definition of recomputation. A request preempted after decoding holds KV for all
    its tokens but the latest sampled one (vLLM's num_computed_tokens is num_tokens - 1 then); its re-admission
    looks up num_tokens. The miss split's `readmission` and `recomputed_tokens` both count the dropped positions
    the cache did not give back (they were 1 token apart per re-admission)."""
    from types import SimpleNamespace as NS

    from phasescope.agent.probe.pagetrack import PrefixTable
    from phasescope.agent.read.queries import split_lookup
    from phasescope.agent.records.events import PrefixLookup

    hooks, sched, kvm = _engine(monkeypatch, tmp_path, _Pool(8))
    hooks.table = PrefixTable(16, lambda parent, tokens: 0, 64)
    emitted: list = []
    hooks._push = emitted.append  # the ring append the engine hooks use

    def req(n: int, preemptions: int, hits: int, computed: int = 0):
        return NS(request_id="r", num_tokens=n, hits=hits, num_preemptions=preemptions, num_computed_tokens=computed,
                  skip_reading_prefix_cache=False, block_hashes=[bytes([i + 1]) * 8 for i in range(n // 16)],
                  all_token_ids=list(range(n)))

    try:
        kvm.get_computed_blocks(req(40, 0, 0))
        sched._preempt_request(req(45, 0, 0, computed=44), 0.0)  # 5 tokens out, the 5th not yet computed
        kvm.get_computed_blocks(req(45, 1, 32))  # its first page came back from the cache
        kvm.get_computed_blocks(req(45, 1, 32))  # vLLM 0.24: looked up again while it waits: no recomputation
        looks = [r for r in emitted if isinstance(r, PrefixLookup)]
        assert [r.kind for r in looks] == ["first", "readmit", "readmit"]
        split = sum(split_lookup(r.kind, r.page_size_tokens, r.prompt_tokens, r.cacheable_tokens, r.hit_tokens,
                                 r.shared_tokens, r.evicted_tokens).get("readmission", 0) for r in looks)
        assert hooks.recomputed == split == 44 - 32
    finally:
        adapter.close_channels(0.1)


def test_output_iterations_skip_chunk_only_steps(monkeypatch, tmp_path):
    """Issue 27 item 6: vLLM's `iteration_tokens_total` counts EngineCoreOutputs batches holding outputs; a step
    that only prefills a chunk of a prompt produces none. The engine counts those iterations apart from steps."""
    from types import SimpleNamespace as NS

    from phasescope.agent.records.events import VLLM_OUTPUT_ITERATIONS, ServerMetric

    hooks, sched, _ = _engine(monkeypatch, tmp_path, _Pool(4))
    emitted: list = []
    hooks._push = emitted.append  # the ring append the engine hooks use
    outs = {"chunk": {}, "empty": {0: NS(outputs=[])},
            "token": {0: NS(outputs=[NS(request_id="a", new_token_ids=[7], finish_reason=None)])}}
    try:
        for kind in ("chunk", "token", "empty", "token"):
            sched.update_from_output = lambda so, mro, kind=kind: outs[kind]
            adapter.wrap(sched, "update_from_output", hooks._after_update, lambda: hooks.probe)
            sched.update_from_output(NS(total_num_scheduled_tokens=64), None)
            hooks._push_counters()  # what the probe's background wake calls (the counters where they moved)
        assert hooks._push_counters in hooks.probe.periodic
        assert hooks.steps == 4 and hooks.output_iterations == 2
        counter = [r.value for r in emitted if isinstance(r, ServerMetric) and r.name == VLLM_OUTPUT_ITERATIONS]
        assert counter == [1.0, 2.0]
    finally:
        adapter.close_channels(0.1)


def test_scheduler_seconds_count_vllms_own_time_in_the_step_calls(monkeypatch, tmp_path):
    """Issue 55, host-bound: the engine counts the seconds its thread spends inside vLLM's schedule() and
    update_from_output() (the probe's hooks after them not included), pushed as a counter where it moved."""
    import time
    from types import SimpleNamespace as NS

    from phasescope.agent.records.events import VLLM_SCHEDULER_SECONDS, ServerMetric

    so = NS(scheduled_new_reqs=[], total_num_scheduled_tokens=0,
            scheduled_cached_reqs=NS(resumed_req_ids=set(), req_ids=[], num_computed_tokens=[]))

    def schedule():
        time.sleep(0.02)
        return so

    def update(o, s):
        time.sleep(0.01)
        return {}

    hooks, sched, _ = _engine(monkeypatch, tmp_path, _Pool(4), schedule=schedule, update=update)
    emitted: list = []
    hooks._push = emitted.append
    try:
        t0 = time.perf_counter_ns()
        for _ in range(3):
            sched.update_from_output(sched.schedule(), None)
        wall = time.perf_counter_ns() - t0
        hooks._push_counters()
        hooks._push_counters()  # unchanged: nothing more pushed
        got = [r.value for r in emitted if isinstance(r, ServerMetric) and r.name == VLLM_SCHEDULER_SECONDS]
        assert len(got) == 1
        assert 0.09 <= got[0] <= wall / 1e9  # the sleeps inside vLLM's calls, never more than the calls' wall time
    finally:
        adapter.close_channels(0.1)


def test_frontend_token_events_carry_the_engine_output_stamp(monkeypatch, tmp_path):
    """Issue 27 item 3: process_outputs(outputs, engine_core_timestamp) (AsyncLLM positional, LLMEngine keyword):
    the token event's ts_ns - 1000 * cached_tokens is the EngineCore's stamp (monotonic s) to the nanosecond."""
    import time
    from types import SimpleNamespace as NS

    from phasescope.agent.records.events import REQ_TOKEN

    monkeypatch.setenv("PHASESCOPE_AGENT", f"unix:{tmp_path}/none.sock")
    monkeypatch.setattr(vllm_common, "_CHANNELS", {})
    processor = NS(request_states={"a": object()}, process_outputs=lambda outputs, *a, **k: None)
    hooks = adapter.FrontendHooks(processor)
    emitted: list = []
    hooks.probe._push = emitted.append  # the ring append the frontend uses
    try:
        stamp = time.monotonic() - 0.0123456789
        processor.process_outputs([NS(request_id="a", new_token_ids=[5], finish_reason=None)], stamp)
        processor.process_outputs([NS(request_id="a", new_token_ids=[6], finish_reason=None)],
                                  engine_core_timestamp=stamp + 0.005)
        processor.process_outputs([NS(request_id="a", new_token_ids=[7], finish_reason=None)])  # no stamp
        # vLLM's own frontend stamp (IterationStats.iteration_timestamp, wall s): TTFT and E2E end there
        its = time.time() - 0.25
        processor.process_outputs([NS(request_id="a", new_token_ids=[8], finish_reason=None)],
                                  engine_core_timestamp=time.monotonic() - 0.3, iteration_stats=NS(iteration_timestamp=its))
        tok = [r for r in emitted if r.event == REQ_TOKEN]
        assert [r.ts_ns - 1000 * r.cached_tokens for r in tok[:2]] == [int(stamp * 1e9), int((stamp + 0.005) * 1e9)]
        assert 12345 <= tok[0].cached_tokens <= 10**6 and tok[2].cached_tokens == 0
        want = int(its * 1e9) - (time.time_ns() - time.monotonic_ns())
        assert abs(tok[3].ts_ns - want) < 2_000_000 and 49_000 <= tok[3].cached_tokens <= 52_000  # 50 ms lead
    finally:
        adapter.close_channels(0.1)


def test_step_shaper_equals_the_per_request_split_without_walking_the_batch():
    """The O(admitted + prefilling) step shape equals split_tokens summed over every scheduled request (the
    definition), over chunked prefills, decodes, a prefix hit, a preemption and its re-prefill (vLLM 0.32's
    resumed_req_ids), and a finish."""
    from types import SimpleNamespace as NS

    def so(new, cached, resumed=(), finished=(), preempted=()):
        """new: [(rid, prompt_len, start, n)]; cached: [(rid, start, n, output_tokens)]."""
        nst = {r: n for r, _, _, n in new} | {r: n for r, _, n, _ in cached}
        return NS(num_scheduled_tokens=nst, total_num_scheduled_tokens=sum(nst.values()),
                  finished_req_ids=set(finished), preempted_req_ids=set(preempted),
                  scheduled_new_reqs=[NS(req_id=r, prompt_token_ids=[0] * p, num_computed_tokens=s)
                                      for r, p, s, _ in new],
                  scheduled_cached_reqs=NS(req_ids=[r for r, *_ in cached], resumed_req_ids=set(resumed),
                                           num_computed_tokens=[s for _, s, _, _ in cached],
                                           num_output_tokens=[o for *_, o in cached]))

    prompts = {"a": 300, "b": 40, "c": 64}

    def reference(new, cached):
        per = [(*adapter.split_tokens(s, n, p, p), s) for _, p, s, n in new]
        per += [(*adapter.split_tokens(s, n, prompts[r], prompts[r] + o), s) for r, s, n, o in cached]
        return adapter.step_shape(per)

    steps = [
        ([("a", 300, 0, 128), ("b", 40, 0, 40)], []),  # a's first chunk, b whole
        ([], [("a", 128, 128, 0), ("b", 40, 1, 1)]),  # a's second chunk, b decodes
        ([("c", 64, 32, 32)], [("a", 256, 44, 0), ("b", 41, 1, 2)]),  # c after a 32-token prefix hit, a's last chunk
        ([], [("a", 300, 1, 1), ("b", 42, 1, 3), ("c", 64, 1, 1)]),
        ([], [("a", 301, 1, 2), ("c", 65, 1, 2)]),  # b preempted (below), not scheduled
        ([], [("a", 302, 1, 3), ("b", 32, 11, 3), ("c", 66, 1, 3)]),  # b resumed: 32 back from the cache, 10 re-prefilled
        ([], [("a", 303, 1, 4), ("b", 43, 1, 4)]),  # c finished
    ]
    shaper = adapter.StepShaper()
    for i, (new, cached) in enumerate(steps):
        out = so(new, cached, resumed={"b"} if i == 5 else (), preempted={"b"} if i == 4 else (),
                 finished={"c"} if i == 6 else ())
        assert shaper.shape(out) == reference(new, cached), i
    assert shaper.prefilling == {}  # nothing left half-prefilled


def test_another_vllm_disarms_only_the_part_it_cannot_read(monkeypatch, tmp_path):
    """A vLLM whose block pool keeps no free count (internals renamed) and whose scheduler output has another shape:
    the KV accounting is disarmed and counted, the pool left unwrapped; lookups and lifecycles stay armed; a step
    this adapter cannot read is a counted probe error, and vLLM gets its own result back every time."""
    from types import SimpleNamespace as NS

    pool = _Pool(8)
    pool.free_block_queue = NS(blocks=[])  # no num_free_blocks: this vLLM counts its free pages elsewhere
    before = adapter.failures().get("block_pool", 0)
    odd = NS(other_layout=True)  # a scheduler output with none of the fields the adapter reads
    hooks, sched, kvm = _engine(monkeypatch, tmp_path, pool, scheduled=odd)
    try:
        assert hooks.kv is None and adapter.failures()["block_pool"] == before + 1
        assert not {"get_new_blocks", "touch", "free_blocks"} & set(pool.__dict__)  # vLLM's own methods, untouched
        kvm.get_computed_blocks(NS(request_id="a", num_tokens=100, hits=64, num_preemptions=0,
                                   skip_reading_prefix_cache=False))
        assert (hooks.queried, hooks.hits) == (100, 64)  # the prefix ledger is still armed
        sched.add_request(NS(request_id="a", num_prompt_tokens=100, arrival_time=None))
        assert "a" in hooks.out_tokens  # and the request lifecycle
        errors = hooks.probe.errors
        assert sched.schedule() is odd
        assert hooks.probe.errors == errors + 1
    finally:
        adapter.close_channels(0.1)



def test_budget_share_is_over_busy_time_not_the_gaps_between_steps():
    """The adapter's share is its hooks' time over the steps' busy time: 100 us of hooks in 1 ms steps is 10%,
    over budget, whether or not the engine then sat idle (or the host paused) 50 ms before its next step."""
    from phasescope.agent.probe.adapters.vllm.budget import SKIP_WINDOWS, WINDOW, Budget

    def run(gap_ns: int, with_end: bool) -> list:
        m, lows = vllm_common.Meter(4), []
        b = Budget(m, lambda level, why: lows.append(level), 0.005)
        now = 0
        for _ in range(4 * WINDOW * (SKIP_WINDOWS + 2) + 1):  # the last window closes at the next step
            b.step(now)
            if m.on:
                m.ns["schedule"] += 100_000
            now += 1_000_000
            if with_end:
                b.end(now)
            now += gap_ns
        return lows

    assert run(0, True) == run(50_000_000, True) == [1, 2]
    assert run(50_000_000, False) == []  # without end(): the gaps dilute the share under the budget


def test_attention_backend_read_inside_vllm_config_context(monkeypatch):
    """vLLM 0.24's FlashAttention reads its kernel block sizes from vLLM's *current* config, which is unset where
    the worker hooks run (one H100 run: `attention_backend` counted missing, `Current vLLM config is not set`): the
    read runs inside `set_current_vllm_config(cfg)`, and a config already current is left alone."""
    import contextlib
    import types

    from phasescope.agent.probe.adapters.vllm import worker as vllm_worker

    current = [None]

    @contextlib.contextmanager
    def set_current_vllm_config(cfg):
        old, current[0] = current[0], cfg
        try:
            yield
        finally:
            current[0] = old

    fake = types.ModuleType("vllm.config")
    fake.get_current_vllm_config_or_none = lambda: current[0]
    fake.set_current_vllm_config = set_current_vllm_config
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.config", fake)

    def block_sizes():
        if current[0] is None:
            raise AssertionError("Current vLLM config is not set")
        return [16, 32] if current[0] == "cfg" else [64]

    with vllm_worker._config_context("cfg"):
        assert block_sizes() == [16, 32]
    assert current[0] is None  # put back
    current[0] = "theirs"
    with vllm_worker._config_context("cfg"):
        assert block_sizes() == [64]  # vLLM's own context untouched
    monkeypatch.setitem(sys.modules, "vllm.config", None)  # a vLLM without it: a no-op
    with vllm_worker._config_context("cfg"):
        pass


@pytest.mark.parametrize("env,on_cuda,expect_cuda", [("0", True, False), ("1", True, True), ("0", False, False),
                                                      ("1", False, False)])
def test_worker_channel_honours_cuda_timing_setting(monkeypatch, tmp_path, env, on_cuda, expect_cuda):
    """PHASESCOPE_CUDA_TIMING=0 (documented: host timing only) reaches the vLLM worker's probe: on a CUDA device
    it is built without CUDA timing; with 1 it asks for it; on the CPU, set either way, it is passed once (here a
    stub Probe records what it was asked)."""
    monkeypatch.setenv("PHASESCOPE_AGENT", f"unix:{tmp_path}/none.sock")
    monkeypatch.setenv("PHASESCOPE_CUDA_TIMING", env)
    monkeypatch.setattr(vllm_common, "_CHANNELS", {})
    asked = {}

    class _Probe:
        def __init__(self, module, **kw):
            asked.update(kw)

        def label(self, **kw):  # channel() labels the failures earlier tests left counted
            pass

    monkeypatch.setattr(vllm_common, "Probe", _Probe)
    device = type("Dev", (), {"type": "cuda"})() if on_cuda else None
    vllm_common.channel("worker", 0, 1, "m", {}, device=device)
    assert asked["cuda_timing"] is expect_cuda
    assert asked["device"] is (device if expect_cuda else None)


def test_a_benchmark_pause_gives_vllm_its_own_methods_back_and_resumes_in_step(monkeypatch, tmp_path):
    """pause.set_paused (the GPU harness's one-engine A/B): paused, every attribute the adapter wrapped holds what
    it held before (the pool's twice-wrapped get_new_blocks included) and nothing is counted; resumed, the same
    wrappers are back, the KV counts re-synced from a walk (not a cross-check miss), and the store is told."""
    from phasescope.agent.probe.adapters.vllm import pause

    monkeypatch.setattr(vllm_wrappers, "WRAPPERS", [])
    monkeypatch.setattr(vllm_wrappers, "ON_RESUME", [])
    monkeypatch.setenv("PHASESCOPE_PAGE_SAMPLE_EVERY", "0")
    pool = _Pool(12)
    before_pool = dict(vars(pool))
    hooks, sched, kvm = _engine(monkeypatch, tmp_path, pool)
    try:
        assert {n for o, n, *_ in vllm_wrappers.WRAPPERS if o is pool} == {"get_new_blocks", "touch", "free_blocks"}
        armed = {(id(o), n): getattr(o, n) for o, n, *_ in vllm_wrappers.WRAPPERS}
        labels = []
        monkeypatch.setattr(hooks.probe, "label", lambda **kw: labels.append(kw))
        monkeypatch.setattr(pause, "_PROBES", [hooks.probe])  # as pause.watch would have it

        out = pause.set_paused(True)
        assert out["paused"] == ["engine", "frontend", "worker"]
        assert out["wrappers"] == len(armed) + 1  # the pool's fast get_new_blocks: twice
        assert vars(pool) == before_pool  # the pool's own methods: no instance attribute left
        assert not hasattr(sched.schedule, "__wrapped__") and not hasattr(kvm.free, "__wrapped__")
        a = pool.get_new_blocks(4)
        pool.cache(a[0], b"x" * 8)
        pool.free_blocks(iter(a))  # vLLM works on; the adapter sees nothing
        assert (hooks.kv.allocated, hooks.kv.freed, hooks.cached) == (0, 0, 0)
        assert labels and "1 pauses" in labels[-1]["adapter_paused"]
        assert pause.set_paused(True)["wrappers"] == 0  # already off: nothing changes

        out = pause.set_paused(False)
        assert out["wrappers"] == len(armed) + 1 and not out["paused"]
        assert {(id(o), n): getattr(o, n) for o, n, *_ in vllm_wrappers.WRAPPERS} == armed
        assert hooks.cached == hooks._cached_pages() == 1 and hooks.kv.recount_off == 0  # re-synced by a walk
        b = pool.get_new_blocks(2)  # counted again, through the same fast wrapper
        assert hooks.kv.allocated == 2 and pool.get_new_blocks is armed[(id(pool), "get_new_blocks")]
        pool.free_blocks(iter(b))
        assert hooks.kv.freed == 2
    finally:
        adapter.close_channels(0.1)


def test_a_pause_file_is_followed_from_the_wake_and_acknowledged(monkeypatch, tmp_path):
    """PHASESCOPE_BENCH_PAUSE_FILE (the toggle phase's switch across processes): the wake's callback pauses every
    role while the file exists empty, the roles it names when it names some (an ablation), resumes when it is
    gone, and says so in `<file>.ack.<pid>`; unset, nothing is watched."""
    import json
    import threading
    import os
    from types import SimpleNamespace as NS

    from phasescope.agent.probe.adapters.vllm import pause

    obj = NS(run=lambda: "vllm's", step=lambda: "vllm's step")
    monkeypatch.setattr(vllm_wrappers, "WRAPPERS", [])
    monkeypatch.setattr(pause, "_PROBES", [])
    vllm_wrappers.hook(obj, "run", lambda: "ours")
    vllm_wrappers.hook(obj, "step", lambda: "our step", "worker")
    with pytest.raises(ValueError):
        vllm_wrappers.hook(obj, "other", lambda: None, "gpu")
    monkeypatch.setattr(pause, "_WATCHED", [False])
    monkeypatch.delenv(pause.ENV_PAUSE_FILE, raising=False)
    probe = NS(periodic=[], label=lambda **kw: None)
    pause.watch(probe)
    assert probe.periodic == []  # unset: no callback, no cost
    flag = tmp_path / "paused"
    monkeypatch.setenv(pause.ENV_PAUSE_FILE, str(flag))
    pause.watch(probe)
    pause.watch(probe)  # once per process
    assert len(probe.periodic) == 1
    follow, ack = probe.periodic[0], tmp_path / f"paused.ack.{os.getpid()}"
    follow()
    got = json.loads(ack.read_text())
    live = {t.native_id for t in threading.enumerate() if t.name == "phasescope-flush"}
    assert set(got.pop("threads")) <= live  # the probes' background threads of this process (none of ours here)
    assert got == {"wrappers": 0, "paused": [], "pauses": pause._PAUSES[0],
                   "pid": os.getpid()} and (obj.run(), obj.step()) == ("ours", "our step")
    flag.touch()
    follow()
    assert json.loads(ack.read_text())["paused"] == ["engine", "frontend", "worker"]
    assert (obj.run(), obj.step()) == ("vllm's", "vllm's step")
    flag.write_text("worker")  # the worker's alone: the engine's back on
    follow()
    assert json.loads(ack.read_text())["paused"] == ["worker"] and (obj.run(), obj.step()) == ("ours", "vllm's step")
    flag.unlink()
    follow()
    assert json.loads(ack.read_text())["paused"] == [] and json.loads(ack.read_text())["wrappers"] == 1
    assert (obj.run(), obj.step()) == ("ours", "our step")
    with pytest.raises(ValueError):
        pause.set_paused("gpu")
