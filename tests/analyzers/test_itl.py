"""ITL tail attribution (analyzers/itl.py): each gap's cause on stated records, the recorded
prefill-interference run's figures recomputed in plain Python, and the chunk-size prediction."""

from __future__ import annotations

import bisect
import math
import time

import duckdb
import pytest

from phasescope.agent.records.events import PHASE_DECODE, PHASE_MIXED, PHASE_PREFILL, REQ_ARRIVAL, REQ_FINISHED, REQ_PREEMPTED, \
    REQ_TOKEN, Hello, RequestEvent, Step
from phasescope.agent.read.itl import ITL_GAPS
from phasescope.agent.read.queries import STEP_MS, itl_attribution
from phasescope.analyzers.diagnose import diagnose
from phasescope.analyzers.itl import predict_p99, prefill_fit
from phasescope.cli.demo import DemoConfig, make_workload
from builders.scenarios import SCENARIOS

MS = 1_000_000
T0 = 1_000_000_000
NAN = float("nan")


def qcont(xs: list[float], q: float) -> float:
    """DuckDB's quantile_cont: linear interpolation between order statistics at (n - 1) * q."""
    xs = sorted(xs)
    h = (len(xs) - 1) * q
    lo = math.floor(h)
    return xs[lo] + (h - lo) * (xs[min(lo + 1, len(xs) - 1)] - xs[lo])


# --- stated records: one gap of each cause -------------------------------------------------------

# (host ms of the step, prefill tokens, decode tokens, ms from the step's end to request a's token or None)
STATED = [
    (10.0, 0, 1, 1.0),      # first token
    (10.0, 0, 1, 1.0),      # gap 12 ms: other
    (60.0, 200, 1, 1.0),    # gap 62 ms, next to a 200-token prefill: prefill
    (10.0, 0, 1, 30.0),     # gap 41 ms over a 10 ms step: host stall
    (10.0, 100, 0, None),   # a prefill step request a sits out ...
    (10.0, 0, 1, 1.0),      # ... so this gap of 2 steps is queueing (23 ms)
    (10.0, 0, 1, "pre"),    # preempted inside the next gap; its token comes after the recompute:
    (40.0, 120, 0, 1.0),    # gap spans 2 steps and a preemption: preemption
    (10.0, 0, 1, 1.0),      # gap 12 ms: other
]
CAUSES = ["other", "prefill", "host", "queueing", "preemption", "other"]


def stated_db(path: str) -> str:
    from phasescope.agent.sidecar.store import Store

    steps, events = [], [RequestEvent(T0 - MS, 0, REQ_ARRIVAL, "a", 8, 0)]
    t = T0
    for i, (host, pre, dec, after) in enumerate(STATED):
        phase = PHASE_MIXED if pre and dec else (PHASE_DECODE if dec else PHASE_PREFILL)
        steps.append(Step(t, i, 0, phase, 1, pre, dec, 100, host, NAN))
        t += int(host * MS)
        if after == "pre":
            events.append(RequestEvent(t + MS, 0, REQ_PREEMPTED, "a", 0, 0))
            t += 2 * MS
        elif after is not None:
            t += int(after * MS)
            events.append(RequestEvent(t, 0, REQ_TOKEN, "a", 1, 0))
        t += MS
    events.append(RequestEvent(t, 0, REQ_FINISHED, "a", 7, 0))
    store = Store(path)
    try:
        sid = store.register_source(Hello(T0, time.time_ns() - T0, 1, 0, 1, "stated", "m", "synthetic"))
        store.append([(sid, steps + events)])
    finally:
        store.close()
    return "stated"


@pytest.fixture
def stated(tmp_path):
    path = str(tmp_path / "stated.duckdb")
    run = stated_db(path)
    con = duckdb.connect(path, read_only=True)
    yield con, run
    con.close()


def test_each_gap_gets_its_cause(stated):
    con, run = stated
    rows = con.execute(f"WITH {ITL_GAPS} SELECT cause, gap_ms, steps_in_gap FROM gaps ORDER BY ts_ns",
                       {"run": run, "long": 128, "host_ratio": 2.0}).fetchall()
    assert [r[0] for r in rows] == CAUSES
    assert [r[1] for r in rows] == pytest.approx([12.0, 62.0, 41.0, 23.0, 55.0, 12.0])
    assert [r[2] for r in rows] == [1, 1, 1, 2, 2, 1]
    # a 200-token prefill is no longer "long" at 256 tokens: that gap is its step's time, nothing else
    rows = con.execute(f"WITH {ITL_GAPS} SELECT cause FROM gaps ORDER BY ts_ns",
                       {"run": run, "long": 256, "host_ratio": 2.0}).fetchall()
    assert [r[0] for r in rows] == ["other", "other", "host", "queueing", "preemption", "other"]


def test_tail_shares_and_tpot_violations(stated):
    con, run = stated
    # the upper half of the six samples is the tail: 62 (prefill), 55 (preemption), 41 (host) ms
    e = itl_attribution(con, run, quantile=0.5, tpot_slo_s=0.025)
    gaps = [12.0, 62.0, 41.0, 23.0, 55.0, 12.0]
    p50 = qcont(gaps, 0.5)
    assert e["itl_p50_ms"] == pytest.approx(p50) and e["itl_p99_ms"] == pytest.approx(p50)
    excess = {"prefill": 62 - p50, "preemption": 55 - p50, "host": 41 - p50}
    total = sum(excess.values())
    assert e["tail_samples"] == 3
    for cause, x in excess.items():
        assert e[f"tail_{cause}_samples"] == 1
        assert e[f"tail_{cause}_share"] == pytest.approx(x / total)
    assert e["tail_queueing_samples"] == e["tail_other_samples"] == 0
    # TPOT = 205 ms / 6 = 34.2 ms > 25 ms; without the prefill's excess over the 32 ms median (30 ms): 29.2 ms,
    # still over; without the preemption's (23 ms): 30.3 ms; none alone explains the violation
    assert e["tpot_violations"] == 1
    assert all(e[f"tpot_violations_explained_{c}"] == 0 for c in ("prefill", "preemption", "host"))
    e = itl_attribution(con, run, quantile=0.5, tpot_slo_s=0.0295)
    assert e["tpot_violations"] == 1 and e["tpot_violations_explained_prefill"] == 1
    assert e["tpot_violations_explained_preemption"] == 0


def test_chunk_prediction_by_hand(stated):
    con, run = stated
    fit = prefill_fit(con, run, fit_min_prefill_tokens=32)
    # decode-carrying steps: pure decode 10 ms (median), one 200-token mixed step of 60 ms
    assert fit["pure_decode_p50_ms"] == 10.0 and fit["fit_steps"] == 1
    assert fit["ms_per_prefill_token"] == pytest.approx(50 / 200)
    # a budget of 51 tokens: prefill chunks of 50 -> the 62 ms gap becomes 4 gaps of 2 + 10 + 0.25 * 50 ms
    got = predict_p99(con, run, 51, fit["ms_per_prefill_token"], fit["pure_decode_p50_ms"], quantile=0.99)
    assert got == pytest.approx(qcont([12.0, 41.0, 23.0, 55.0, 12.0] + [24.5] * 4, 0.99))
    # with a slope off the step (0.1 ms/token) the step's residual (30 ms) is spread over the chunks alike
    got = predict_p99(con, run, 51, 0.1, 10.0, quantile=0.5)
    assert got == pytest.approx(qcont([12.0, 41.0, 23.0, 55.0, 12.0] + [24.5] * 4, 0.5))
    # a budget above the prefill changes nothing
    assert predict_p99(con, run, 512, 0.25, 10.0) == pytest.approx(qcont([12.0, 62.0, 41.0, 23.0, 55.0, 12.0], 0.99))


# --- the recorded prefill-interference run (HF continuous batching on CPU, prompts prefilled whole) -------

def py_gaps(con, run: str, long: int = 128, host_ratio: float = 2.0) -> list[tuple]:
    """(request, itl_ms per token, tokens, cause, prefill tokens, step ms, gap ms, decode tokens, steps in the gap)
    per gap, in plain Python."""
    steps = con.execute(f"""SELECT t.ts_ns, t.step_id, t.host_ms, {STEP_MS}, t.prefill_tokens, t.decode_tokens
                            FROM steps t JOIN sources s USING (source_id) WHERE s.run_id = ? AND t.rank = 0
                            ORDER BY t.ts_ns, t.step_id""", [run]).fetchall()
    ends = [ts + round(host * 1e6) for ts, _, host, *_ in steps]
    assert ends == sorted(ends)  # one step after another
    toks = con.execute("""SELECT request_id, ts_ns, tokens, event FROM request_log
                          WHERE run_id = ? AND event IN ('token', 'preempted') ORDER BY request_id, ts_ns""",
                       [run]).fetchall()
    out, prev = [], {}
    for rid, ts, n, event in toks:
        if event == "preempted" or not n:
            continue
        i = bisect.bisect_right(ends, ts) - 1
        if rid in prev:
            pts, pi = prev[rid]
            pre = any(r == rid and e == "preempted" and pts < t <= ts for r, t, _, e in toks)
            gap = (ts - pts) / 1e6
            _, _, _, ms, p, d = steps[i]
            cause = ("preemption" if pre else "queueing" if i - pi > n else "prefill" if p >= long
                     else "host" if gap >= host_ratio * ms else "other")
            out.append((rid, gap / n, n, cause, p, ms, gap, d, i - pi))
        prev[rid] = (ts, i)
    return out


def test_prefill_interference_tail_recomputed(scenario):
    con, run = scenario("prefill-interference")
    gaps = py_gaps(con, run)
    samples = [g for g in gaps for _ in range(g[2])]
    itl = [g[1] for g in samples]
    p50, p99 = qcont(itl, 0.5), qcont(itl, 0.99)
    tail = [g for g in samples if g[1] >= p99]
    e = itl_attribution(con, run)
    # one ITL sample per output token after the first, from the stated workload (every request finished)
    cfg = DemoConfig(device="cpu", **{k: tuple(v) if isinstance(v, list) else v
                                      for k, v in SCENARIOS["prefill-interference"].demo.items()})
    assert e["itl_samples"] == len(itl) == sum(r.output_tokens - 1 for r in make_workload(cfg))
    assert e["itl_p50_ms"] == pytest.approx(p50, rel=1e-12) and e["itl_p99_ms"] == pytest.approx(p99, rel=1e-12)
    # the tokens over the p99 are decodes that shared a step with a whole long prompt (budget 4096: never
    # chunked), so every one of those steps prefilled at least the shortest long prompt the workload states
    assert e["tail_samples"] == len(tail) > 0
    assert {g[3] for g in tail} == {"prefill"}
    assert min(g[4] for g in tail) >= cfg.long_prompt[0] and cfg.max_batch_tokens > cfg.long_prompt[1]
    assert e["tail_prefill_samples"] == len(tail) and e["tail_prefill_share"] == pytest.approx(1.0)
    assert e["tail_max_prefill_tokens"] == max(g[4] for g in tail) == 1473
    assert e["tpot_violations"] == 0  # TPOT stays under 100 ms: the spikes are single tokens


def test_itl_spikes_prefill_fires_with_its_numbers(scenario):
    con, run = scenario("prefill-interference")
    found = {f.id: f for f in diagnose(con, run)}
    f = found["itl-spikes-prefill"]
    ev = f.evidence
    steps = con.execute(f"""SELECT {STEP_MS}, prefill_tokens, decode_tokens FROM steps JOIN sources USING (source_id)
                            WHERE run_id = ?""", [run]).fetchall()
    base = qcont([ms for ms, p, d in steps if p == 0 and d > 0], 0.5)
    ratios = [(ms - base) / p for ms, p, d in steps if d > 0 and p >= 32]
    assert ev["pure_decode_p50_ms"] == pytest.approx(base) and ev["fit_steps"] == len(ratios) > 0
    assert ev["ms_per_prefill_token"] == pytest.approx(qcont(ratios, 0.5))
    # the chunk is the one prefill-stalls-decode names; the prediction rewrites each gap past it by hand
    c0 = ev["suggested_chunk_tokens"]
    assert c0 == found["prefill-stalls-decode"].evidence["suggested_chunk_tokens"]
    m = ev["ms_per_prefill_token"]
    gaps = py_gaps(con, run)
    # a gap's one-off host time goes to its first chunk; the other chunks get a pure decode gap's
    ovh = qcont([gap - ms for _, _, _, cause, p, ms, gap, _, k in gaps if k == 1 and p == 0 and cause == "other"], 0.5)
    pred = []
    for rid, itl, n, cause, p, ms, gap, d, _ in gaps:
        c = max(c0 - d, 1)
        if p > c and cause not in ("preemption", "queueing"):
            for j in range(math.ceil(p / c)):
                q = min(c, p - j * c)
                pred += [((gap - ms if j == 0 else ovh) + base + (m + (ms - base - m * p) / p) * q) / n] * n
        else:
            pred += [itl] * n
    assert ev["predicted_itl_p99_ms"] == pytest.approx(qcont(pred, 0.99), rel=1e-9)
    assert ev["predicted_saving_ms"] == pytest.approx(ev["itl_p99_ms"] - qcont(pred, 0.99), rel=1e-9)
    assert ev["itl_p99_ms"] / ev["itl_p50_ms"] >= 3.0 and ev["predicted_saving_ms"] > 100
    # the advice: HF CB chunks to its budget (4096 here), so lower it, to the same chunk
    assert f"lower it to ~{c0} tokens" in f.suggestion and "(now 4096)" in f.suggestion
    assert f.severity == "warning" and f.reference == "docs/tuning.md#prefill"


def test_kv_pressure_tail_is_preemption(scenario):
    con, run = scenario("kv-pressure")
    f = {x.id: x for x in diagnose(con, run)}["itl-spikes-preemption"]
    gaps = py_gaps(con, run)
    itl = [g[1] for g in gaps for _ in range(g[2])]
    p50, p99 = qcont(itl, 0.5), qcont(itl, 0.99)
    tail = [g for g in gaps for _ in range(g[2]) if g[1] >= p99]
    share = sum(g[1] - p50 for g in tail if g[3] == "preemption") / sum(g[1] - p50 for g in tail)
    assert f.evidence["tail_preemption_share"] == pytest.approx(share) and share >= 0.5
    assert f.evidence["tail_preemption_samples"] == sum(g[3] == "preemption" for g in tail)


def test_healthy_and_short_runs_stay_silent(scenario):
    con, run = scenario("healthy")
    assert not [f for f in diagnose(con, run) if f.id.startswith("itl-")]
    # fewer than min_itl_samples tokens: a p99 that rests on a handful of samples is not reported
    con, run = scenario("prefix-miss")
    assert itl_attribution(con, run)["itl_samples"] < 500
    assert not [f for f in diagnose(con, run) if f.id.startswith("itl-")]


def test_tpot_violations_explained_recomputed(scenario):
    # at a 12 ms TPOT SLO some requests of the recorded run miss it; each cause explains those whose TPOT, with
    # that cause's gaps brought down to the median ITL, meets it
    con, run = scenario("prefill-interference")
    slo_ms = 12.0
    gaps = py_gaps(con, run)
    itl = [g[1] for g in gaps for _ in range(g[2])]
    p50 = qcont(itl, 0.5)
    req = {r: (t * 1e3, n) for r, t, n in con.execute(
        "SELECT request_id, tpot_s, output_tokens FROM requests WHERE run_id = ? AND tpot_s IS NOT NULL", [run]
    ).fetchall()}
    over = {r for r, (t, _) in req.items() if t > slo_ms}
    e = itl_attribution(con, run, tpot_slo_s=slo_ms / 1e3)
    assert e["tpot_violations"] == len(over) > 0
    for cause in ("prefill", "other", "host"):
        explained = sum(
            req[r][0] - sum(max(g[6] - p50 * g[2], 0) for g in gaps if g[0] == r and g[3] == cause)
            / (req[r][1] - 1) <= slo_ms for r in over)
        assert e[f"tpot_violations_explained_{cause}"] == explained, cause
    # a cause explains a violation alone, so the counts may overlap, but none explains more than there are
    assert all(e[f"tpot_violations_explained_{c}"] <= e["tpot_violations"] for c in ("prefill", "other", "host"))
