"""Rules that need a GPU, on a real run recorded on an NVIDIA H200 (tests/data/h200-demo)."""

from __future__ import annotations

import json
import math
import os

import duckdb
import pytest

from builders import scenarios
from phasescope.analyzers.diagnose import diagnose

FIXTURE = os.path.join(scenarios.DATA_DIR, "h200-demo")


@pytest.fixture(scope="module")
def h200(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("h200") / "run.duckdb")
    run_id = scenarios.load(FIXTURE, path)
    con = duckdb.connect(path, read_only=True)
    yield con, run_id
    con.close()


def test_recorded_gpu_run_has_event_timing_and_nvml_samples(h200):
    con, run_id = h200
    timed, steps = con.execute("SELECT count(*) FILTER (WHERE NOT isnan(gpu_ms)), count(*) FROM steps").fetchone()
    assert timed == steps > 100  # every step CUDA-event timed
    name, total = con.execute("SELECT any_value(value), (SELECT max(mem_total_bytes) FROM gpu_samples) "
                              "FROM run_info WHERE run_id = ? AND key = 'gpu_name'", [run_id]).fetchone()
    assert "H200" in name and total > 140 * 10**9


def test_launch_bound_and_below_roofline_fire_with_the_measured_busy_fraction(h200):
    con, run_id = h200
    found = {f.id: f for f in diagnose(con, run_id)}
    expect = json.load(open(os.path.join(FIXTURE, "config.json")))["expect"]
    assert set(expect) <= set(found)
    e = found["decode-launch-bound"].evidence
    # independently: NVML utilisation averaged over the samples taken while the run's steps ran
    util = con.execute(
        """WITH span AS (SELECT min(t.ts_ns + s.wall_minus_mono_ns) lo, max(t.ts_ns + s.wall_minus_mono_ns) hi
                         FROM steps t JOIN sources s USING (source_id) WHERE s.run_id = ?)
           SELECT avg(util_pct) FROM gpu_samples g JOIN sources s USING (source_id), span
           WHERE g.ts_ns + s.wall_minus_mono_ns BETWEEN span.lo AND span.hi""", [run_id]).fetchone()[0]
    assert math.isclose(e["util_pct_mean"], util, rel_tol=0.25)  # the rule's window may differ by a sample
    assert e["busy_fraction"] < 0.05


def test_real_two_rank_tp_run_is_balanced_and_names_no_straggler(tmp_path):
    folder = os.path.join(scenarios.DATA_DIR, "tp2-h200")
    config = json.load(open(os.path.join(folder, "config.json")))
    path = str(tmp_path / "tp.duckdb")
    run_id = scenarios.load(folder, path)
    con = duckdb.connect(path, read_only=True)
    try:
        per_rank = con.execute("SELECT rank, count(*), count(*) FILTER (WHERE NOT isnan(gpu_ms)) FROM steps "
                               "GROUP BY rank ORDER BY rank").fetchall()
        assert per_rank == [(0, 192, 192), (1, 192, 192)]  # same steps on both NCCL ranks, all event-timed
        from phasescope.agent.read.queries import rank_steps

        ranks = rank_steps(con, run_id)
        assert [r["rank"] for r in ranks] == [0, 1]
        assert sum(r["slowest_share"] for r in ranks) == pytest.approx(1.0)
        assert ranks[0]["skew_mean"] < 0.05  # balanced ranks
        found = {f.id for f in diagnose(con, run_id)}
    finally:
        con.close()
    assert set(config["expect"]) <= found
    assert not set(config["must_not"]) & found
