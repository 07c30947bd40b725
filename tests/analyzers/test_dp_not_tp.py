"""Data-parallel engines are replicas, not TP ranks: the TP rules never compare ranks of two engines.

The `tp-imbalance` fixture's ranks fire tp-kv-imbalance, tp-straggler and tp-kv-head-replication when they are
one replica's TP ranks (no labels, or tp = the world size); the same rows labelled as DP engines of TP 1
(a vLLM server's engine i reports as rank i x TP) fire none of them, and a DP x TP layout compares the TP ranks
within each engine only."""

from __future__ import annotations

import os

import duckdb
import pytest

from builders.scenarios import DATA_DIR, load
from phasescope.analyzers.geometry import ModelGeometry
from phasescope.analyzers.runinfo import record_run_info
from phasescope.analyzers.sql import model_parallel_size, world_size
from phasescope.analyzers.tp import tp_kv_head_replication, tp_kv_imbalance, tp_straggler

TP_RULES = ("tp-kv-imbalance", "tp-straggler", "tp-kv-head-replication")


def _found(con, run, model):
    out = tp_kv_imbalance(con, run) + tp_straggler(con, run) + tp_kv_head_replication(con, run, model=model)
    return {f.id: f for f in out}


@pytest.fixture
def store(tmp_path):
    db = str(tmp_path / "tp.duckdb")
    run = load(os.path.join(DATA_DIR, "tp-imbalance"), db)
    return db, run


def _model(kv_heads: int) -> ModelGeometry:
    return ModelGeometry(layers=2, heads=4, kv_heads=kv_heads, head_dim=16, hidden=64, intermediate=128, vocab=128)


def test_one_replica_fires_the_tp_rules_and_dp_engines_fire_none(store):
    db, run = store
    con = duckdb.connect(db)
    try:
        world = world_size(con, run)
        assert world >= 2
        model = _model(kv_heads=1)  # fewer KV heads than ranks: replicated when the ranks are TP ranks
        assert set(_found(con, run, model)) == set(TP_RULES)  # no labels: one replica over the world
        assert model_parallel_size(con, run) == world
    finally:
        con.close()
    record_run_info(db, run, tp=world, pp=1, dp=1)
    con = duckdb.connect(db)
    try:
        assert set(_found(con, run, _model(kv_heads=1))) == set(TP_RULES)
    finally:
        con.close()
    record_run_info(db, run, tp=1, pp=1, dp=world)  # the same rows as `world` engines of TP 1
    con = duckdb.connect(db)
    try:
        assert model_parallel_size(con, run) == 1 and world_size(con, run) == world
        assert _found(con, run, _model(kv_heads=1)) == {}
    finally:
        con.close()


def test_dp_by_tp_compares_the_ranks_within_each_engine(store):
    """TP 2 x DP 2 over the fixture's 4 ranks (KV MiB 100, 100, 100, 140): engine 1 (ranks 2, 3) is 140 / 120 - 1
    = 16.7 % unbalanced, engine 0 not at all; the 4-rank figure (140 / 110 - 1 = 27 %) is never claimed."""
    from builders.synthetic import TP_KV_MIB

    db, run = store
    assert list(TP_KV_MIB) == [100, 100, 100, 140]
    record_run_info(db, run, tp=2, pp=1, dp=2)
    con = duckdb.connect(db)
    try:
        f = {x.id: x for x in tp_kv_imbalance(con, run)}
        e = f["tp-kv-imbalance"].evidence
        assert e["replica"] == 1 and e["ranks"] == 2 and set(e["kv_bytes_mean_by_rank"]) == {2, 3}
        assert e["kv_imbalance"] == pytest.approx(140 / 120 - 1, rel=1e-12)
        assert tp_straggler(con, run) == []  # per-engine skew is not built: no claim across engines
    finally:
        con.close()
