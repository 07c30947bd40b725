"""HF continuous batching on a real random-weight Llama (CPU): lifecycle, paged KV, prefix cache.

The KV figures are checked against an oracle written here, independently of
phasescope.agent.records.kvmath, from the cache's own block table, ledger and pool at the
same instant (a forward pre-hook of the test's own, which runs right after the
adapter's snapshot and before any cache change).
"""

from __future__ import annotations

import bisect
import sys
import threading
import time
from collections import Counter, defaultdict

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

from phasescope.agent import attach  # noqa: E402
from phasescope.agent.records import kvmath  # noqa: E402
from phasescope.agent.probe.adapters.hf_cb import HFContinuousBatching  # noqa: E402
from phasescope.agent.records.events import REQUEST_EVENTS, KVSnapshot, PrefixCounters, RequestEvent, Step  # noqa: E402

PAGE = 32
SYSTEM = list(range(2, 2 + 2 * PAGE))  # a 2-page shared prefix


def _oracle(manager) -> dict:
    """Page accounting straight from the runtime's structures (no phasescope code)."""
    bp = manager.batch_processor
    cache, active = bp.cache, bp.scheduler.active_requests
    alloc = cache.cache_allocators["full_attention"]
    refs = Counter(b for table in alloc.block_table.values() for b in table)
    shared_extra = sum(r - 1 for r in refs.values())  # shared pages are full pages
    live = sum(active[rid].position_offset for rid in alloc.block_table if rid in active) - shared_extra * PAGE
    pool = cache.pool
    free = set(b for tree in pool._free_blocks[alloc.index].trees.values() for b in tree)
    bps = alloc.blocks_per_sector
    for s in pool.free_sectors:
        free.update(range(s * bps, (s + 1) * bps))
    best = 0
    for b in free:  # a run starts where b-1 is not free
        if b - 1 not in free:
            n = 1
            while b + n in free:
                n += 1
            best = max(best, n)
    return dict(total=alloc.num_blocks, used=len(refs), free=len(free), cached=len(alloc.ledger.cached_blocks),
                live=live, run=best, shared=sum(1 for r in refs.values() if r > 1))


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0, eos_token_id=None)
    return transformers.LlamaForCausalLM(cfg).eval()


def _run(model, prompts, max_new_tokens, num_blocks, *, probe=True, oracle=None, gap_s=0.0, wait_first=False):
    """Serve `prompts` through a manager; returns (records, outputs, oracle snapshots)."""
    records: list = []
    p = attach(model, sink=records.extend, runtime="hf-cb") if probe else None
    adapter = HFContinuousBatching(p).instrument_model(model) if probe else None
    snaps: list = []
    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1)
    cbc = ContinuousBatchingConfig(num_blocks=num_blocks, page_size=PAGE, max_batch_tokens=256)
    manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
    hook = model.register_forward_pre_hook(lambda m, a: snaps.append(_oracle(manager))) if oracle else None
    manager.start()
    outputs = {}
    try:
        rids = []
        for i, prompt in enumerate(prompts):
            rids.append(manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=max_new_tokens))
            if wait_first and i == 0:
                r = manager.get_result(request_id="r0", timeout=60)
                while r is not None and not r.is_finished():
                    r = manager.get_result(request_id="r0", timeout=60)
                outputs["r0"] = r
            time.sleep(gap_s)
        deadline = time.monotonic() + 120
        while len(outputs) < len(prompts) and time.monotonic() < deadline:
            r = manager.get_result(timeout=5)
            if r is not None and r.is_finished():
                outputs[r.request_id] = r
    finally:
        manager.stop(block=True, timeout=30)
        if hook:
            hook.remove()
        if adapter:
            adapter.detach()
        if p:
            p.close()
    return records, outputs, snaps


@pytest.mark.slow
def test_kv_figures_equal_the_cache_ledger_under_preemption_and_sharing():
    model = _model()
    prompts = [SYSTEM + [100 + i] * (10 + 9 * i) for i in range(5)]
    # 10 pages of 32 tokens cannot hold 5 requests growing by 60 tokens: preemption and eviction
    records, outputs, snaps = _run(model, prompts, max_new_tokens=60, num_blocks=10, oracle=True)
    assert len(outputs) == 5 and all(len(o.generated_tokens) == 60 for o in outputs.values())
    kv = [r for r in records if type(r) is KVSnapshot]
    steps = [r for r in records if type(r) is Step]
    assert len(kv) == len(snaps) == len(steps) > 60  # one snapshot per forward
    for got, want in zip(kv, snaps):
        assert (got.total_pages, got.used_pages, got.free_pages, got.cached_pages, got.live_tokens,
                got.largest_free_run, got.shared_pages) == (
            want["total"], want["used"], want["free"], want["cached"], want["live"], want["run"], want["shared"])
        assert got.used_pages + got.free_pages + got.cached_pages == got.total_pages
        # derived figures, exactly as docs/definitions.md defines them
        assert kvmath.block_usage(got.used_pages, got.total_pages) == want["used"] / want["total"]
        if want["used"]:
            assert kvmath.internal_fragmentation(got.live_tokens, got.used_pages, PAGE) == \
                1 - want["live"] / (want["used"] * PAGE)
        if want["free"]:
            assert kvmath.external_fragmentation(got.largest_free_run, got.free_pages) == \
                1 - want["run"] / want["free"]
    assert max(k.used_pages for k in kv) == 10  # the cache filled up
    events = Counter(REQUEST_EVENTS[r.event] for r in records if type(r) is RequestEvent)
    assert events["preempted"] > 0 and events["finished"] == 5 and events["arrival"] == 5
    assert events["token"] == 5 * 60
    prefix = [r for r in records if type(r) is PrefixCounters][-1]
    assert prefix.recomputed_tokens_total > 0 and prefix.evicted_blocks_total > 0
    # every prompt is a prefix-cache query once; re-prefills after preemption are recomputation, apart
    assert prefix.queried_tokens_total == sum(len(p) for p in prompts)
    prefilled = sum(s.prefill_tokens for s in steps)
    first_time = prefix.queried_tokens_total - prefix.hit_tokens_total
    # what is left is the last sampled token of each reset request: new, never computed before
    assert 0 <= prefilled - first_time - prefix.recomputed_tokens_total <= events["preempted"]
    assert kv[-1].pages_allocated_total > 0 and kv[-1].pages_freed_total > 0

    # the probe does not change what is generated
    _, plain, _ = _run(model, prompts, max_new_tokens=60, num_blocks=10, probe=False)
    assert {k: v.generated_tokens for k, v in plain.items()} == {k: v.generated_tokens for k, v in outputs.items()}


@pytest.mark.slow
def test_shared_two_page_prefix_gives_the_expected_hits():
    model = _model()
    prompts = [SYSTEM + [300 + i, 301 + i, 302 + i] for i in range(4)]
    records, outputs, _ = _run(model, prompts, max_new_tokens=4, num_blocks=32, wait_first=True)
    assert len(outputs) == 4
    sched = {r.request_id: r.cached_tokens for r in records
             if type(r) is RequestEvent and REQUEST_EVENTS[r.event] == "scheduled"}
    assert sched == {"r0": 0, "r1": 2 * PAGE, "r2": 2 * PAGE, "r3": 2 * PAGE}
    prefix = [r for r in records if type(r) is PrefixCounters][-1]
    assert prefix.queried_tokens_total == sum(len(p) for p in prompts)
    assert prefix.hit_tokens_total == 3 * 2 * PAGE
    assert prefix.recomputed_tokens_total == 0
    # the first step after r1..r3 are admitted shows the prefix pages shared by all four
    assert max(r.shared_pages for r in records if type(r) is KVSnapshot) == 2


@pytest.mark.slow
def test_ttft_and_tpot_agree_with_the_runtimes_own_clock_within_1ms():
    """The runtime's own timestamps (record_timestamps: perf_counter at request creation and at each
    token, CLOCK_MONOTONIC like the probe's) are the reference. The caller's clock is not: it receives
    each output through a queue on another thread, late by that thread's wake-up on a busy machine."""
    model = _model()
    records: list = []
    p = attach(model, sink=records.extend, runtime="hf-cb")
    adapter = HFContinuousBatching(p).instrument_model(model)
    gc = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=-1)
    cbc = ContinuousBatchingConfig(num_blocks=64, page_size=PAGE, max_batch_tokens=256)
    manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
    received: dict[str, list[tuple[int, int]]] = defaultdict(list)
    final: dict[str, object] = {}
    sent: dict[str, int] = {}
    returned: dict[str, int] = {}
    old_switch, old_threads = sys.getswitchinterval(), torch.get_num_threads()
    sys.setswitchinterval(1e-4)  # let the receiving thread run as soon as an output is delivered
    torch.set_num_threads(1)  # and leave it a core: spinning intra-op threads would starve it on 2 cores

    def consume(n):
        done = 0
        while done < n:
            r = manager.get_result(timeout=30)
            if r is None:
                return
            received[r.request_id].append((time.monotonic_ns(), len(r.generated_tokens)))
            if r.is_finished():
                final[r.request_id] = r
                done += 1

    prompts = [SYSTEM[: 20 + 10 * i] for i in range(4)]
    consumer = threading.Thread(target=consume, args=(len(prompts),))
    manager.start()
    consumer.start()
    try:
        for i, prompt in enumerate(prompts):
            sent[f"q{i}"] = time.monotonic_ns()
            manager.add_request(prompt, request_id=f"q{i}", max_new_tokens=12, streaming=True,
                                record_timestamps=True)
            returned[f"q{i}"] = time.monotonic_ns()
            time.sleep(0.03)
        consumer.join(60)
    finally:
        sys.setswitchinterval(old_switch)
        torch.set_num_threads(old_threads)
        manager.stop(block=True, timeout=30)
        adapter.detach()
        p.close()
    ev = defaultdict(list)
    for r in records:
        if type(r) is RequestEvent:
            ev[r.request_id].append(r)
    # Each probe stamp is bracketed, on the one clock, by events of the same run, so the check holds however
    # busy the machine is: an arrival inside the add_request call that made it (as the runtime's creation stamp
    # is), a token at or after the runtime's own stamp and before the next forward starts (the probe stamps
    # when update_batch returns, after the runtime has stamped every token of the step). TTFT and TPOT then
    # agree with the runtime's within 1 ms plus those measured brackets (on an idle machine, well under 1 ms).
    starts = sorted(r.ts_ns for r in records if type(r) is Step)
    for rid, t_sent in sent.items():
        got = received[rid]
        assert got[-1][1] == 12
        mine = ev[rid]
        arrival = next(r.ts_ns for r in mine if REQUEST_EVENTS[r.event] == "arrival")
        tokens = [r.ts_ns for r in mine if REQUEST_EVENTS[r.event] == "token"]
        assert len(tokens) == 12
        runtime = final[rid]
        assert len(runtime.timestamps) == 12
        created = runtime.created_time * 1e9
        call = returned[rid] - t_sent
        assert t_sent <= arrival <= returned[rid] and t_sent - 1e5 <= created <= returned[rid] + 1e5, rid
        lag = []  # per token: from the runtime's stamp to the next forward's start (the latest the probe may stamp)
        for t, rt in zip(tokens, runtime.timestamps):
            rt_ns = rt * 1e9
            nxt = starts[bisect.bisect_right(starts, rt_ns)] if bisect.bisect_right(starts, rt_ns) < len(starts) \
                else returned[rid] + 60e9
            assert rt_ns - 1e5 <= t <= nxt, (rid, t, rt_ns, nxt)  # 0.1 ms slack: perf_counter as float seconds
            lag.append(nxt - rt_ns)
        ttft_probe = tokens[0] - arrival
        ttft_runtime = (runtime.timestamps[0] - runtime.created_time) * 1e9
        tpot_probe = (tokens[-1] - tokens[0]) / 11
        tpot_runtime = (runtime.timestamps[-1] - runtime.timestamps[0]) * 1e9 / 11
        assert abs(ttft_probe - ttft_runtime) < 1e6 + call + lag[0], (rid, ttft_probe, ttft_runtime, call, lag[0])
        assert abs(tpot_probe - tpot_runtime) < 1e6 + max(lag[0], lag[-1]) / 11, (rid, tpot_probe, tpot_runtime)
        # the caller received each token after the runtime stamped it (the probe stamps after update_batch
        # returns, so a fast consumer may be earlier than the probe)
        assert all(t_got >= runtime.timestamps[n - 1] * 1e9 for t_got, n in got if n > 0)


@pytest.mark.slow
def test_an_id_reused_after_its_manager_stopped_mid_request_starts_a_fresh_request():
    """A manager stopped with requests in flight never ends them; the next call reuses their ids. The
    adapter closes the stale arrival as aborted and reports the new one from its arrival: each
    arrival's events form one bracket, and the second r0 is scheduled (and counted) afresh."""
    model = _model()
    records: list = []
    p = attach(model, sink=records.extend, runtime="hf-cb")
    adapter = HFContinuousBatching(p).instrument_model(model)
    gc = GenerationConfig(max_new_tokens=1500, do_sample=False, eos_token_id=-1)
    cbc = ContinuousBatchingConfig(num_blocks=64, page_size=PAGE, max_batch_tokens=256)
    prompts = [[5 + i] * 20 for i in range(2)]
    forwards: list = []
    counter = model.register_forward_hook(lambda m, a, o: forwards.append(1))
    try:
        manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
        manager.start()
        for i, prompt in enumerate(prompts):
            manager.add_request(prompt, request_id=f"req_{i}", max_new_tokens=1500)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(forwards) < 8:  # a few decode steps in
            time.sleep(0.001)
        manager.stop(block=True, timeout=30, hard_stop=True)  # r0, r1 mid-decode: their ends are never reported
        cut = len(records)
        assert not any(type(r) is RequestEvent and REQUEST_EVENTS[r.event] in ("finished", "aborted")
                       for r in records[:cut])
        outputs = model.generate_batch(inputs=prompts, generation_config=GenerationConfig(
            max_new_tokens=3, do_sample=False, eos_token_id=-1), continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=64, page_size=PAGE, max_batch_tokens=256))
    finally:
        counter.remove()
        adapter.detach()
        p.close()
    assert len(outputs) == 2
    rids = sorted(outputs)  # generate_batch names its requests req_0, req_1: the ids the first manager used
    by_rid: dict[str, list] = defaultdict(list)
    for r in records:
        if type(r) is RequestEvent:
            by_rid[r.request_id].append(r)
    for rid in rids:
        kinds = [REQUEST_EVENTS[e.event] for e in by_rid[rid]]
        # one bracket per arrival: an arrival only ever follows the previous arrival's end
        opened = False
        for k in kinds:
            if k == "arrival":
                assert not opened, (rid, kinds)
                opened = True
            elif k in ("finished", "aborted"):
                assert opened, (rid, kinds)
                opened = False
        assert not opened and kinds[-1] == "finished" and kinds.count("scheduled") == kinds.count("arrival")
        last = kinds[len(kinds) - 1 - kinds[::-1].index("arrival"):]
        assert last.count("token") == 3 and by_rid[rid][-1].tokens == 3, (rid, last)


@pytest.mark.slow
@pytest.mark.parametrize("sharing", [True, False])
def test_prefix_lookups_of_a_burst_are_in_flight_or_cache_disabled(sharing):
    """Three prompts sharing a 2-page prefix, queued before the manager starts: one scheduling pass looks them all
    up, so the 2nd and 3rd find the prefix shared but not cached yet (in-flight); with sharing off, every prompt
    is admitted with the cache disabled. Per-cause tokens from the records add up to the missed tokens."""
    from phasescope.agent.records.events import PrefixLookup
    from phasescope.agent.read.queries import split_lookup

    model = _model()
    records: list = []
    p = attach(model, sink=records.extend, runtime="hf-cb")
    adapter = HFContinuousBatching(p).instrument_model(model)
    gc = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1)
    cbc = ContinuousBatchingConfig(num_blocks=32, page_size=PAGE, max_batch_tokens=512, allow_block_sharing=sharing)
    manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
    prompts = [SYSTEM + [100 + i] * 10 for i in range(3)]
    for i, prompt in enumerate(prompts):
        manager.add_request(prompt, request_id=f"b{i}", max_new_tokens=4)
    manager.start()
    done, deadline = 0, time.monotonic() + 60
    try:
        while done < 3 and time.monotonic() < deadline:
            r = manager.get_result(timeout=5)
            done += r is not None and r.is_finished()
    finally:
        manager.stop(block=True, timeout=30)
        adapter.detach()
        p.close()
    looks = sorted((r for r in records if type(r) is PrefixLookup), key=lambda r: r.request_id)
    assert [r.request_id for r in looks] == ["b0", "b1", "b2"]
    causes: Counter = Counter()
    for r in looks:
        causes.update(split_lookup(r.kind, r.page_size_tokens, r.prompt_tokens, r.cacheable_tokens, r.hit_tokens,
                                   r.shared_tokens, r.evicted_tokens))
    causes = +causes
    missed = sum(r.prompt_tokens - r.hit_tokens for r in looks)
    assert sum(causes.values()) == missed == 3 * 74
    if sharing:
        assert [(r.kind, r.shared_tokens, r.hit_tokens) for r in looks] == [("first", 0, 0), ("first", 64, 0),
                                                                           ("first", 64, 0)]
        assert causes == {"in-flight": 2 * 2 * PAGE, "no-shared-prefix": 74 + 10 + 10}
    else:
        assert {r.kind for r in looks} == {"disabled"} and causes == {"cache-disabled": 3 * 74}


def test_the_adapter_labels_the_runs_knobs():
    """A zero-code run (phasescope run) has no labels but the adapter's: page size, pages, max_batch_tokens, so
    advice names their values (it told a run chunking at 256 to 'enable chunked prefill': issue 23)."""
    from phasescope.agent.records.events import RunLabel

    records, outputs, _ = _run(_model(), [SYSTEM + [7] * 5], max_new_tokens=3, num_blocks=16)
    assert len(outputs) == 1
    labels = {r.key: r.value for r in records if isinstance(r, RunLabel)}
    assert (labels["page_size"], labels["num_pages"], labels["max_batch_tokens"]) == (str(PAGE), "16", "256")
