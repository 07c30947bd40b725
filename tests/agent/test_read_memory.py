"""Reads of a live store of millions of steps, while the writer keeps its 48 MB memory limit.

DuckDB has one memory limit per database instance; the read API and retention run under
`Store.reading()`, which raises it while they run (exact quantiles cannot spill to disk).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import psutil
import pytest

from phasescope.agent.sidecar import Sidecar
from phasescope.agent.sidecar.store import Store

STEPS = 4_000_000  # phase_summary over this many steps fails within the writer's 48 MB (measured: 5M fails)


def _fill(db: str, n: int) -> None:
    """`n` steps of one run written straight into the file (a probe would take minutes on 2 cores)."""
    store = Store(db)
    store.con.execute("INSERT INTO sources VALUES (1, 0, 0, 0, 1, 0, 1, 'big', 'm', 'module')")
    store.con.execute(f"""
        INSERT INTO steps SELECT 1, i * 1000000, i, 0, CASE WHEN i % 10 = 0 THEN 'prefill' ELSE 'decode' END,
               4, CASE WHEN i % 10 = 0 THEN 512 ELSE 0 END, 4, i % 4096, 1.0 + (i % 97) / 10.0, 'NaN'::DOUBLE
        FROM range({n}) t(i)""")
    store.close()


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.fixture(scope="module")
def big_db(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("big") / "big.duckdb")
    _fill(db, STEPS)
    return db


def test_whole_table_queries_on_a_multi_million_step_live_store_answer_exactly(big_db, short_tmp):
    from phasescope.analyzers.diagnose import diagnose

    sc = Sidecar(big_db, listen=[f"unix:{short_tmp}/r.sock"], read_api="127.0.0.1:0", findings=diagnose).start()
    try:
        api = sc.read_api.url
        writer_limit = sc.store.cursor().execute("SELECT current_setting('memory_limit')").fetchone()[0]
        rss0 = psutil.Process().memory_info().rss
        status, body = _get(f"{api}/api/v1/query/phase_summary?run_id=big")
        assert status == 200, body
        by = {r["phase"]: r for r in body["rows"]}
        i = np.arange(STEPS)
        ms = 1.0 + (i % 97) / 10.0
        for phase, sel in (("prefill", i % 10 == 0), ("decode", i % 10 != 0)):
            assert by[phase]["steps"] == int(sel.sum())
            p50, p95, p99 = np.percentile(ms[sel], [50, 95, 99])  # linear, as quantile_cont
            assert (by[phase]["p50_ms"], by[phase]["p95_ms"], by[phase]["p99_ms"]) == pytest.approx((p50, p95, p99))
        assert by["prefill"]["prefill_tokens"] == 512 * (STEPS // 10)
        for q in ("step_timeline", "interference", "step_sample"):
            status, body = _get(f"{api}/api/v1/query/{q}?run_id=big")
            assert status == 200 and body["rows"], (q, body)
        status, body = _get(f"{api}/api/v1/findings?run_id=big")
        assert status == 200 and "error" not in body, body
        # the writer's limit is back once no read runs, and DuckDB gave back what the reads took
        assert sc.store.cursor().execute("SELECT current_setting('memory_limit')").fetchone()[0] == writer_limit
        assert psutil.Process().memory_info().rss - rss0 < 150 << 20
    finally:
        sc.stop()


def test_a_read_over_the_read_limit_answers_503_naming_the_flag(big_db, short_tmp):
    sc = Sidecar(big_db, listen=[f"unix:{short_tmp}/s.sock"], read_api="127.0.0.1:0", read_memory_mib=48).start()
    try:
        status, body = _get(f"{sc.read_api.url}/api/v1/query/phase_summary?run_id=big")
        assert status == 503 and "--read-memory-mib" in body["error"], body
        status, body = _get(f"{sc.read_api.url}/api/v1/query/runs")  # small reads still answer
        assert status == 200 and body["rows"][0]["run_id"] == "big"
    finally:
        sc.stop()
