"""Skew across data-parallel engines (issue 28): the `dp_balance` read and the sweep's `dp-skew` constraint.

Stated two-engine stores (tests/builders/synthetic.py `dp_engines`): vLLM's per-engine gauges from the API
server's stat logger, plus a /metrics scrape in the same run that says the opposite. Every figure is recomputed
here from the raw `server_metrics` rows, by the definitions in agent/read/dp.py, in plain Python
(tests/builders/dp_reference.py).
"""

from __future__ import annotations

import duckdb
import pytest

from builders.dp_reference import dp_by_hand as by_hand
from builders.synthetic import DP_BALANCED, DP_SKEWED, dp_engines
from phasescope.agent.read.dp import dp_balance, silent_engines
from phasescope.agent.read.queries import run_named
from phasescope.analyzers.constraints import suggested_flags
from phasescope.analyzers.runinfo import record_run_info
from phasescope.analyzers.sweep import PRECEDENCE, binding, constraints_at

VLLM_DP_FLAGS = {"--data-parallel-external-lb", "--data-parallel-hybrid-lb"}  # vLLM 0.32.0's arg_utils.py


@pytest.fixture
def store(tmp_path):
    db = str(tmp_path / "dp.duckdb")
    dp_engines(db, "dp-skewed", DP_SKEWED)
    dp_engines(db, "dp-balanced", DP_BALANCED)
    dp_engines(db, "dp-one", {0: DP_SKEWED[0]})  # engine 1 has neither gauges nor a probe
    dp_engines(db, "dp-idle", {0: DP_SKEWED[0]}, engines=2)  # engine 1's probe is there, it never stepped
    dp_engines(db, "dp-stepped", {0: DP_SKEWED[0]}, engines=2, stepped=[1])  # engine 1 stepped, no gauges
    dp_engines(db, "dp-unlabelled", {0: DP_SKEWED[0]}, engines=2)  # no dp label: nothing expected
    for run in ("dp-skewed", "dp-balanced", "dp-one", "dp-idle", "dp-stepped"):
        record_run_info(db, run, runtime="vllm", dp=2)
    con = duckdb.connect(db, read_only=True)
    yield con
    con.close()


def test_skewed_engines_bind_with_the_figures_of_the_raw_rows(store):
    cons = constraints_at(store, "dp-skewed", {"runtime": "vllm", "dp": "2"})
    assert [c.name for c in cons] == list(PRECEDENCE) and PRECEDENCE[0] == "dp-skew"
    b = binding(cons)
    assert b is not None and b.name == "dp-skew", cons
    want, f = by_hand(store, "dp-skewed"), b.figures
    assert f["engines"] == 2 and f["hot_engine"] == want["hot"] == 0 and f["source"] == "stat-logger"
    assert f["samples"] == want["samples"] == 70
    for e in (0, 1):
        assert f["kv_usage_mean_by_engine"][e] == pytest.approx(want["usage"][e], rel=1e-12)
        assert f["waiting_mean_by_engine"][e] == pytest.approx(want["waiting"][e], rel=1e-12, abs=1e-15)
    assert f["kv_imbalance"] == pytest.approx(want["kv_imbalance"], rel=1e-12)
    assert f["waiting_imbalance"] == pytest.approx(want["waiting_imbalance"], rel=1e-12)
    assert f["stranded_share"] == pytest.approx(want["stranded_share"], rel=1e-12)
    assert f["span_s"] == pytest.approx(want["span_s"], rel=1e-12)
    # what the stated gauges give: engine 0 ~0.7 of its KV against ~0.08, all of the queue on it (index 1 of 2
    # engines is "everything on one"), at cap or queueing while engine 1 idled from 1.4 s to the end (1.95 s)
    assert 0.7 < f["kv_imbalance"] < 0.9 and f["waiting_imbalance"] == pytest.approx(1.0)
    assert f["stranded_share"] == pytest.approx((1960 - 1400) / (1960 - 10), rel=1e-12)
    assert "X-data-parallel-rank" in b.change and set(suggested_flags(b.change)) == VLLM_DP_FLAGS
    assert f"{want['stranded_share']:.0%} of the time" in b.change


def test_balanced_engines_do_not_bind(store):
    cons = constraints_at(store, "dp-balanced", {"runtime": "vllm", "dp": "2"})
    dp = next(c for c in cons if c.name == "dp-skew")
    want = by_hand(store, "dp-balanced")
    assert not dp.binds and dp.figures["engines"] == 2
    assert dp.figures["kv_imbalance"] == pytest.approx(want["kv_imbalance"], rel=1e-12) and want["kv_imbalance"] < 0.1
    assert dp.figures["stranded_share"] == pytest.approx(want["stranded_share"], rel=1e-12)
    assert dp.figures["stranded_share"] < 0.2
    assert binding(cons) is None or binding(cons).name != "dp-skew"


def test_thresholds_decide_at_their_boundaries(store):
    f = by_hand(store, "dp-skewed")
    imb = max(f["kv_imbalance"], f["waiting_imbalance"])

    def binds(**kw):
        cons = constraints_at(store, "dp-skewed", {"runtime": "vllm"}, **kw)
        return next(c for c in cons if c.name == "dp-skew").binds

    assert binds(max_dp_imbalance=imb * (1 - 1e-9)) and not binds(max_dp_imbalance=imb * (1 + 1e-9))
    s = f["stranded_share"]
    assert binds(min_dp_stranded_share=s * (1 - 1e-9)) and not binds(min_dp_stranded_share=s * (1 + 1e-9))
    # near_cap moves what counts as "at cap": at 0.5 engine 0 is busy from its 16th sample (0.6 s), not 1.4 s
    r = dp_balance(store, "dp-skewed", near_cap=0.5)
    assert r["stranded_share"] == pytest.approx(by_hand(store, "dp-skewed", 0.5)["stranded_share"], rel=1e-12)
    assert r["stranded_share"] > s + 0.3


def _dp(store, run):
    return next(c for c in constraints_at(store, run, {"runtime": "vllm", "dp": "2"}) if c.name == "dp-skew")


def test_an_engine_that_never_stepped_counts_as_idle(store):
    """All of the load on engine 0; engine 1's probe is in the run and recorded nothing, and the stat logger has
    no row of it: it held 0 KV and 0 requests all along, the worst skew there is (index N - 1 = 1)."""
    c = _dp(store, "dp-idle")
    want, f = by_hand(store, "dp-idle", idle=(1,)), c.figures
    assert c.binds and f["engines"] == f["expected_engines"] == 2 and f["idle_engines"] == [1]
    assert f["samples"] == want["samples"] == 50  # engine 0's rows; engine 1 has none
    assert f["kv_usage_mean_by_engine"] == pytest.approx(want["usage"], rel=1e-12) and want["usage"][1] == 0
    assert f["waiting_mean_by_engine"] == pytest.approx(want["waiting"], rel=1e-12)
    assert f["kv_imbalance"] == pytest.approx(want["kv_imbalance"], rel=1e-12) == pytest.approx(1.0)
    assert f["waiting_imbalance"] == pytest.approx(1.0) and f["hot_engine"] == 0
    assert f["stranded_share"] == pytest.approx(want["stranded_share"], rel=1e-12)
    assert f["span_s"] == pytest.approx(want["span_s"], rel=1e-12)
    # engine 0's samples alone, without engine 1 counted: one engine, no figure, what was read before
    assert dp_balance(store, "dp-unlabelled")["engines"] == 1 and dp_balance(store, "dp-unlabelled")["gaps"] == {}
    assert "engine 1 sent no sample: never stepped" in c.change


def test_an_engine_missing_for_another_reason_is_a_gap_not_skew(store):
    # its probe recorded steps the gauges lack: a gap in the gauges
    c = _dp(store, "dp-stepped")
    assert not c.binds and c.change == "" and c.figures["expected_engines"] == 2
    assert "recorded 5 rows (steps" in c.figures["engines_without_figures"][1]
    b = dp_balance(store, "dp-stepped")
    assert b["kv_imbalance"] is None and b["idle_engines"] == [] and b["by_engine"] == {}
    # no probe of its own: idle cannot be told from a failed probe
    c = _dp(store, "dp-one")
    assert not c.binds and c.figures["engines"] == 1
    assert "no probe of its own" in c.figures["engines_without_figures"][1]
    # gauges from a /metrics scrape hold every engine: one missing there is a lost series
    expected, idle, gaps = silent_engines(store, "dp-idle", {0}, from_logger=False)
    assert expected == 2 and idle == [] and "lost series" in gaps[1]


def test_one_engine_or_no_gauges_is_no_skew(store):
    one = dp_balance(store, "dp-unlabelled")
    assert one["engines"] == 1 and one["kv_imbalance"] is None and one["expected_engines"] is None
    c = next(c for c in constraints_at(store, "dp-unlabelled", {"runtime": "vllm"}) if c.name == "dp-skew")
    assert not c.binds and c.figures == {"engines": 1}
    assert dp_balance(store, "no-such-run")["engines"] == 0


def test_named_query_reads_the_same_figures(store):
    got = run_named(store, "dp_balance", {"run_id": "dp-skewed", "near_cap": "0.9"})
    want = by_hand(store, "dp-skewed")
    assert got["hot_engine"] == 0 and got["kv_imbalance"] == pytest.approx(want["kv_imbalance"], rel=1e-12)
    assert got["by_engine"][1]["usage_mean"] == pytest.approx(want["usage"][1], rel=1e-12)
    assert got["by_engine"][1]["busy_share"] == 0 and got["by_engine"][1]["headroom_share"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        run_named(store, "dp_balance", {"run_id": "dp-skewed", "near_cap": "2"})
