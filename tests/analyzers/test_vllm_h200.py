"""Recorded vLLM 0.24 runs on an H200 (benchmarks/gpu/vllm_h200.py): diagnose names what the runs did,
and the figures behind the findings follow from the raw rows and equal vLLM's own counters of the run
(kept in each fixture's config.json under vllm_metrics)."""

from __future__ import annotations

import json
import os
import statistics

import pytest

from builders.scenarios import DATA_DIR
from phasescope.analyzers.diagnose import diagnose

FIXTURES = ["kv-pressure-vllm-h200", "prefill-interference-vllm-h200"]


def _config(name: str) -> dict:
    with open(os.path.join(DATA_DIR, name, "config.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("name", FIXTURES)
def test_diagnose_names_what_the_h200_run_did(name, scenario):
    con, run_id = scenario(name)
    cfg = _config(name)
    found = {f.id for f in diagnose(con, run_id)}
    assert set(cfg["expect"]) <= found, found
    assert not set(cfg["must_not"]) & found, found


@pytest.mark.parametrize("name", FIXTURES)
def test_recorded_counts_equal_vllms_own(name, scenario):
    con, _ = scenario(name)
    m = _config(name)["vllm_metrics"]
    q, h = con.execute("SELECT max(queried_tokens_total), max(hit_tokens_total) FROM prefix_counters").fetchone()
    assert (q, h) == (m["vllm:prefix_cache_queries"], m["vllm:prefix_cache_hits"])
    ev = dict((e, (n, t)) for e, n, t in con.execute(
        "SELECT event, count(*), sum(tokens) FROM request_events GROUP BY event").fetchall())
    assert ev.get("preempted", (0, 0))[0] == m["vllm:num_preemptions"]
    assert ev["arrival"][1] == m["vllm:prompt_tokens"]
    assert ev["token"][1] == m["vllm:generation_tokens"]
    assert ev["finished"][0] == m["vllm:request_success"] == m["vllm:time_to_first_token_seconds_count"]
    n_itl = con.execute("SELECT count(*) FROM itl").fetchone()[0]
    assert n_itl == m["vllm:inter_token_latency_seconds_count"]
    ttft = con.execute("SELECT sum(ttft_s) FROM requests WHERE status = 'finished'").fetchone()[0]
    assert ttft == pytest.approx(m["vllm:time_to_first_token_seconds_sum"], rel=1e-3)
    # one step record per engine iteration vLLM counts (its kernel warm-up is not one)
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == m["vllm:iteration_tokens_total_count"]


def test_kv_pressure_pages_account_and_reach_the_cap(scenario):
    con, _ = scenario("kv-pressure-vllm-h200")
    bad = con.execute("SELECT count(*) FROM kv_snapshots WHERE used_pages + free_pages != total_pages "
                      "OR pages_allocated_total - pages_freed_total != used_pages OR cached_pages > free_pages "
                      "OR live_tokens > used_pages * page_size_tokens").fetchone()[0]
    assert bad == 0
    total, peak = con.execute("SELECT max(total_pages), max(used_pages) FROM kv_snapshots").fetchone()
    assert total == 700 and peak == total  # the pool of the run, filled: hence the 89 preemptions
    # every preempted request comes back: one re-admission lookup or more per preemption (vLLM 0.24 looks a
    # waiting request up again each step until its pages fit)
    pre = con.execute("SELECT count(*) FROM request_events WHERE event = 'preempted'").fetchone()[0]
    readmit = con.execute("SELECT count(*) FROM prefix_lookups WHERE kind = 'readmit'").fetchone()[0]
    assert pre == 89 and readmit >= pre


def test_interference_steps_with_a_prefill_chunk_are_the_slow_ones(scenario):
    con, run_id = scenario("prefill-interference-vllm-h200")
    ms = "CASE WHEN isnan(gpu_ms) THEN host_ms ELSE gpu_ms END"
    sql = f"SELECT {ms} FROM steps WHERE prefill_tokens {{}} 0 AND decode_tokens > 0"
    mixed = [r[0] for r in con.execute(sql.format(">")).fetchall()]
    decode = [r[0] for r in con.execute(sql.format("=")).fetchall()]
    assert len(mixed) >= 6 and len(decode) > 500  # 6 long prompts, each in chunks next to the 16 decoders
    assert statistics.median(mixed) > 4 * statistics.median(decode)
    f = {x.id: x for x in diagnose(con, run_id)}["prefill-stalls-decode"]
    assert f.evidence["pure_decode_steps"] == len(decode)
    # async scheduling: an untimed step's time is the next step's start-to-start period (never below its host time)
    out = f"""SELECT CASE WHEN NOT isnan(gpu_ms) THEN gpu_ms ELSE greatest(host_ms, coalesce(
                  (lead(ts_ns, 2) OVER w - lead(ts_ns, 1) OVER w) / 1e6, host_ms)) END AS ms, prefill_tokens, decode_tokens
              FROM steps WINDOW w AS (ORDER BY ts_ns, step_id)"""
    pure = [r[0] for r in con.execute(f"SELECT ms FROM ({out}) WHERE prefill_tokens = 0 AND decode_tokens > 0")
            .fetchall()]
    assert f.evidence["pure_decode_p50_ms"] == pytest.approx(statistics.median(pure))
    assert statistics.median(pure) >= statistics.median(decode)  # the interval holds the host call
    assert f.evidence["max_prefill_tokens_per_step"] <= 2048  # the run's max_num_batched_tokens
