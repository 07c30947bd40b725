"""Gate edges the fixtures do not reach (issue 31: survivors of `benchmarks/mutation/run.sh gates`).

Each store is stated records chosen to sit exactly on one gate: the smallest world a TP rule reads, weights
that take the whole GPU, a memory margin exactly at its floor. A gate moved by one step (`<` for `<=`)
changes what these return.
"""

from __future__ import annotations

import duckdb
import pytest

from phasescope.agent.records import events as ev
from phasescope.agent.sidecar.store import Store
from phasescope.analyzers import memory, tp

T0 = 1_000_000_000
MS = 1_000_000


def _store(path: str, ranks: int, gpu_used: int | None = None, kv_dtype: str = "bf16") -> None:
    """`ranks` TP ranks of run "g", 20 decode steps each (rank r takes 10 + 2r ms), optional GPU samples."""
    store = Store(path)
    try:
        for rank in range(ranks):
            sid = store.register_source(ev.Hello(T0, 0, 900 + rank, rank, ranks, "g", "m", "vllm"))
            steps = [ev.Step(T0 + i * 30 * MS, i, rank, ev.PHASE_DECODE, 4, 0, 4, 100, float("nan"), 10.0 + 2 * rank)
                     for i in range(20)]
            recs: list = steps + [ev.KVSnapshot(T0 + i * 30 * MS, rank, 16, 100, 10 + 5 * rank, 90 - 5 * rank, 0, 0, 0, 1,
                                                150, 80, i, 0, (10 + 5 * rank) * 1000, kv_dtype) for i in range(20)]
            if gpu_used is not None and rank == 0:
                recs = recs + [ev.GpuSample(T0 + i * 100 * MS, 0, 50.0, gpu_used, 1000, 300.0, 50.0, 1500.0, 0)
                               for i in range(5)]
            store.append([(sid, recs)])
    finally:
        store.close()


def test_a_two_rank_world_is_read_by_the_straggler_rule(tmp_path):
    path = str(tmp_path / "tp2.duckdb")
    _store(path, ranks=2)
    con = duckdb.connect(path, read_only=True)
    try:
        (f,) = tp.tp_straggler(con, "g", max_skew=0.05)  # skew 12 / 11 - 1 = 0.09 (median of two: their mean)
        assert (f.id, f.evidence["straggler_rank"], f.evidence["straggler_share"]) == ("tp-straggler", 1, 1.0)
    finally:
        con.close()
    one = str(tmp_path / "tp1.duckdb")
    _store(one, ranks=1)
    con = duckdb.connect(one, read_only=True)
    try:
        assert tp.tp_straggler(con, "g", max_skew=0.0) == []  # one rank: nothing to compare
    finally:
        con.close()


def test_weights_that_fill_the_gpu_leave_no_room_for_kv(tmp_path):
    path = str(tmp_path / "full.duckdb")
    _store(path, ranks=1)
    con = duckdb.connect(path, read_only=True)
    try:
        labels = {"gpu_mem_bytes": "1000", "weight_bytes": "1000", "kv_budget_bytes": "10"}
        (f,) = memory.kv_budget_oom_risk(con, "g", model=None, labels=labels)
        assert f.evidence["remaining_after_weights_bytes"] == 0
        assert f.evidence["kv_share_of_remaining"] == float("inf") and f.severity == "critical"
    finally:
        con.close()


@pytest.mark.parametrize("used, severity", [(950, "warning"), (951, "critical")])
def test_a_margin_exactly_at_its_floor_is_not_critical(tmp_path, used, severity):
    """KV takes 500 / 600 of what the weights leave (over 0.8: fires, under 0.9: not critical by share); the
    peak leaves (1000 - used) / 1000 free: 0.05 is at min_margin (not below it), 0.049 is below."""
    path = str(tmp_path / "m.duckdb")
    _store(path, ranks=1, gpu_used=used)
    con = duckdb.connect(path, read_only=True)
    try:
        labels = {"weight_bytes": "400", "kv_budget_bytes": "500"}
        (f,) = memory.kv_budget_oom_risk(con, "g", model=None, labels=labels, max_kv_share_of_remaining=0.8,
                                         min_margin=0.05)
        assert f.evidence["split"]["margin"] == pytest.approx((1000 - used) / 1000, abs=0)
        assert f.severity == severity
    finally:
        con.close()


def test_one_tp_group_of_the_whole_world_names_no_replica(tmp_path):
    """A world that is one TP group (world == TP size) is one replica: the evidence names none."""
    path = str(tmp_path / "kv2.duckdb")
    _store(path, ranks=2)
    con = duckdb.connect(path, read_only=True)
    try:
        (f,) = tp.tp_kv_imbalance(con, "g", max_imbalance=0.0)
        assert f.evidence["kv_imbalance"] == pytest.approx(15000 / 12500 - 1, rel=1e-12)  # max / mean - 1
        assert "replica" not in f.evidence
    finally:
        con.close()


def _four_prompts(tmp_path, hit: int) -> str:
    """Four 100-token prompts, none served from the cache at admission; the prefix counters say `hit` of their
    400 queried tokens hit. Returns the store's path (run "g")."""
    path = str(tmp_path / "p.duckdb")
    store = Store(path)
    try:
        sid = store.register_source(ev.Hello(T0, 0, 901, 0, 1, "g", "m", "vllm"))
        recs: list = [ev.PrefixCounters(T0 + i * MS, 0, 100 * i, hit * i // 4, 0, 0) for i in range(5)]
        for i in range(4):
            rid, t = f"r{i}", T0 + i * 10 * MS
            recs += [ev.RequestEvent(t, 0, ev.REQ_ARRIVAL, rid, 100, 0), ev.RequestEvent(t + MS, 0, ev.REQ_SCHEDULED, rid, 0, 0),
                     ev.RequestEvent(t + 2 * MS, 0, ev.REQ_TOKEN, rid, 1, 0), ev.RequestEvent(t + 2 * MS, 0, ev.REQ_FINISHED, rid, 1, 0)]
        store.append([(sid, sorted(recs, key=lambda r: r.ts_ns))])
    finally:
        store.close()
    return path


def test_a_prefix_collapse_with_no_eviction_does_not_blame_eviction(tmp_path):
    """Four 100-token prompts sharing a 64-token prefix, none served from the cache, no block evicted: the
    finding fires (3 x 64 / 400 = 0.48 achievable, 0 reached) and its advice says nothing of eviction."""
    from phasescope.analyzers.prefix import prefix_hit_collapse

    path = _four_prompts(tmp_path, hit=0)
    con = duckdb.connect(path, read_only=True)
    try:
        (f,) = prefix_hit_collapse(con, "g", labels={"shared_prefix_tokens": "64"})
        assert f.evidence["evicted_blocks"] == 0 and f.evidence["achievable_hit_rate"] == pytest.approx(0.48)
        assert "evict" not in f.suggestion
    finally:
        con.close()


@pytest.mark.parametrize("budget, severity", [(540, "warning"), (541, "critical")])
def test_kv_taking_exactly_nine_tenths_of_what_the_weights_leave_is_not_critical(tmp_path, budget, severity):
    path = str(tmp_path / "s.duckdb")
    _store(path, ranks=1)
    con = duckdb.connect(path, read_only=True)
    try:
        labels = {"gpu_mem_bytes": "1000", "weight_bytes": "400", "kv_budget_bytes": str(budget)}
        (f,) = memory.kv_budget_oom_risk(con, "g", model=None, labels=labels)
        assert f.evidence["kv_share_of_remaining"] == pytest.approx(budget / 600, abs=0)  # 540 / 600 = 0.9
        assert f.severity == severity
    finally:
        con.close()


def test_a_clock_skew_exactly_at_its_limit_is_no_finding(tmp_path):
    """The probe's Hello stamp (wall) against the sidecar's receive time: a skew equal to max_clock_skew_s is
    within it; one bit under it, the skew is past the limit."""
    import math

    from phasescope.analyzers.telemetry import telemetry_degraded

    path = str(tmp_path / "c.duckdb")
    _store(path, ranks=1)
    con = duckdb.connect(path, read_only=True)
    try:
        skew = abs(con.execute("""SELECT ((ts_ns + wall_minus_mono_ns) - connected_ns) / 1e9 FROM sources
                                  WHERE run_id = 'g'""").fetchone()[0])
        assert skew > 1  # the Hello says T0 (1 s after the epoch); the sidecar got it now

        def ids(limit: float) -> set[str]:
            return {f.id for f in telemetry_degraded(con, "g", max_clock_skew_s=limit)}

        assert "telemetry-clock-skew" not in ids(skew)
        assert "telemetry-clock-skew" in ids(math.nextafter(skew, 0))
    finally:
        con.close()


def test_a_hit_rate_halved_exactly_is_not_a_collapse_and_a_first_half_at_the_floor_counts(tmp_path):
    """First half of the run: 50 of 100 queried tokens hit (0.5); second half: 25 of 100 (0.25)."""
    from phasescope.analyzers.prefix import prefix_hit_collapse

    path = str(tmp_path / "w.duckdb")
    store = Store(path)
    try:
        sid = store.register_source(ev.Hello(T0, 0, 902, 0, 1, "g", "m", "vllm"))
        counters = [(0, 0, 0), (1000, 100, 50), (2000, 200, 100), (3000, 300, 125)]  # (ms, queried, hit) totals
        store.append([(sid, [ev.PrefixCounters(T0 + t * MS, 0, q, h, 0, 0) for t, q, h in counters])])
    finally:
        store.close()
    con = duckdb.connect(path, read_only=True)
    try:
        # 0.25 is not below 0.5 x 0.5: no collapse
        assert prefix_hit_collapse(con, "g", collapse_ratio=0.5, min_window_hit_rate=0.5) == []
        # below 0.51 x 0.5 it is, and a first half at exactly min_window_hit_rate is enough to judge
        (f,) = prefix_hit_collapse(con, "g", collapse_ratio=0.51, min_window_hit_rate=0.5)
        assert (f.evidence["hit_rate_first_half"], f.evidence["hit_rate_second_half"]) == (0.5, 0.25)
    finally:
        con.close()


@pytest.mark.parametrize("kv_dtype, hint", [("fp8", False), ("bf16", True)])
def test_the_fp8_hint_is_given_only_where_the_kv_is_wider_than_fp8(tmp_path, kv_dtype, hint):
    from phasescope.analyzers.kvcache import kv_headroom_low

    path = str(tmp_path / "h.duckdb")
    _store(path, ranks=1, kv_dtype=kv_dtype)
    con = duckdb.connect(path, read_only=True)
    try:
        (f,) = kv_headroom_low(con, "g", headroom_usage=0.1)  # peak block usage 10 / 100
        assert ("fp8 KV would hold" in f.suggestion) == hint, f.suggestion
    finally:
        con.close()


@pytest.mark.parametrize("kv_heads, fires", [(2, False), (1, True)])
def test_kv_heads_are_replicated_only_past_tp_equal_to_kv_heads(tmp_path, kv_heads, fires):
    from phasescope.analyzers.geometry import ModelGeometry

    path = str(tmp_path / "r.duckdb")
    _store(path, ranks=2)  # TP 2
    con = duckdb.connect(path, read_only=True)
    try:
        model = ModelGeometry(layers=2, heads=4, kv_heads=kv_heads, head_dim=16)
        found = tp.tp_kv_head_replication(con, "g", model=model)
        assert bool(found) == fires
        if fires:
            assert found[0].evidence["replication"] == 2.0
    finally:
        con.close()


def test_prefix_miss_causes_at_exactly_their_shares(tmp_path):
    """Two prompts of 100 tokens admitted with the cache off and two that share nothing with any earlier one:
    each cause is exactly half of the 400 missed tokens, at both gates (the cause share, and 0.5 for
    no-shared-prefix); a cause share one bit over 0.5 leaves both out."""
    import math

    from phasescope.analyzers.prefix_miss import prefix_miss_causes

    path = str(tmp_path / "l.duckdb")
    store = Store(path)
    try:
        sid = store.register_source(ev.Hello(T0, 0, 903, 0, 1, "g", "m", "vllm"))
        looks = [ev.PrefixLookup(T0 + i * MS, 0, f"r{i}", "disabled" if i < 2 else "first", 16, 100, 96, 0, 0, 0,
                                 float("nan"), 0, 0) for i in range(4)]
        store.append([(sid, looks + [ev.PrefixCounters(T0 + 5 * MS, 0, 200, 0, 0, 0)])])
    finally:
        store.close()
    con = duckdb.connect(path, read_only=True)
    try:
        def ids(share: float) -> set[str]:
            return {f.id for f in prefix_miss_causes(con, "g", prefix_miss_min_tokens=0, prefix_miss_cause_share=share)}

        found = prefix_miss_causes(con, "g", prefix_miss_min_tokens=0, prefix_miss_cause_share=0.5)
        assert {f.id: f.evidence["cause_share"] for f in found} == {"prefix-miss-cache-disabled": 0.5,
                                                                     "prefix-miss-no-shared-prefix": 0.5}
        assert "prefix-miss-cache-disabled" not in ids(math.nextafter(0.5, 1))
    finally:
        con.close()


@pytest.mark.parametrize("kv_dtype, advice", [("fp8", False), ("bf16", True)])
def test_near_cap_advises_fp8_only_where_the_kv_is_wider_than_fp8(tmp_path, kv_dtype, advice):
    """A preempted request and a cache at its peak: quantizing to fp8 is advised for a bf16 cache, never for one
    that is already 1 byte an element (it would say `holds 1x the tokens`)."""
    from phasescope.analyzers.kvcache import kv_near_cap

    path = str(tmp_path / "n.duckdb")
    _store(path, ranks=1, kv_dtype=kv_dtype)
    store = Store(path)
    try:
        sid = store.register_source(ev.Hello(T0, 0, 900, 0, 1, "g", "m", "vllm"))
        store.append([(sid, [ev.RequestEvent(T0, 0, ev.REQ_ARRIVAL, "p", 50, 0),
                             ev.RequestEvent(T0 + MS, 0, ev.REQ_SCHEDULED, "p", 0, 0),
                             ev.RequestEvent(T0 + 2 * MS, 0, ev.REQ_PREEMPTED, "p", 0, 0),
                             ev.RequestEvent(T0 + 3 * MS, 0, ev.REQ_TOKEN, "p", 1, 0),
                             ev.RequestEvent(T0 + 3 * MS, 0, ev.REQ_FINISHED, "p", 1, 0)])])
    finally:
        store.close()
    con = duckdb.connect(path, read_only=True)
    try:
        (f,) = kv_near_cap(con, "g", near_cap=0.1)  # peak block usage 10 / 100
        assert ("quantize the kv cache to fp8" in f.suggestion.lower()) == advice, f.suggestion
        assert f.evidence["capacity_tokens_fp8"] == f.evidence["capacity_tokens"] * (2 if advice else 1)
    finally:
        con.close()


def test_prefill_mfu_reads_only_steps_with_time_and_tokens(tmp_path):
    """A GPU-timed prefill of 0 ms (a clock too coarse for it) or of 0 new tokens has no MFU: the median is
    the one real step's, whatever the others."""
    from phasescope.analyzers.decode import decode_roofline
    from phasescope.analyzers.geometry import ModelGeometry
    from phasescope.analyzers.gpus import GPUS
    from phasescope.analyzers.roofline import attention_flops, mfu

    path = str(tmp_path / "d.duckdb")
    _store(path, ranks=1)  # 20 GPU-timed decode steps of 10 ms
    store = Store(path)
    try:
        sid = store.register_source(ev.Hello(T0, 0, 900, 0, 1, "g", "m", "vllm"))
        pre = [(100.0, 1000), (0.0, 500), (50.0, 0), (50.0, 0)]  # (gpu ms, new prompt tokens)
        store.append([(sid, [ev.Step(T0 + (700 + i) * MS, 100 + i, 0, ev.PHASE_PREFILL, 1, n, 0, 0, ms + 1, ms)
                             for i, (ms, n) in enumerate(pre)])])
    finally:
        store.close()
    model = ModelGeometry(layers=2, heads=4, kv_heads=2, head_dim=16, params=1e9)
    gpu = GPUS["H100-PCIe"]
    con = duckdb.connect(path, read_only=True)
    try:
        (f, *_) = decode_roofline(con, "g", model=model, gpu=gpu, min_mbu=1.0)
        want = mfu(model.params, 1000, 0.1, gpu.flops(model.dtype), attention_flops(model, 1000, 0), 1)
        assert f.evidence["prefill_mfu_p50"] == pytest.approx(want, rel=1e-12)
    finally:
        con.close()


@pytest.mark.parametrize("hit, ordering", [(20, False), (19, True)])
def test_prompt_order_advice_below_a_five_percent_hit_rate_only(tmp_path, hit, ordering):
    """Four 100-token prompts sharing 64 tokens, none served from the cache at admission (the `shared` reason);
    the counters say `hit` of 400 queried tokens hit: 20 / 400 is 5%, not below it. No prefill steps: no cost
    per token, and the effect names none."""
    from phasescope.analyzers.prefix import prefix_hit_collapse

    path = _four_prompts(tmp_path, hit=hit)
    con = duckdb.connect(path, read_only=True)
    try:
        (f,) = prefix_hit_collapse(con, "g", labels={"shared_prefix_tokens": "64"})
        assert f.evidence["hit_rate"] == hit / 400
        assert ("put the fixed part of every prompt" in f.suggestion.lower()) == ordering, f.suggestion
        assert "ms per token" not in f.expected_effect and f.expected_effect.endswith(", lowering TTFT.")
    finally:
        con.close()


def test_gpu_timing_silent_exactly_stale_s_is_stopped(tmp_path):
    """GPU-timed steps for the first 10 s of 30 s of steps: silent for exactly `telemetry_stale_s` fires, one
    bit under it does not (the quick check that skips the full query uses the same bound)."""
    import math
    import time

    from phasescope.analyzers.telemetry import telemetry_degraded

    path = str(tmp_path / "t.duckdb")
    store = Store(path)
    try:
        sid = store.register_source(ev.Hello(0, time.time_ns(), 905, 0, 1, "g", "m", "hf-cb"))
        steps = [ev.Step(i * 100 * MS, i, 0, ev.PHASE_DECODE, 1, 0, 1, 50, 1.0, 0.5 if i < 100 else float("nan"))
                 for i in range(300)]
        store.append([(sid, steps)])
    finally:
        store.close()
    con = duckdb.connect(path, read_only=True)
    try:
        def gpu(stale: float) -> dict | None:
            found = {f.id: f for f in telemetry_degraded(con, "g", telemetry_stale_s=stale)}
            f = found.get("telemetry-gpu-timing-stopped")
            return f.evidence if f else None

        silent = gpu(1.0)["silent_s"]
        assert silent == pytest.approx(20.0)  # last timed step at 9.9 s, last step at 29.9 s
        assert gpu(silent)["silent_s"] == silent
        assert gpu(math.nextafter(silent, math.inf)) is None
    finally:
        con.close()


def test_the_chunk_ladder_stops_below_the_largest_prefill_a_step_held(scenario):
    """service-mix's largest prefill in one step is 256 tokens, a rung of the ladder: a budget of 256 would
    change nothing, so the ladder predicts 64 and 128 only."""
    from phasescope.analyzers.diagnose import diagnose

    con, run_id = scenario("service-mix")
    (f,) = [f for f in diagnose(con, run_id) if f.id == "itl-spikes-prefill"]
    assert f.evidence["max_prefill_tokens_per_step"] == 256
    assert sorted(f.evidence["predicted_itl_p99_ms_by_budget"]) == [64, 128]


@pytest.mark.parametrize("shared, best, saved", [
    ((64, 20, 20), 64, 64),  # 64- and 32-token pages save as much (64 of 104 sub-page tokens): the larger wins a tie
    ((64, 64, 64, 32, 32), 64, 192),  # a 64-token page saves exactly 3/4 of the 256: enough, the search stops there
])
def test_the_smaller_page_is_the_largest_that_saves_most_or_three_quarters(tmp_path, shared, best, saved):
    """vLLM, 128-token pages, a backend that takes multiples of 32 (candidates 64 and 32): first admissions of
    300-token prompts, none hit, sharing `shared` tokens with an earlier prompt (all under one page)."""
    from phasescope.analyzers.prefix_miss import prefix_miss_causes

    path = str(tmp_path / "s.duckdb")
    store = Store(path)
    try:
        sid = store.register_source(ev.Hello(T0, 0, 906, 0, 1, "g", "m", "vllm"))
        store.append([(sid, [ev.PrefixLookup(T0 + i * MS, 0, f"r{i}", "first", 128, 300, 256, 0, s, 0,
                                             float("nan"), 0, 0) for i, s in enumerate(shared)])])
    finally:
        store.close()
    con = duckdb.connect(path, read_only=True)
    try:
        labels = {"runtime": "vllm", "vllm_attention_backend": "CPU_ATTN", "vllm_block_sizes": "m32"}
        found = {f.id: f for f in prefix_miss_causes(con, "g", prefix_miss_min_tokens=0, prefix_miss_cause_share=0.01,
                                                      min_sub_page_tokens=0, labels=labels)}
        e = found["prefix-miss-sub-page"].evidence
        assert (e["suggested_page_size_tokens"], e["smaller_page_saved_tokens"]) == (best, saved)
        assert f"--block-size {best};" in found["prefix-miss-sub-page"].suggestion
    finally:
        con.close()


def test_in_flight_misses_at_exactly_their_share(tmp_path):
    """Two 100-token prompts sharing 100 tokens with an earlier one whose pages were not cached yet (no hit, none
    evicted): 96 of each prompt's misses are whole shared pages in flight. At a cause share equal to theirs the
    finding fires; one bit over, it does not."""
    import math

    from phasescope.analyzers.prefix_miss import prefix_miss_causes

    path = str(tmp_path / "f.duckdb")
    store = Store(path)
    try:
        sid = store.register_source(ev.Hello(T0, 0, 907, 0, 1, "g", "m", "vllm"))
        store.append([(sid, [ev.PrefixLookup(T0 + i * MS, 0, f"r{i}", "first", 16, 100, 96, 0, 100, 0,
                                             float("nan"), 0, 0) for i in range(2)])])
    finally:
        store.close()
    con = duckdb.connect(path, read_only=True)
    try:
        def in_flight(share: float):
            found = {f.id: f for f in prefix_miss_causes(con, "g", prefix_miss_min_tokens=0, prefix_miss_cause_share=share)}
            return found.get("prefix-miss-in-flight")

        share = in_flight(0.01).evidence["cause_share"]
        assert share == 192 / 200
        assert in_flight(share) is not None and in_flight(math.nextafter(share, 1)) is None
    finally:
        con.close()
