"""run_span (every page's sidebar) and rank_steps' step count read per source first: the same figures as over
every step joined to its source, on every recorded fixture and over every run."""

from __future__ import annotations

import os

import duckdb
import pytest

from builders.scenarios import DATA_DIR, load
from phasescope.agent.read import queries

FIXTURES = sorted(n for n in os.listdir(DATA_DIR) if os.path.exists(os.path.join(DATA_DIR, n, "steps.parquet")))
JOINED = """SELECT count(*), min(t.ts_ns + s.wall_minus_mono_ns), max(t.ts_ns + s.wall_minus_mono_ns)
            FROM steps t JOIN sources s USING (source_id) WHERE true {where}"""


def todays_run_span(con, run_id):
    where, params = queries._run_filter(run_id)
    n, lo, hi = con.execute(JOINED.format(where=where), params).fetchone()
    return {"steps": n, "span_s": (hi - lo) / 1e9 if n else 0.0}


@pytest.mark.parametrize("name", FIXTURES[::3])
def test_run_span_equals_the_joined_sql(tmp_path, name):
    path = str(tmp_path / "run.duckdb")
    run = load(os.path.join(DATA_DIR, name), path)
    con = duckdb.connect(path)
    for r in (run, None, "no-such-run"):
        assert queries.run_span(con, r) == todays_run_span(con, r)
    # a second source of the run on another wall offset, and a step of a source no row of `sources` names
    con.execute("INSERT INTO sources SELECT * REPLACE (source_id + 1000 AS source_id, wall_minus_mono_ns - 7 * 10**9 "
                "AS wall_minus_mono_ns) FROM sources WHERE run_id = ?", [run])
    con.execute("INSERT INTO steps SELECT * REPLACE (source_id + 1000 AS source_id, ts_ns + 10**9 AS ts_ns) FROM steps "
                "WHERE rowid % 2 = 0")
    con.execute("INSERT INTO steps SELECT * REPLACE (987654 AS source_id) FROM steps LIMIT 3")
    for r in (run, None):
        assert queries.run_span(con, r) == todays_run_span(con, r)
    con.close()
