"""The ten-second step rollup (agent/records/steprollup.py) and the Phases reads over it (agent/read/phases.py).

`quantiles="approx"` must give the exact counts and token sums of the exact SQL and step-time quantiles within
steprollup.REL_ERROR of it, on every recorded fixture; a rollup folded piecemeal (steps arriving late, out of
order) must equal one built at once; and a rollup that cannot answer (rows deleted below its watermark, a
window that is not whole seconds) must leave the exact answer.
"""

from __future__ import annotations

import math
import os
import random

import duckdb
import numpy as np
import pytest

from builders.scenarios import DATA_DIR, load
from phasescope.agent.read import phases, queries
from phasescope.agent.records import derived, steprollup

FIXTURES = sorted(n for n in os.listdir(DATA_DIR) if os.path.exists(os.path.join(DATA_DIR, n, "steps.parquet")))
EXACT_KEYS = {"phase", "steps", "prefill_tokens", "decode_tokens", "gpu_timed", "t_s", "class", "prefill_tokens_mean"}


def close(approx: list[dict], exact: list[dict]) -> None:
    """Same rows, same counts and sums; each quantile within REL_ERROR of the exact one."""
    assert len(approx) == len(exact)
    for a, e in zip(approx, exact):
        assert set(a) == set(e)
        for k, want in e.items():
            got = a[k]
            if k in EXACT_KEYS:
                assert got == pytest.approx(want, rel=1e-12) if isinstance(want, float) else got == want, (k, a, e)
            elif want is None or want <= 0:
                assert got == want, (k, a, e)
            else:  # a step-time quantile
                assert abs(got - want) <= steprollup.REL_ERROR * want * (1 + 1e-9), (k, got, want)


def reads(con, run, bucket):
    for name, kw in (("phase_summary", {}), ("step_timeline", {"bucket_s": bucket, "since_s": 0.0}),
                     ("step_timeline", {"bucket_s": bucket, "since_s": 10.0, "until_s": 30.0}),
                     ("interference", {"since_s": 10.0, "until_s": 20.0}),
                     ("interference", {"since_s": 0.0})):
        yield name, queries.QUERIES[name](con, run, quantiles="approx", **kw), queries.QUERIES[name](con, run, **kw)


@pytest.mark.parametrize("name", FIXTURES)
def test_approx_reads_are_exact_counts_and_bounded_quantiles(tmp_path, name):
    path = str(tmp_path / "run.duckdb")
    run = load(os.path.join(DATA_DIR, name), path)
    con = duckdb.connect(path, read_only=True)
    assert steprollup.usable(con, run) is not None  # the loader folds like the sidecar: the rollup answers
    assert phases.phase_summary(con, run) is not None
    span = queries.run_span(con, run)["span_s"]
    for bucket in (10.0, float(10 * max(1, round(span / 70)))):
        for q, approx, exact in reads(con, run, bucket):
            close(approx, exact)
    con.close()


def test_quantiles_from_bins_are_within_the_stated_error():
    rng = np.random.default_rng(3)
    for x in (rng.lognormal(2.0, 1.0, 5001), rng.uniform(7.9, 8.1, 999), np.array([5.0]), np.array([3.0, 3.0, 9.0]),
              np.concatenate([rng.lognormal(0, 0.01, 100), rng.lognormal(5, 0.01, 3)])):
        bins: dict[int, list[float]] = {}
        for v in x:
            bins.setdefault(math.floor(math.log2(v) * steprollup.BINS_PER_DOUBLING), []).append(float(v))
        hist = [(b, len(v), min(v), max(v)) for b, v in sorted(bins.items())]
        for p, got in zip((0.0, 0.1, 0.5, 0.95, 0.99, 1.0), steprollup.quantiles(hist, [0.0, 0.1, 0.5, 0.95, 0.99, 1.0])):
            want = float(np.quantile(x, p))  # linear: DuckDB's quantile_cont
            assert abs(got - want) <= steprollup.REL_ERROR * want * (1 + 1e-9), (p, got, want)
    assert steprollup.quantiles([], [0.5]) == [None]
    assert 0.0054 < steprollup.REL_ERROR < 0.0055


def rollup_rows(con) -> list:
    return sorted(con.execute("SELECT * FROM step_rollup").fetchall(), key=repr)


def test_folded_piecemeal_equals_built_at_once(tmp_path):
    """Steps inserted in shuffled batches (a rank's first steps after the other's later ones: the run's start
    moves) and folded after each batch give the rollup a single fold of them all gives."""
    path = str(tmp_path / "run.duckdb")
    load(os.path.join(DATA_DIR, "prefill-interference"), path)
    con = duckdb.connect(path)
    want = rollup_rows(con)
    assert want
    steps = con.execute("SELECT * FROM steps").fetchall()
    random.Random(5).shuffle(steps)
    con.execute("DELETE FROM steps")
    derived.refresh(con)  # a deletion: rebuilt, empty
    assert rollup_rows(con) == []
    marks = [0, len(steps) // 5, len(steps) // 2, len(steps) - 1, len(steps)]
    cols = len(steps[0])
    for lo, hi in zip(marks, marks[1:]):
        con.executemany(f"INSERT INTO steps VALUES ({', '.join('?' * cols)})", steps[lo:hi])
        derived.refresh(con)
    assert rollup_rows(con) == want
    con.close()


def test_reads_past_the_watermark_and_after_deletions_stay_right(tmp_path):
    path = str(tmp_path / "run.duckdb")
    run = load(os.path.join(DATA_DIR, "prefill-interference"), path)
    con = duckdb.connect(path)
    # steps written since the last fold (a writer that has not folded yet): binned at read time
    con.execute("INSERT INTO steps BY NAME SELECT * REPLACE (ts_ns + 1 AS ts_ns, host_ms * 3 AS host_ms, "
                "gpu_ms * 3 AS gpu_ms) FROM steps WHERE rowid % 3 = 0")
    assert steprollup.usable(con, run) is not None
    for q, approx, exact in reads(con, run, 10.0):
        close(approx, exact)
    # rows deleted below the watermark (retention rolled the oldest out) and not yet folded: the raw rows answer
    con.execute("DELETE FROM steps WHERE rowid < 50")
    assert steprollup.usable(con, run) is None
    for q, approx, exact in reads(con, run, 10.0):
        assert approx == exact
    derived.refresh(con)  # folded: the rollup answers again
    assert steprollup.usable(con, run) is not None
    for q, approx, exact in reads(con, run, 10.0):
        close(approx, exact)
    # buckets and windows not made of whole cells, another threshold: the raw rows answer
    assert queries.step_timeline(con, run, 5.0, quantiles="approx") == queries.step_timeline(con, run, 5.0)
    assert (queries.step_timeline(con, run, 10.0, since_s=1.0, quantiles="approx")
            == queries.step_timeline(con, run, 10.0, since_s=1.0))
    assert (queries.interference(con, run, long_prefill_tokens=64, quantiles="approx")
            == queries.interference(con, run, long_prefill_tokens=64))
    with pytest.raises(ValueError):
        queries.phase_summary(con, run, quantiles="roughly")
    con.close()
