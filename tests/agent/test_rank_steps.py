"""rank_steps' two-rank path (a step's median as lo + (hi - lo) * 0.5, no join back) gives what the general SQL
gives: on the recorded TP fixtures, on a TP-2 store whose ranks' times tie, and it leaves the general SQL to answer
a store where a step holds one rank, or a rank twice."""

from __future__ import annotations

import os

import duckdb
import pytest

from builders.scenarios import DATA_DIR, load
from phasescope.agent.read import queries
from phasescope.agent.read.queries import STEP_MS

GENERAL = f"""WITH t AS (SELECT t.step_id, t.rank, {STEP_MS} AS ms FROM steps t JOIN sources s USING (source_id)
                   WHERE t.step_id % $k = 0 AND s.run_id = $run),
             g AS (SELECT step_id, max(ms) AS mx, median(ms) AS med, arg_max(rank, ms) AS slow
                   FROM t GROUP BY step_id HAVING count(*) > 1)
        SELECT t.rank, median(t.ms), count(*) FILTER (WHERE g.slow = t.rank) / count(*),
               avg(g.mx / nullif(g.med, 0) - 1)
        FROM t JOIN g USING (step_id) GROUP BY t.rank ORDER BY t.rank"""


def general(con, run, k=1):
    return [dict(zip(("rank", "p50_ms", "slowest_share", "skew_mean"), r))
            for r in con.execute(GENERAL, {"run": run, "k": k}).fetchall()]


def same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["rank"] == w["rank"] and g["p50_ms"] == w["p50_ms"] and g["slowest_share"] == w["slowest_share"]
        assert g["skew_mean"] == pytest.approx(w["skew_mean"], rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("name", ["tp2-h200", "tp-imbalance"])
def test_rank_steps_equal_the_general_sql(tmp_path, name):
    path = str(tmp_path / "run.duckdb")
    run = load(os.path.join(DATA_DIR, name), path)
    con = duckdb.connect(path)
    want = general(con, run)
    assert len(want) >= 2
    same(queries.rank_steps(con, run), want)
    same(queries.rank_steps(con, run, max_rows=50), general(con, run, k=-(-queries.run_span(con, run)["steps"] // 50)))
    con.close()


def test_two_rank_path_and_its_limits(tmp_path):
    path = str(tmp_path / "run.duckdb")
    run = load(os.path.join(DATA_DIR, "tp2-h200"), path)
    con = duckdb.connect(path)
    assert con.execute("SELECT max(world_size) FROM sources WHERE run_id = ?", [run]).fetchone()[0] == 2
    # ties and a fraction that does not halve exactly
    con.execute("UPDATE steps SET gpu_ms = 'nan', host_ms = CASE WHEN step_id % 3 = 0 THEN 5.0 ELSE 0.1 * (rank + 1) + step_id / 7 END")
    same(queries.rank_steps(con, run), general(con, run))
    # a step on one rank only: the general SQL answers (it leaves that step out of every figure)
    con.execute("DELETE FROM steps WHERE rowid IN (SELECT min(rowid) FROM steps)")
    same(queries.rank_steps(con, run), general(con, run))
    # a rank twice in a step (a restarted worker counting from 0 again)
    con.execute("INSERT INTO steps SELECT * REPLACE (ts_ns + 1 AS ts_ns, host_ms + 1 AS host_ms) FROM steps "
                "WHERE rowid IN (SELECT max(rowid) FROM steps)")
    same(queries.rank_steps(con, run), general(con, run))
    con.close()
