"""`phasescope verify` on real HF continuous batching: the verdict checked against both arms' raw rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import duckdb
import numpy as np
import pytest

from builders.scenarios import DATA_DIR, load
from phasescope.analyzers.predictions import Prediction, verdict

pytestmark = pytest.mark.slow


def _slack_from_raw_rows(con: duckdb.DuckDBPyConnection, run_id: str) -> tuple[float, set[int]]:
    """Mean slack inside used pages, from the run's raw KV snapshots in numpy (not the analyzer's SQL)."""
    rows = con.execute("""SELECT k.live_tokens, k.used_pages, k.page_size_tokens FROM kv_snapshots k
                          JOIN sources s USING (source_id) WHERE s.run_id = ? AND k.total_pages > 0""",
                       [run_id]).fetchnumpy()
    used = rows["used_pages"] > 0
    live, pages, size = (rows[c][used].astype(float) for c in ("live_tokens", "used_pages", "page_size_tokens"))
    return float(np.mean(1 - live / (pages * size))), set(int(x) for x in rows["page_size_tokens"])


@pytest.mark.timeout(1500)
def test_verify_the_page_size_suggestion_on_a_real_rerun(tmp_path):
    db = str(tmp_path / "v.duckdb")
    run = load(os.path.join(DATA_DIR, "internal-fragmentation"), db)
    out = subprocess.run([sys.executable, "-m", "phasescope.cli", "verify", "--db", db, "--run", run,
                          "--finding", "kv-internal-fragmentation", "--max-pairs", "2", "--json"],
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    p = r["prediction"]
    assert p["metric"] == "kv_internal_fragmentation" and p["change"]["page_size"] < 256
    assert p["change"]["num_pages"] * p["change"]["page_size"] == 64 * 256  # the same cache memory
    con = duckdb.connect(db, read_only=True)
    try:
        raw = {}
        for arm, want_page in (("baseline", 256), ("changed", p["change"]["page_size"])):
            assert len(r["runs"][arm]) == 2
            for i, rid in enumerate(r["runs"][arm]):
                slack, pages = _slack_from_raw_rows(con, rid)
                assert pages == {want_page}  # the arm really ran at its page size
                assert slack == pytest.approx(r[arm][i], rel=1e-9)
                labels = dict(con.execute("SELECT key, value FROM run_info WHERE run_id = ?", [rid]).fetchall())
                assert (labels["verify_arm"], labels["verify_of"], labels["verify_rep"]) == (arm, run, str(i))
                assert labels["page_size"] == str(want_page)
            raw[arm] = [r[arm][i] for i in range(2)]
        stored = con.execute("SELECT verdict, result FROM verifications WHERE run_id = ? AND finding_id = ?",
                             [run, "kv-internal-fragmentation"]).fetchall()
    finally:
        con.close()
    again = verdict(Prediction(**p), raw["baseline"], raw["changed"])
    assert (again.verdict, again.effect) == (r["verdict"], pytest.approx(r["effect"]))
    assert r["effect_high"] < 0  # smaller pages: less slack, beyond the run-to-run noise
    assert len(stored) == 1 and stored[0][0] == r["verdict"] and json.loads(stored[0][1])["verify_id"] == r["verify_id"]


def test_verify_refuses_a_run_it_cannot_replay(tmp_path):
    db = str(tmp_path / "v.duckdb")
    load(os.path.join(DATA_DIR, "prefix-miss-vllm"), db)
    out = subprocess.run([sys.executable, "-m", "phasescope.cli", "verify", "--db", db], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1
    assert "vLLM run needs its server restarted" in out.stderr and "Traceback" not in out.stderr
