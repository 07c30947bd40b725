"""`phasescope sweep` on HF continuous batching in-process (issue 28): points, knee, binding constraint.

Two sweeps of 5 rates on the demo's random-weight Llama (2 layers, 6 requests per point, 3-6 output tokens),
each built so one constraint binds: a KV pool of 5 pages of 16 tokens (KV-bound) and a cap of 2 requests per
step with a roomy pool (batch ceiling). SLOs are loose (1000 s) so the knee is the top rate whatever the
machine's load and the constraint is read there: the verdict does not depend on timing. Every figure is
checked against the raw rows of the store.
"""

from __future__ import annotations

import csv
import json
import os
import statistics

import duckdb
import pytest

from phasescope.analyzers.runinfo import read_run_info
from phasescope.analyzers.sweep import PRECEDENCE, Slo, constraints_at, evidence_point, find_knee, point_metrics

RATES = [4.0, 8.0, 16.0, 64.0, 256.0]  # the top one is near a burst: concurrency on a fast host too
LOOSE = Slo(ttft_s=1000.0, tpot_s=1000.0)


def _pts(*att):
    return [{"rate_per_s": r, "attainment": a} for r, a in zip((1, 2, 4, 8, 16), att)]


def test_knee_is_the_largest_rate_whose_attainment_and_every_lower_ones_meets_the_target():
    assert find_knee(_pts(1.0, 0.95, 0.9, 0.5, 0.2)) == 2  # 0.9 meets 0.9
    assert evidence_point(_pts(1.0, 0.95, 0.9, 0.5, 0.2)) == 3  # where it broke
    assert find_knee(_pts(1.0, 0.5, 0.95, 0.2, 0.1)) == 0  # a lucky point above a miss is not the knee
    assert find_knee(_pts(0.8, 0.9, 1.0, 1.0, 1.0)) is None
    assert evidence_point(_pts(0.8, 0.9, 1.0, 1.0, 1.0)) == 0
    assert find_knee(_pts(1, 1, 1, 1, 1)) == 4 and evidence_point(_pts(1, 1, 1, 1, 1)) == 4
    assert find_knee(_pts(1.0, 0.85, 0.8, 0.5, 0.2), target=0.8) == 2
    # unordered input: indexes are into the list as given
    pts = _pts(1.0, 1.0, 0.5, 1.0, 1.0)[::-1]
    assert find_knee(pts) == 3 and evidence_point(pts) == 2
    with pytest.raises(ValueError):
        find_knee(_pts(1, 1, 1, 1, 1), target=0)
    with pytest.raises(ValueError):
        Slo(ttft_s=-1)


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """{'kv': result, 'batch': result}: two 5-rate sweeps into one DuckDB file (one model for both)."""
    pytest.importorskip("transformers")
    from phasescope.cli.demo import DemoConfig, build_model
    from phasescope.cli.sweep import TINY, run_sweep

    base = DemoConfig(requests=6, device="cpu", **TINY)  # `phasescope sweep --tiny`
    model, device = build_model(base)
    db = str(tmp_path_factory.mktemp("sweep") / "sweep.duckdb")
    import dataclasses

    out = {
        "kv": run_sweep(db, dataclasses.replace(base, num_pages=5), RATES, LOOSE, sweep_id="kvsweep",
                        model=model, device=device),
        "batch": run_sweep(db, dataclasses.replace(base, num_pages=128, max_requests_per_batch=2), RATES, LOOSE,
                           sweep_id="batchsweep", model=model, device=device),
    }
    return db, out


def _con(db):
    return duckdb.connect(db, read_only=True)


@pytest.mark.slow
def test_points_are_labelled_runs_and_their_figures_match_the_raw_rows(sweeps):
    db, out = sweeps
    con = _con(db)
    try:
        for sid, res in (("kvsweep", out["kv"]), ("batchsweep", out["batch"])):
            assert [p["rate_per_s"] for p in res["points"]] == RATES
            assert res["knee_point"] == 4 and res["evidence_point"] == 4  # loose SLOs: every point attains
            for p in res["points"]:
                labels = dict(con.execute("SELECT key, value FROM run_info WHERE run_id = ?", [p["run_id"]]).fetchall())
                assert labels["sweep_id"] == sid and int(labels["sweep_point"]) == p["point"]
                assert float(labels["sweep_rate_per_s"]) == p["rate_per_s"]
                rows = con.execute("SELECT status, ttft_s, tpot_s, arrival_ns, last_token_ns FROM requests "
                                   "WHERE run_id = ?", [p["run_id"]]).fetchall()
                assert p["requests"] == len(rows) == 6
                assert p["survival"] == sum(r[0] == "finished" for r in rows) / 6
                dur = (max(r[4] for r in rows) - min(r[3] for r in rows)) / 1e9
                assert p["duration_s"] == pytest.approx(dur)
                # a tight TTFT SLO at this point's median: goodput and attainment recomputed from the rows
                slo = Slo(ttft_s=statistics.median(r[1] for r in rows), tpot_s=1000.0)
                m = point_metrics(con, p["run_id"], slo)
                good = sum(r[0] == "finished" and r[1] <= slo.ttft_s for r in rows)
                assert m["good"] == good >= 3  # at least half the TTFTs are <= their median
                assert m["goodput_req_per_s"] == pytest.approx(good / dur)
                assert m["attainment"] == pytest.approx(good / 6)
                ttfts = sorted(r[1] for r in rows)
                assert p["ttft_p50_s"] == pytest.approx(statistics.median(ttfts))
                assert p["itl_p99_s"] is not None and p["itl_p99_s"] > 0
    finally:
        con.close()


@pytest.mark.slow
def test_tiny_kv_pool_is_named_kv_bound_with_figures_from_the_rows(sweeps):
    db, out = sweeps
    res = out["kv"]
    b = res["binding"]
    assert b is not None and b["name"] == "kv-capacity", res["constraints"]
    run = res["points"][res["evidence_point"]]["run_id"]
    con = _con(db)
    try:
        usage, pages = con.execute("SELECT max(used_pages / total_pages), max(total_pages) FROM kv_snapshots k "
                                   "JOIN sources s USING (source_id) WHERE s.run_id = ? AND total_pages > 0",
                                   [run]).fetchone()
        pre, = con.execute("SELECT sum(preemptions) FROM requests WHERE run_id = ?", [run]).fetchone()
    finally:
        con.close()
    f = b["figures"]
    assert f["block_usage_max"] == pytest.approx(usage) and usage >= 0.9
    assert f["total_pages"] == pages == 5
    assert f["preemptions"] == pre >= 1
    assert f"num_blocks={f['pages_for_peak']}" in b["change"] and f["pages_for_peak"] > 5
    assert "--" not in b["change"]  # HF CB has no command-line flags: the change is its config


@pytest.mark.slow
def test_max_two_requests_per_step_is_named_the_batch_ceiling_with_figures_from_the_rows(sweeps):
    db, out = sweeps
    res = out["batch"]
    b = res["binding"]
    assert b is not None and b["name"] == "batch-ceiling", res["constraints"]
    run = res["points"][res["evidence_point"]]["run_id"]
    con = _con(db)
    try:
        seqs = [r[0] for r in con.execute("SELECT t.num_seqs FROM steps t JOIN sources s USING (source_id) "
                                          "WHERE s.run_id = ?", [run]).fetchall()]
        queues = [r[0] for r in con.execute("SELECT queue_s FROM requests WHERE run_id = ? AND ttft_s IS NOT NULL",
                                            [run]).fetchall()]
        ttfts = [r[0] for r in con.execute("SELECT ttft_s FROM requests WHERE run_id = ? AND ttft_s IS NOT NULL",
                                           [run]).fetchall()]
    finally:
        con.close()
    f = b["figures"]
    assert f["cap"] == 2 and f["max_running"] == max(seqs) == 2
    assert f["at_cap_share"] == pytest.approx(sum(n >= 2 for n in seqs) / len(seqs))
    assert f["queue_p50_s"] == pytest.approx(statistics.median(queues))
    assert f["queue_share_of_ttft"] == pytest.approx(sum(queues) / sum(ttfts)) and f["queue_share_of_ttft"] >= 0.5
    assert "ContinuousBatchingConfig(max_requests_per_batch=4) (now 2)" in b["change"]
    kv = next(c for c in res["constraints"] if c["name"] == "kv-capacity")
    assert not kv["binds"]  # 128 pages: the pool never filled
    assert [c["name"] for c in res["constraints"]] == list(PRECEDENCE)


@pytest.mark.slow
def test_outputs_json_csv_and_summary(sweeps, tmp_path):
    from rich.console import Console

    from phasescope.cli.sweep import print_summary, write_outputs

    _, out = sweeps
    res = out["batch"]
    paths = write_outputs(res, str(tmp_path))
    with open(paths["json"]) as f:
        assert json.load(f)["binding"]["name"] == "batch-ceiling"
    with open(paths["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [float(r["rate_per_s"]) for r in rows] == RATES
    assert float(rows[4]["goodput_req_per_s"]) == pytest.approx(res["points"][4]["goodput_req_per_s"])
    try:
        import matplotlib  # noqa: F401
        assert paths["png"] and os.path.getsize(paths["png"]) > 0
    except ImportError:
        assert paths["png"] is None
    console = Console(record=True, width=120)
    print_summary(res, paths, console)
    text = console.export_text()
    assert "binding constraint: batch-ceiling" in text and "knee: 256 req/s" in text
    assert len(text.splitlines()) <= 30  # one screen


@pytest.mark.slow
@pytest.mark.parametrize("case,name,mark", [("kv", "kv-capacity", "missed_preempted"),
                                            ("batch", "batch-ceiling", "missed_mostly_queued")])
def test_with_misses_a_constraint_binds_only_when_it_marks_half_the_missed_requests(sweeps, case, name, mark):
    db, out = sweeps
    res = out[case]
    run = res["points"][res["evidence_point"]]["run_id"]
    con = _con(db)
    try:
        rows = con.execute("SELECT ttft_s, coalesce(preemptions, 0), queue_s FROM requests WHERE run_id = ?",
                           [run]).fetchall()
        slo = Slo(ttft_s=statistics.median(r[0] for r in rows), tpot_s=1000.0)  # about half the requests miss
        c = next(x for x in constraints_at(con, run, read_run_info(con, run), slo) if x.name == name)
    finally:
        con.close()
    missed = [r for r in rows if not r[0] <= slo.ttft_s]
    marked = sum(r[1] > 0 for r in missed) if mark == "missed_preempted" else sum(r[2] >= 0.5 * r[0] for r in missed)
    assert c.figures["missed"] == len(missed) >= 1 and c.figures[mark] == marked
    assert c.binds == (marked / len(missed) >= 0.5)
