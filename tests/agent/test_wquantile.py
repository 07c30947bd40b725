"""Exact weighted quantiles by selection (agent/read/wquantile.py) equal quantile_cont over the expanded samples."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest

from phasescope.agent.read import wquantile
from phasescope.agent.records.errors import ReadError

QS = (0.0, 0.01, 0.5, 0.9, 0.99, 0.999, 1.0)


def _table(values, weights) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.execute("CREATE TABLE t (v DOUBLE, w BIGINT)")
    con.execute("INSERT INTO t SELECT unnest($v), unnest($w)", {"v": [float(x) for x in values],
                                                                "w": [int(x) for x in weights]})
    return con


def _expanded(values, weights, qs):
    x = np.repeat(np.asarray(values, dtype=float), np.asarray(weights, dtype=np.int64))
    return [float(np.quantile(x, q)) for q in qs]  # linear at (n - 1) q: DuckDB's quantile_cont


@pytest.mark.parametrize("seed", range(6))
def test_equal_to_the_expanded_samples_quantiles(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    # a mix of what ITL gaps look like: a mode of near-equal values, a long tail, exact repeats, zeros, negatives
    v = np.concatenate([rng.normal(20, 0.01, n), rng.lognormal(3, 2, n // 3 + 1), np.full(n // 5 + 1, 7.25),
                        np.zeros(seed), -rng.lognormal(0, 1, seed)])
    w = rng.integers(0, 4, v.size)
    w[0] = 1
    con = _table(v, w)
    got_n, got = wquantile.quantiles(con, "t", "v", "w", QS)
    assert got_n == int(w.sum())
    assert got == pytest.approx(_expanded(v, w, QS), rel=1e-12, abs=1e-12)


def test_one_sample_none_and_every_weight_zero():
    assert wquantile.quantiles(_table([3.5], [2]), "t", "v", "w", (0.5, 0.99)) == (2, [3.5, 3.5])
    assert wquantile.quantiles(_table([3.5, 4.0], [0, 0]), "t", "v", "w", (0.5,)) == (0, [None])
    assert wquantile.quantiles(_table([], []), "t", "v", "w", (0.5,)) == (0, [None])


def test_ranks_on_both_sides_of_a_bucket_edge_and_far_apart():
    # two values in adjacent buckets and one far away: h = 1.5 falls between buckets, the p99 in another span
    v, w = [1.0, np.exp(1 / 2048) * 1.0001, 1e6], [2, 2, 1]
    got_n, got = wquantile.quantiles(_table(v, w), "t", "v", "w", (0.375, 0.5, 0.99))
    assert got_n == 5 and got == pytest.approx(_expanded(v, w, (0.375, 0.5, 0.99)), rel=1e-12)


def test_a_source_that_changes_between_the_passes_is_an_error_not_a_wrong_answer(monkeypatch):
    con = _table([1.0, 2.0, 3.0], [1, 1, 1])
    real = wquantile._order_statistics

    def grown(con, source, *a, **k):
        con.execute("DELETE FROM t")  # a writer between the passes
        return real(con, source, *a, **k)

    monkeypatch.setattr(wquantile, "_order_statistics", grown)
    with pytest.raises(ReadError, match="changed between the two passes"):
        wquantile.quantiles(con, "t", "v", "w", (0.5,))


@pytest.mark.parametrize("change", ["DELETE FROM t WHERE v = 2.0", "INSERT INTO t VALUES (2.0, 5)"])
def test_both_passes_read_one_snapshot_and_rows_added_or_lost_outside_it_are_an_error(monkeypatch, tmp_path, change):
    """On a file another connection appends to, the two passes read one snapshot (the right answer); where they
    cannot (the caller's transaction is not ours), a change between them in either direction is an error."""
    path = str(tmp_path / "q.duckdb")
    con = duckdb.connect(path)
    con.execute("CREATE TABLE t AS SELECT unnest([1.0, 2.0, 3.0])::DOUBLE AS v, 1 AS w")
    writer = con.cursor()  # another connection to the same database: commits of its own
    real = wquantile._order_statistics

    def between(con, source, *a, **k):
        writer.execute(change)
        return real(con, source, *a, **k)

    monkeypatch.setattr(wquantile, "_order_statistics", between)
    reader = con.cursor()
    assert wquantile.quantiles(reader, "t", "v", "w", (0.5,)) == (3, [2.0])  # its snapshot: before the change
    writer.execute("DELETE FROM t")
    writer.execute("INSERT INTO t SELECT unnest([1.0, 2.0, 3.0]), 1")

    monkeypatch.setattr(wquantile, "in_transaction", lambda con: True)  # as though the caller held one
    with pytest.raises(ReadError, match="changed between the two passes"):
        wquantile.quantiles(reader, "t", "v", "w", (0.5,))


def test_inside_the_callers_transaction_it_reads_there_and_leaves_it_usable():
    """A snapshot read (agent/read/snapshot.py) runs the quantiles inside its own transaction: no BEGIN of ours
    (it would fail and abort the caller's), and the caller's transaction still reads after."""
    con = _table([1.0, 2.0, 3.0], [1, 1, 1])
    assert not wquantile.in_transaction(con)
    con.execute("BEGIN TRANSACTION")
    assert wquantile.in_transaction(con)
    assert wquantile.quantiles(con, "t", "v", "w", (0.5,)) == (3, [2.0])
    assert con.execute("SELECT count(*) FROM t").fetchone()[0] == 3
    con.execute("ROLLBACK")
    assert not wquantile.in_transaction(con)
