"""The figures users read (phase, request, SLO, latency-histogram and KV summaries), from stated records.

Every expected value is computed here from docs/definitions.md over the records written, never read
back from a run: TTFT = first token - arrival, queue = scheduled - arrival, TPOT = decode time / (output
tokens - 1) when more than one, E2E = last token - arrival, ITL one sample per token; block usage, token
usage, internal and external fragmentation per snapshot; step time = gpu_ms where timed, else host_ms.
Quantiles are linear interpolation (DuckDB's quantile_cont = numpy's default). The records are chosen so
that each neighbouring formula gives another number: an SLO equal to one request's TTFT and one's TPOT
(< vs <=), a request with one output token (no TPOT), one aborted and one preempted, a second run that must
not leak in, GPU-timed steps whose host time differs. These are the fast tests `sql_mutants.py` runs.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import duckdb
import numpy as np
import pytest

from phasescope.agent.read import queries
from phasescope.agent.records import events as ev
from phasescope.agent.sidecar.store import Store

T0 = 1_000_000_000
MS = 1_000_000
NAN = float("nan")

class Req(NamedTuple):
    """A request's records, times in ms from T0."""
    rid: str
    prompt: int
    arrival: int
    scheduled: list[tuple[int, int]]  # (time, cached tokens) of each scheduled event
    tokens: list[tuple[int, int]]  # (time, new tokens) of each token event
    end: int  # REQ_FINISHED or REQ_ABORTED
    end_ms: int
    preempted: list[int] = []
    queued: int | None = None  # the engine's own queue entry (vLLM's QUEUED)


REQUESTS = [
    Req("a", 10, 0, [(10, 4)], [(50, 1), (70, 1), (100, 2)], ev.REQ_FINISHED, 100),  # a chunk of 2 at the end
    Req("b", 20, 20, [(40, 0)], [(120, 1), (130, 1)], ev.REQ_FINISHED, 130),
    Req("c", 5, 30, [(30, 0)], [(300, 1)], ev.REQ_FINISHED, 300),  # scheduled on arrival: a queue time of 0
    # queued by the engine 5 ms after arrival, preempted and scheduled again with 6 cached tokens
    Req("d", 8, 40, [(200, 0), (260, 6)], [(400, 1), (460, 1), (490, 1), (500, 1)], ev.REQ_FINISHED, 500, [250], 45),
    Req("e", 7, 50, [(62, 0)], [(200, 1)], ev.REQ_ABORTED, 250),
    Req("f", 9, 70, [], [], ev.REQ_ABORTED, 90),  # aborted in the queue: no token, no times
]
# (phase, host ms, gpu ms or NaN, prefill tokens, decode tokens)
STEPS = [
    (ev.PHASE_PREFILL, 4.0, NAN, 10, 0), (ev.PHASE_PREFILL, 10.0, 9.5, 20, 0), (ev.PHASE_PREFILL, 7.0, NAN, 5, 0),
    (ev.PHASE_DECODE, 1.0, NAN, 0, 2), (ev.PHASE_DECODE, 2.0, 1.5, 0, 3), (ev.PHASE_DECODE, 3.0, NAN, 0, 1),
    (ev.PHASE_DECODE, 4.0, NAN, 0, 4), (ev.PHASE_DECODE, 100.0, NAN, 0, 2),
    (ev.PHASE_MIXED, 5.0, 6.0, 8, 3),
]
PAGE = 16
# (s from T0, total, used, free, live tokens, largest free run, allocated total, freed total, kv bytes). Edge
# snapshots: an empty cache (used 0: no internal fragmentation), a cache not yet sized (total 0: left out of
# everything), one page used, one page in all, a full cache (free 0: no external fragmentation) and one free
# page; the span is exactly 1 s (a nullif(span, 1) would say no churn); the first allocation count is not 0
KV = [
    (0.0, 100, 0, 100, 0, 100, 3, 0, 0),
    (0.2, 0, 0, 0, 0, 0, 0, 0, 0),
    (0.4, 100, 1, 99, 10, 60, 4, 0, 16),
    (0.5, 1, 1, 0, 16, 0, 5, 0, 32),
    (0.7, 100, 40, 60, 500, 20, 45, 5, 4000),
    (0.85, 100, 100, 0, 1500, 0, 120, 20, 9000),
    (1.0, 120, 119, 1, 1800, 1, 150, 31, 7000),
]
KV_OK = [k for k in KV if k[1] > 0]  # the snapshots every KV figure is over
# rank 1: three snapshots over 12 s (allocations per second: a delta over 12, where rank 0's span of 1 s cannot
# tell / from *), in two of the KV rollup's 10 s cells of 2 and 1 snapshots (a mean of cell means, a sum of
# cell counts or a min of cell maxima would differ)
KV1 = [(0.0, 50, 10, 40, 100, 40, 7, 0, 500), (2.0, 50, 20, 30, 300, 10, 37, 2, 1200),
       (12.0, 64, 40, 24, 620, 12, 90, 40, 3000)]
# rank 2: one snapshot (every mean is over one, no span: no churn figure); rank 3: only a cache not yet sized,
# which no KV figure may list
KV2 = [(3.0, 10, 4, 6, 50, 6, 11, 0, 100)]
KV3 = [(3.0, 0, 0, 0, 0, 0, 0, 0, 0)]


def _store(path: str) -> None:
    store = Store(path)
    try:
        src = store.register_source(ev.Hello(T0, 0, 4242, 0, 1, "v", "m", "hf-cb"))
        other = store.register_source(ev.Hello(T0, 0, 4243, 0, 1, "w", "m", "hf-cb"))
        rank1, rank2, rank3 = (store.register_source(ev.Hello(T0, 0, 4242, r, 4, "v", "m", "hf-cb")) for r in (1, 2, 3))
        reqs: list = []
        for q in REQUESTS:
            reqs.append(ev.RequestEvent(T0 + q.arrival * MS, 0, ev.REQ_ARRIVAL, q.rid, q.prompt, 0))
            if q.queued is not None:
                reqs.append(ev.RequestEvent(T0 + q.queued * MS, 0, ev.REQ_QUEUED, q.rid, 0, 0))
            reqs.extend(ev.RequestEvent(T0 + t * MS, 0, ev.REQ_SCHEDULED, q.rid, 0, c) for t, c in q.scheduled)
            reqs.extend(ev.RequestEvent(T0 + t * MS, 0, ev.REQ_PREEMPTED, q.rid, 0, 0) for t in q.preempted)
            reqs.extend(ev.RequestEvent(T0 + t * MS, 0, ev.REQ_TOKEN, q.rid, n, 0) for t, n in q.tokens)
            reqs.append(ev.RequestEvent(T0 + q.end_ms * MS, 0, q.end, q.rid, sum(n for _, n in q.tokens), 0))
        reqs.sort(key=lambda r: r.ts_ns)
        steps = [ev.Step(T0 + i * MS, i, 0, ph, 1, pf, dc, 0, host, gpu) for i, (ph, host, gpu, pf, dc) in enumerate(STEPS)]
        kv = [ev.KVSnapshot(T0 + round(t * 1e9), 0, PAGE, tot, used, free, 0, 0, 0, 1, live, run, alloc, freed, b, "bf16")
              for t, tot, used, free, live, run, alloc, freed, b in KV]
        def snaps(rank: int, rows: list) -> list:
            return [ev.KVSnapshot(T0 + round(t * 1e9), rank, PAGE, tot, used, free, 0, 0, 0, 1, live, run, alloc, freed,
                                  b, "bf16") for t, tot, used, free, live, run, alloc, freed, b in rows]
        # the other run: a fast request and a slow step that must not move run v's figures
        noise = [ev.RequestEvent(T0, 0, ev.REQ_ARRIVAL, "x", 99, 0), ev.RequestEvent(T0, 0, ev.REQ_SCHEDULED, "x", 0, 0),
                 ev.RequestEvent(T0 + MS, 0, ev.REQ_TOKEN, "x", 1, 0), ev.RequestEvent(T0 + MS, 0, ev.REQ_FINISHED, "x", 1, 0)]
        store.append([(src, reqs), (src, steps), (src, kv), (rank1, snaps(1, KV1)), (rank2, snaps(2, KV2)),
                      (rank3, snaps(3, KV3)), (other, noise),
                      (other, [ev.Step(T0, 0, 0, ev.PHASE_DECODE, 1, 0, 1, 0, 500.0, NAN)])])
    finally:
        store.close()


@pytest.fixture(scope="module")
def con(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("values") / "v.duckdb")
    _store(path)
    c = duckdb.connect(path, read_only=True)
    yield c
    c.close()


def _q(values: list[float], qs: tuple[float, ...]) -> list[float]:
    return [float(np.quantile(np.array(values, dtype=float), q)) for q in qs]


def _span(reqs: list[Req]) -> float:
    """Last token - first arrival over `reqs`, s."""
    return (max(q.tokens[-1][0] for q in reqs if q.tokens) - min(q.arrival for q in reqs)) / 1e3


def _per_request() -> dict[str, dict]:
    """docs/definitions.md over each request's records (None where a figure has no times)."""
    out = {}
    for q in REQUESTS:
        n = sum(k for _, k in q.tokens)
        first, last = (q.tokens[0][0], q.tokens[-1][0]) if q.tokens else (None, None)
        sch = q.scheduled[0][0] if q.scheduled else None
        start = q.arrival if q.queued is None else q.queued  # vLLM's queue starts at its QUEUED event
        out[q.rid] = {
            "ttft": None if first is None else (first - q.arrival) / 1e3,
            "queue": None if sch is None else (sch - start) / 1e3,
            "frontend": None if q.queued is None else (q.queued - q.arrival) / 1e3,
            "prefill": None if first is None or sch is None else (first - sch) / 1e3,
            "decode": None if first is None else (last - first) / 1e3,
            "e2e": None if last is None else (last - q.arrival) / 1e3,
            "tpot": (last - first) / 1e3 / (n - 1) if n > 1 else None, "out": n, "prompt": q.prompt,
            "readmit_cached": sum(c for _, c in q.scheduled[1:]), "preemptions": len(q.preempted),
            "status": "finished" if q.end == ev.REQ_FINISHED else "aborted"}
    return out


def _itl_samples() -> list[float]:
    """One sample per token after a request's first: a gap of k tokens is k samples of gap / k, s."""
    out = []
    for q in REQUESTS:
        for (a, _), (b, k) in zip(q.tokens, q.tokens[1:]):
            out += [(b - a) / 1e3 / k] * k
    return out


def _quantiles_of(r: dict[str, dict], key: str, qs: tuple[float, ...]) -> list[float]:
    return _q([x[key] for x in r.values() if x[key] is not None], qs)


def test_request_summary_is_the_definitions_over_the_run(con):
    r = _per_request()
    s = queries.request_summary(con, "v")
    ttft, tpot, e2e = (_quantiles_of(r, k, (0.5, 0.95, 0.99)) for k in ("ttft", "tpot", "e2e"))
    queue = _quantiles_of(r, "queue", (0.5, 0.95))
    span = _span(REQUESTS)
    expected = {"requests": 6, "finished": 4, "aborted": 2, "preemptions": 1,
                "output_tokens": sum(x["out"] for x in r.values()), "prompt_tokens": sum(q.prompt for q in REQUESTS),
                "span_s": span,
                "ttft_p50_s": ttft[0], "ttft_p95_s": ttft[1], "ttft_p99_s": ttft[2],
                "tpot_p50_s": tpot[0], "tpot_p95_s": tpot[1], "tpot_p99_s": tpot[2],
                "queue_p50_s": queue[0], "queue_p95_s": queue[1],
                "e2e_p50_s": e2e[0], "e2e_p95_s": e2e[1], "e2e_p99_s": e2e[2]}
    expected["output_tokens_per_s"] = expected["output_tokens"] / span
    assert set(s) == set(expected)
    for k, v in expected.items():
        assert s[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    # the whole file: run w's request counts too
    assert queries.request_summary(con)["requests"] == 7
    assert queries.request_summary(con, "no-such")["requests"] == 0


COLUMNS = ("ttft", "queue", "frontend", "prefill", "decode", "e2e", "tpot")


def test_each_request_row_is_its_definition(con):
    rows = con.execute(f"""SELECT request_id, {", ".join(c + "_s" for c in COLUMNS)}, output_tokens, prompt_tokens,
                                  status, preemptions, readmit_cached_tokens
                           FROM requests WHERE run_id = 'v' ORDER BY request_id""").fetchall()
    r = _per_request()
    assert [row[0] for row in rows] == sorted(r)
    for row in rows:
        x = r[row[0]]
        for col, got in zip(COLUMNS, row[1:]):
            assert (got is None) == (x[col] is None), (row[0], col, got)
            if got is not None:
                assert got == pytest.approx(x[col], rel=1e-12, abs=1e-15), (row[0], col)
        assert row[1 + len(COLUMNS):] == (x["out"], x["prompt"], x["status"], x["preemptions"], x["readmit_cached"]), row


def test_the_request_cases_hold_what_tells_formulas_apart():
    r = _per_request()
    assert r["a"]["out"] == 4 and r["a"]["tpot"] != (100 - 50) / 1e3 / 2  # a chunk: tokens, not token events
    assert r["d"]["frontend"] == 0.005 and r["d"]["readmit_cached"] == 6 and r["f"]["out"] == 0
    assert len({x["prefill"] for x in r.values()} - {None}) >= 4 and len({x["decode"] for x in r.values()}) >= 4


# b sits exactly at both SLOs of the first case (TTFT 0.1 s, TPOT 0.01 s); (0.3, 0.01): c (one output token, no
# TPOT) meets the TTFT SLO and counts as meeting the TPOT one
@pytest.mark.parametrize("ttft_slo, tpot_slo", [(0.1, 0.01), (0.099, 0.01), (0.1, 0.0099), (0.3, 0.01), (1.0, 1.0)])
def test_slo_attainment_counts_a_request_at_the_slo_as_meeting_it(con, ttft_slo, tpot_slo):
    r = {k: v for k, v in _per_request().items() if v["status"] == "finished"}
    ttft_ok = [k for k, v in r.items() if v["ttft"] <= ttft_slo]
    tpot_ok = [k for k, v in r.items() if (v["tpot"] or 0) <= tpot_slo]
    both = [k for k in ttft_ok if k in tpot_ok]
    span = _span([q for q in REQUESTS if q.end == ev.REQ_FINISHED])
    s = queries.slo_attainment(con, "v", ttft_slo_s=ttft_slo, tpot_slo_s=tpot_slo)
    assert (s["finished"], s["ttft_ok"], s["tpot_ok"], s["both_ok"]) == (4, len(ttft_ok), len(tpot_ok), len(both))
    assert s["attainment"] == pytest.approx(len(both) / 4, rel=1e-12)
    assert s["goodput_req_per_s"] == pytest.approx(len(both) / span, rel=1e-12)
    assert s["goodput_tokens_per_s"] == pytest.approx(sum(r[k]["out"] for k in both) / span, rel=1e-12)


def test_the_slo_cases_tell_both_sides_of_each_bound():
    """The cases above hold a request exactly at each SLO (b: TTFT 0.1 s, TPOT 0.01 s)."""
    r = _per_request()
    assert r["b"]["ttft"] == 0.1 and r["b"]["tpot"] == 0.01


@pytest.mark.parametrize("metric", ["ttft", "tpot", "e2e", "queue", "itl"])
def test_latency_histogram_puts_every_sample_in_its_bin(con, metric):
    r = _per_request()
    if metric == "itl":
        xs = _itl_samples()
    else:
        xs = [v[metric] for v in r.values() if v[metric] is not None]
    xs = [x for x in xs if x > 0]
    rows = queries.latency_histogram(con, "v", metric=metric, bins=4)
    assert sum(b["count"] for b in rows) == len(xs)
    assert rows[0]["lo_s"] == pytest.approx(min(xs), rel=1e-9)
    assert rows[-1]["hi_s"] == pytest.approx(max(xs), rel=1e-9)
    edges = np.exp(np.linspace(math.log(min(xs)), math.log(max(xs)), 5))
    edges[0], edges[-1] = min(xs), max(xs)  # exp(log(x)) can round past x: the end edges are the samples
    want = np.histogram(xs, bins=edges)[0]  # numpy: the last bin holds its right edge, as the query's least()
    got = {round(math.log(b["lo_s"] / min(xs)) / math.log(max(xs) / min(xs)) * 4): b["count"] for b in rows}
    assert got == {i: int(n) for i, n in enumerate(want) if n}
    for b in rows:
        assert b["hi_s"] > b["lo_s"]


def test_phase_summary_times_a_step_by_its_gpu_time_where_it_has_one(con):
    rows = {r["phase"]: r for r in queries.phase_summary(con, "v")}
    assert sorted(rows) == sorted(ev.PHASES[p] for p in {s[0] for s in STEPS})
    for p in {s[0] for s in STEPS}:
        mine = [s for s in STEPS if s[0] == p]
        ms = [gpu if not math.isnan(gpu) else host for _, host, gpu, _, _ in mine]
        row = rows[ev.PHASES[p]]
        assert row["steps"] == len(mine)
        assert [row["p50_ms"], row["p95_ms"], row["p99_ms"]] == pytest.approx(_q(ms, (0.5, 0.95, 0.99)), rel=1e-12)
        assert (row["prefill_tokens"], row["decode_tokens"]) == (sum(s[3] for s in mine), sum(s[4] for s in mine))
        assert row["gpu_timed"] == sum(not math.isnan(s[2]) for s in mine)


@pytest.mark.parametrize("run", ["v", None])  # with a run: the KV rollup answers; without: the raw snapshots
def test_kv_summary_is_the_definitions_per_snapshot(con, run):
    rows = queries.kv_summary(con, run)
    assert [r["rank"] for r in rows] == [0, 1, 2]  # not rank 3: it never had a sized cache
    for row, snaps in zip(rows, (KV_OK, KV1, KV2)):
        block = [u / t for _, t, u, *_ in snaps]
        token = [live / (t * PAGE) for _, t, _, _, live, *_ in snaps]
        internal = [1 - live / (u * PAGE) for _, _, u, _, live, *_ in snaps if u > 0]
        external = [1 - r / f for _, _, _, f, _, r, *_ in snaps if f > 0]
        assert (row["snapshots"], row["page_size"], row["total_pages"], row["kv_bytes_max"], row["kv_dtype"]) == (
            len(snaps), PAGE, max(k[1] for k in snaps), max(k[8] for k in snaps), "bf16")
        assert row["block_usage_mean"] == pytest.approx(np.mean(block), rel=1e-12)
        assert row["block_usage_max"] == pytest.approx(max(block), rel=1e-12)
        assert row["token_usage_mean"] == pytest.approx(np.mean(token), rel=1e-12)
        assert row["internal_fragmentation_mean"] == pytest.approx(np.mean(internal), rel=1e-12)
        assert row["external_fragmentation_mean"] == pytest.approx(np.mean(external), rel=1e-12)
        span_s = snaps[-1][0] - snaps[0][0]
        if span_s == 0:
            assert row["pages_allocated_per_s"] is None  # one snapshot: no rate
        else:
            assert row["pages_allocated_per_s"] == pytest.approx((snaps[-1][6] - snaps[0][6]) / span_s, rel=1e-12)
    assert KV_OK[-1][0] - KV_OK[0][0] == 1.0  # rank 0's span: exactly 1 s


def test_the_kv_cases_are_not_degenerate():
    """Each mean above differs from the max, the first and the last snapshot's value (avg vs max/min/any)."""
    for vals in ([u / t for _, t, u, *_ in KV_OK], [1 - r / f for _, _, _, f, _, r, *_ in KV_OK if f > 0],
                 [1 - live / (u * PAGE) for _, _, u, _, live, *_ in KV_OK if u > 0],
                 [live / (t * PAGE) for _, t, _, _, live, *_ in KV_OK]):
        mean = float(np.mean(vals))
        assert all(abs(mean - v) > 1e-6 for v in (max(vals), min(vals), vals[0], vals[-1])), vals
