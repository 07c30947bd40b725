"""Issue 30: the reads that were rewritten give what today's SQL gave, on every recorded fixture.

The reference is today's SQL, verbatim (tests/reference_sql.py), over today's views; the new reads run
over the store's derived tables. Integers and strings are equal; floats are equal to 1e-12 relative
(weighted sums add in another order, and a quantile's interpolation is DuckDB's formula without the
fused multiply-add its own build uses). Where the fixtures hold no case (every token event of them
brings one token), stated records do: chunks of several tokens, checked against numpy over the samples.
"""

from __future__ import annotations

import functools
import math
import os

import duckdb
import numpy as np
import pytest

import reference_sql as ref
import same_values
from same_values import REL
from builders.scenarios import DATA_DIR
from phasescope.agent.records.kvmath import predicted_waste
from phasescope.agent.read import queries
from phasescope.agent.read.itl import ITL_CAUSES, attribution
from phasescope.analyzers import kvcache, sql as asql
from phasescope.analyzers.itl import LADDER, predict_p99_ladder

FIXTURES = sorted(n for n in os.listdir(DATA_DIR) if os.path.exists(os.path.join(DATA_DIR, n, "request_events.parquet")))
same = functools.partial(same_values.same, key_order=False)  # a dict's keys as a set: order not compared here


@pytest.fixture
def both(scenario_db):
    """both(name) -> (reference connection: today's views, current connection, run id)."""
    cons = []

    def open_(name):
        path, run = scenario_db(name)
        r, c = duckdb.connect(path, read_only=True), duckdb.connect(path, read_only=True)
        cons.extend((r, c))
        return ref.reference_views(r), c, run

    yield open_
    for c in cons:
        c.close()


def one(con, sql, params):
    cur = con.execute(sql, params)
    return dict(zip([d[0] for d in cur.description], cur.fetchone()))


def todays_itl_attribution(con, run, long=128, host_ratio=2.0, slo_s=0.1, quantile=0.99) -> dict:
    """agent/read/queries.py's itl_attribution before issue 30 (three passes over every expanded sample)."""
    p = {"run": run, "long": long, "host_ratio": host_ratio, "quantile": quantile}
    e = one(con, ref.ITL_SUMMARY_SQL, p)
    cur = con.execute(ref.ITL_TAIL_SQL, p)
    tail = {r[0]: dict(zip([d[0] for d in cur.description], r)) for r in cur.fetchall()}
    total = e["tail_excess_ms"] or 0.0
    for c in ITL_CAUSES:
        e[f"tail_{c}_samples"] = tail.get(c, {}).get("samples", 0)
        e[f"tail_{c}_share"] = (tail.get(c, {}).get("excess_ms") or 0.0) / total if total > 0 else 0.0
    e["tail_max_prefill_tokens"] = max((r["max_prefill_tokens"] or 0 for r in tail.values()), default=0)
    cur = con.execute(ref.ITL_TPOT_SQL, {**p, "slo_s": slo_s, "causes": list(ITL_CAUSES)})
    viol = {r[0]: dict(zip([d[0] for d in cur.description], r)) for r in cur.fetchall()}
    e["tpot_violations"] = max((r["violations"] for r in viol.values()), default=0)
    for c in ITL_CAUSES:
        e[f"tpot_violations_explained_{c}"] = viol.get(c, {}).get("explained", 0)
    return e


@pytest.mark.parametrize("name", FIXTURES)
def test_itl_attribution_equals_todays(both, name):
    r, c, run = both(name)
    for slo_s in (0.1, 0.012):
        want = todays_itl_attribution(r, run, slo_s=slo_s)
        got = attribution(c, run, tpot_slo_s=slo_s)
        same({k: got[k] for k in want}, want, name)


@pytest.mark.parametrize("name", FIXTURES)
def test_histograms_preemptions_lengths_and_request_queries_equal_todays(both, name):
    r, c, run = both(name)
    for metric in ("ttft", "tpot", "e2e", "queue", "itl"):
        want = r.execute(ref.latency_histogram_sql(metric), {"run_id": run, "bins": 30}).fetchall()
        got = queries.latency_histogram(c, run, metric, bins=30)
        same([tuple(g.values()) for g in got], want, metric)
    same(one(c, asql.PREEMPTIONS, {"run": run}), one(r, ref.PREEMPTIONS, {"run": run}))
    assert queries.prefix_summary(c, run)["preemptions"] == r.execute(ref.PREFIX_PREEMPTED, [run]).fetchone()[0]
    lengths = [t for (t,) in r.execute(ref.LENGTHS_SQL, {"run": run}).fetchall()]
    pages = [1, 3, 16, 128]
    got = {x["page_size"]: x for x in asql.rows(c, kvcache.LENGTHS_SQL, run, pages=pages)}
    for p in pages:
        if lengths:
            assert int(got[p]["live_tokens"]) == sum(lengths)
            assert int(got[p]["used_pages"]) == sum(-(-n // p) for n in lengths)
            assert kvcache.internal_fragmentation(int(got[p]["live_tokens"]), int(got[p]["used_pages"]), p) \
                == predicted_waste(lengths, p)
        else:
            assert p not in got
    want = {p: r.execute(ref.SMALLER_PAGE_SQL.replace("$p", str(p)), {"run": run}).fetchone()[0] for p in (1, 2, 4, 8)}
    assert queries.smaller_page_savings(c, run, [1, 2, 4, 8]) == want
    # unchanged SQL over the `requests` view: the same answers over today's view and the new one
    for q, params in (("request_summary", {"run_id": run}), ("slo_attainment", {"run_id": run}),
                      ("page_size_whatif", {"run_id": run}), ("run_compare", {"run_a": run, "run_b": run}),
                      ("kv_residency", {"run_id": run}), ("prefix_miss_causes", {"run_id": run})):
        same(queries.run_named(c, q, params), queries.run_named(r, q, params), q)


@pytest.mark.parametrize("name", ["prefill-interference", "itl-spikes-vllm", "kv-pressure", "healthy-vllm"])
def test_chunk_ladder_equals_todays_one_pass_per_budget(both, name):
    r, c, run = both(name)
    budgets = list(LADDER) + [51, 1, 4096]
    for slope, base in ((0.25, 10.0), (0.01, 30.0)):
        got = predict_p99_ladder(c, run, budgets, slope, base)
        for b in budgets:
            want = r.execute(ref.PREDICT_SQL, {"run": run, "long": 128, "host_ratio": 2.0, "quantile": 0.99,
                                               "budget": b, "slope": slope, "base_ms": base}).fetchone()[0]
            same(got[b], want, f"budget {b}")


# --- chunks of several tokens: weights, never rows ------------------------------------------------------------

def chunked_store(path: str) -> str:
    """Requests whose token events bring 1 to 9 tokens each, next to steps with and without long prefills."""
    from phasescope.agent.records.events import (PHASE_DECODE, PHASE_MIXED, REQ_ARRIVAL, REQ_FINISHED, REQ_TOKEN,
                                                 Hello, RequestEvent, Step)
    from phasescope.agent.sidecar.store import Store

    rng = np.random.default_rng(7)
    ms = 1_000_000
    steps, events, t = [], [], 10 * ms
    for i in range(400):
        pre = int(rng.choice([0, 0, 0, 300, 900]))
        host = 8.0 + pre * 0.05 + float(rng.random())
        steps.append(Step(t, i, 0, PHASE_MIXED if pre else PHASE_DECODE, 4, pre, 4, 100, host, float("nan")))
        t += int(host * ms) + ms
    for k in range(40):
        rid, ts = f"q{k}", 10 * ms + k * 90 * ms
        events.append(RequestEvent(ts, 0, REQ_ARRIVAL, rid, 64, 0))
        out = 0
        for _ in range(12):
            ts += int(rng.integers(5, 120)) * ms
            n = int(rng.integers(1, 10))
            out += n
            events.append(RequestEvent(ts, 0, REQ_TOKEN, rid, n, 0))
        events.append(RequestEvent(ts, 0, REQ_FINISHED, rid, out, 0))
    store = Store(path)
    sid = store.register_source(Hello(1, 0, 1, 0, 1, "chunks", "m", "synthetic"))
    store.append([(sid, steps + events)])
    store.close()
    return "chunks"


def qcont(xs, q):
    xs = np.sort(np.asarray(xs, dtype=float))
    h = (len(xs) - 1) * q
    lo = math.floor(h)
    return xs[lo] + (h - lo) * (xs[min(lo + 1, len(xs) - 1)] - xs[lo])


def test_multi_token_chunks_are_weights_exactly(tmp_path):
    path = str(tmp_path / "c.duckdb")
    run = chunked_store(path)
    r = ref.reference_views(duckdb.connect(path, read_only=True))
    c = duckdb.connect(path, read_only=True)
    gaps = c.execute("SELECT ts_ns - prev_ns, tokens FROM itl WHERE run_id = ?", [run]).fetchall()
    samples = np.repeat([g / 1e6 / n for g, n in gaps], [n for _, n in gaps])  # numpy over the samples
    assert samples.size == sum(n for _, n in gaps) > len(gaps)
    e = attribution(c, run)
    assert e["itl_samples"] == samples.size
    assert e["itl_p50_ms"] == pytest.approx(qcont(samples, 0.5), rel=REL)
    assert e["itl_p99_ms"] == pytest.approx(qcont(samples, 0.99), rel=REL)
    assert e["tail_samples"] == int((samples >= e["itl_p99_ms"]).sum())
    same({k: e[k] for k in todays_itl_attribution(r, run)}, todays_itl_attribution(r, run))
    hist = queries.latency_histogram(c, run, "itl", bins=20)
    assert sum(b["count"] for b in hist) == samples.size
    # today's histogram counted a chunk of k tokens once (its k rows shared one time: k - 1 gaps of 0 s)
    todays = r.execute(ref.latency_histogram_sql("itl"), {"run_id": run, "bins": 20}).fetchall()
    assert sum(n for _, _, n in todays) == len(gaps)
    got = predict_p99_ladder(c, run, [64, 200, 512, 2048], 0.04, 8.5)
    for b in (64, 200, 512, 2048):
        want = r.execute(ref.PREDICT_SQL, {"run": run, "long": 128, "host_ratio": 2.0, "quantile": 0.99, "budget": b,
                                           "slope": 0.04, "base_ms": 8.5}).fetchone()[0]
        assert got[b] == pytest.approx(want, rel=REL)
    r.close()
    c.close()
