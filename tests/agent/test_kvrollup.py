"""The ten-second KV rollup (agent/records/kvrollup.py) and the KV reads over it (agent/read/kvreads.py).

kv_summary, kv_timeline and rank_kv read from the rollup must give what the raw SQL gives (integers exactly,
floats to 1e-12 relative: sums add in another order) on every recorded fixture with KV snapshots; a rollup
folded piecemeal (snapshots and steps arriving late, the run's start moving) must equal one built at once;
and a rollup that cannot answer (rows deleted below its watermark, a bucket or window not made of whole
cells) must leave the raw answer.
"""

from __future__ import annotations

import math
import os

import duckdb
import pytest

from builders.scenarios import DATA_DIR, load
from phasescope.agent.read import kvreads, queries
from phasescope.agent.records import derived, kvrollup

FIXTURES = sorted(n for n in os.listdir(DATA_DIR) if os.path.exists(os.path.join(DATA_DIR, n, "kv_snapshots.parquet")))
NAMES = ("kv_summary", "kv_timeline", "rank_kv")


def same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for k, v in w.items():
            if isinstance(v, float) and not math.isnan(v):
                assert g[k] == pytest.approx(v, rel=1e-12, abs=1e-300), (k, g, w)
            elif isinstance(v, float):
                assert isinstance(g[k], float) and math.isnan(g[k]), (k, g, w)
            else:
                assert g[k] == v and type(g[k]) is type(v), (k, g, w)


def raw(name: str, *args, **kw):
    """The raw SQL's answer (the rollup's read switched off)."""
    saved = getattr(kvreads, name)
    setattr(kvreads, name, lambda *a, **k: None)
    try:
        return queries.QUERIES[name](*args, **kw)
    finally:
        setattr(kvreads, name, saved)


def calls(run: str, bucket: float):
    yield "kv_summary", {}
    for name in ("kv_timeline", "rank_kv"):
        yield name, {"bucket_s": bucket, "since_s": 0.0}
        yield name, {"bucket_s": 10.0, "since_s": 10.0, "until_s": 40.0}
        yield name, {"bucket_s": bucket}


def check(con, run: str, rollup: bool = True) -> None:
    span = queries.run_span(con, run)["span_s"] or 0.0
    for bucket in (10.0, float(10 * max(1, round(span / 70)))):
        for name, kw in calls(run, bucket):
            got = queries.QUERIES[name](con, run, **kw)
            want = raw(name, con, run, **kw)
            if rollup:
                assert getattr(kvreads, name)(con, run, *([] if name == "kv_summary" else
                                                          [kw["bucket_s"], kw.get("since_s"), kw.get("until_s")])) \
                    is not None, name
            same(got, want)


@pytest.mark.parametrize("name", FIXTURES)
def test_rollup_reads_equal_the_raw_sql(tmp_path, name):
    path = str(tmp_path / "run.duckdb")
    run = load(os.path.join(DATA_DIR, name), path)
    con = duckdb.connect(path, read_only=True)
    assert kvrollup.usable(con, run) is not None  # the loader folds like the sidecar: the rollup answers
    check(con, run)
    con.close()


def rollup_rows(con) -> list:
    rows = con.execute("SELECT * EXCLUDE (page_size, kv_dtype) FROM kv_rollup").fetchall()
    return sorted((tuple(round(v, 9) if isinstance(v, float) else v for v in r) for r in rows), key=repr)


def test_folded_piecemeal_equals_built_at_once(tmp_path):
    """Snapshots and steps inserted in shuffled batches (the run's start moves when an earlier step comes) and
    folded after each batch give the rollup a single fold of them all gives."""
    path = str(tmp_path / "run.duckdb")
    run = load(os.path.join(DATA_DIR, "tp-imbalance"), path)
    con = duckdb.connect(path)
    want = rollup_rows(con)
    assert want
    n_snaps, n_steps = (con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("kv_snapshots", "steps"))
    for table, seed in (("kv_snapshots", 7), ("steps", 8)):  # shuffled in SQL (executemany goes row by row)
        con.execute(f"CREATE TEMP TABLE _{table} AS SELECT *, row_number() OVER (ORDER BY hash(rowid + {seed})) - 1 AS i "
                    f"FROM {table}")
        con.execute(f"DELETE FROM {table}")
    derived.refresh(con)  # a deletion: rebuilt, empty
    assert rollup_rows(con) == []
    # snapshots first (no steps: no start, nothing folded), then the steps in an order whose start moves
    marks = [(0, n_snaps // 3, 0, 0), (n_snaps // 3, n_snaps // 2, 0, n_steps // 2),
             (n_snaps // 2, n_snaps, n_steps // 2, n_steps)]
    for a, b, c, d in marks:
        con.execute(f"INSERT INTO kv_snapshots SELECT * EXCLUDE (i) FROM _kv_snapshots WHERE i >= {a} AND i < {b}")
        con.execute(f"INSERT INTO steps SELECT * EXCLUDE (i) FROM _steps WHERE i >= {c} AND i < {d}")
        derived.refresh(con)
        if d:
            check(con, run)
    assert rollup_rows(con) == want
    con.close()


def test_reads_past_the_watermark_and_after_deletions_stay_right(tmp_path):
    path = str(tmp_path / "run.duckdb")
    run = load(os.path.join(DATA_DIR, "kv-pressure"), path)
    con = duckdb.connect(path)
    # snapshots written since the last fold: binned at read time
    con.execute("INSERT INTO kv_snapshots BY NAME SELECT * REPLACE (ts_ns + 1 AS ts_ns, used_pages // 2 AS used_pages, "
                "kv_bytes * 3 AS kv_bytes) FROM kv_snapshots WHERE rowid % 3 = 0")
    assert kvrollup.usable(con, run) is not None
    check(con, run)
    # rows deleted below the watermark and not yet folded: the raw rows answer
    con.execute("DELETE FROM kv_snapshots WHERE rowid < 50")
    assert kvrollup.usable(con, run) is None
    check(con, run, rollup=False)
    derived.refresh(con)  # folded: the rollup answers again
    assert kvrollup.usable(con, run) is not None
    check(con, run)
    # a step before the run's first one, not yet folded: the cells count from another start, the raw rows answer
    con.execute("INSERT INTO steps BY NAME SELECT * REPLACE (ts_ns - 30 * 10**9 AS ts_ns) FROM steps LIMIT 1")
    assert kvrollup.usable(con, run) is None
    check(con, run, rollup=False)
    derived.refresh(con)
    assert kvrollup.usable(con, run) is not None
    check(con, run)
    # buckets and windows not made of whole cells: the raw rows answer
    assert kvreads.kv_timeline(con, run, 5.0, None, None) is None
    assert kvreads.rank_kv(con, run, 10.0, 1.0, None) is None
    assert kvreads.kv_summary(con, None) is None
    con.close()
