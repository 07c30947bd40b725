"""Request reads from the stored rows (derived.stored: nothing left to derive) give what the `requests` and
`itl` views give, on the recorded fixtures; with events written since the last fold, or deleted below its
watermark, the views answer."""

from __future__ import annotations

import os

import duckdb
import pytest

from builders.scenarios import DATA_DIR, load
from phasescope.agent.read import base, queries
from phasescope.agent.records import derived

FIXTURES = sorted(n for n in os.listdir(DATA_DIR) if os.path.exists(os.path.join(DATA_DIR, n, "request_events.parquet")))


def reads(con, run):
    out = {"summary": queries.request_summary(con, run), "slo": queries.slo_attainment(con, run),
           "prefix": queries.prefix_summary(con, run), "pages": queries.page_size_whatif(con, run)}
    for m in ("ttft", "tpot", "e2e", "queue", "itl"):
        out[m] = queries.latency_histogram(con, run, metric=m)
    return out


def through_views(con, run):
    saved = base._stored  # where the reads look up the stored rows (agent/read/base.py)
    base._stored = lambda c: None
    try:
        return reads(con, run)
    finally:
        base._stored = saved


@pytest.mark.parametrize("name", FIXTURES[::2])
def test_stored_reads_equal_the_views(tmp_path, name):
    path = str(tmp_path / "run.duckdb")
    run = load(os.path.join(DATA_DIR, name), path)
    con = duckdb.connect(path, read_only=True)
    assert derived.stored(con) is not None
    assert reads(con, run) == through_views(con, run)
    con.close()


def test_the_views_answer_when_there_is_something_to_derive(tmp_path):
    path = str(tmp_path / "run.duckdb")
    run = load(os.path.join(DATA_DIR, "service-mix"), path)
    con = duckdb.connect(path)
    before = reads(con, run)
    # a second copy of some requests, not folded yet: the views derive them, and the reads see them
    con.execute("INSERT INTO request_events BY NAME SELECT * REPLACE (request_id || '-again' AS request_id, "
                "ts_ns + 10**9 AS ts_ns) FROM request_events WHERE rowid % 4 = 0")
    assert derived.stored(con) is None
    after = reads(con, run)
    assert after != before and after == through_views(con, run)
    derived.refresh(con)
    assert derived.stored(con) is not None
    assert reads(con, run) == after
    con.execute("DELETE FROM request_events WHERE rowid < 3")  # below the watermark, not folded: not the stored rows
    assert derived.stored(con) is None
    con.close()
