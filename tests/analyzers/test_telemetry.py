"""Silent degradation (issue 13, item 4): each reason from stated records with hand-checked numbers,
the live gauge with a fake clock, and the real fixture `telemetry-silent`."""

from __future__ import annotations

import time

import duckdb
import pytest
from prometheus_client import CollectorRegistry

from phasescope.agent.records.events import (PHASE_DECODE, PHASE_PREFILL, REQUEST_EVENTS, Hello, KVSnapshot,
                                             PrefixCounters, ProbeHealth, RequestEvent, RunLabel, Step)
from phasescope.agent.sidecar import Chunk, columnar
from phasescope.agent.sidecar.store import Store
from phasescope.analyzers.diagnose import diagnose
from phasescope.analyzers.telemetry import telemetry_degraded
from phasescope.exporters.telemetry_watch import REASONS, TelemetryWatch

S = 1_000_000_000
NAN = float("nan")


def kv(t: int) -> KVSnapshot:
    return KVSnapshot(t, 0, 16, 100, 10, 90, 0, 0, 0, 1, 150, 90, 10, 0, 1000, "float32")


def step(i: int, t: int, prefill: int = 0, gpu: float = NAN) -> Step:
    return Step(t, i, 0, PHASE_PREFILL if prefill else PHASE_DECODE, 1, prefill, 0 if prefill else 1, 50, 1.0, gpu)


def build(path: str, records: list, behind_s: float = 0.0) -> str:
    store = Store(path)
    try:
        offset = time.time_ns() - int(behind_s * S)  # the probe's wall clock at connect, vs the store's
        sid = store.register_source(Hello(0, offset, 4242, 0, 1, "run-t", "m", "hf-cb"))
        store.append([(sid, records)])
    finally:
        store.close()
    return "run-t"


def findings(path: str, **kw) -> dict:
    con = duckdb.connect(path, read_only=True)
    try:
        return {f.id: f for f in telemetry_degraded(con, "run-t", **kw)}
    finally:
        con.close()


def test_kv_snapshots_stopping_while_steps_go_on(tmp_path):
    # steps every 0.1 s for 30 s; KV snapshots only for the first 5 s; prefix counters move throughout
    recs = []
    for i in range(300):
        t = i * S // 10
        recs.append(step(i, t, prefill=8 if i % 10 == 0 else 0))
        if t < 5 * S:
            recs.append(kv(t))
        recs.append(PrefixCounters(t, 0, 8 * (i // 10 + 1), 0, 0, 0))
    path = str(tmp_path / "a.duckdb")
    build(path, recs)
    f = findings(path)
    assert set(f) == {"telemetry-kv-snapshots-stopped"}
    e = f["telemetry-kv-snapshots-stopped"].evidence
    assert e["snapshots"] == 50 and e["steps_after"] == 250  # 5.0 s .. 29.9 s
    assert e["silent_s"] == pytest.approx(29.9 - 4.9)
    assert findings(path, telemetry_stale_s=26.0) == {}  # silent for 25 s only


def ev(t: int, name: str, rid: str, tokens: int = 0) -> RequestEvent:
    return RequestEvent(t, 0, REQUEST_EVENTS.index(name), rid, tokens, 0)


def test_prefix_counters_stuck_and_gpu_timing_stopped(tmp_path):
    recs = []
    for i in range(300):
        t = i * S // 10
        recs.append(step(i, t, prefill=8 if i % 10 == 0 else 0, gpu=0.5 if t < 10 * S else NAN))
        if i % 10 == 0:  # one new 8-token request admitted per second, prefilled in that step
            recs += [ev(t, "arrival", f"r{i}", 8), ev(t, "scheduled", f"r{i}")]
        recs.append(kv(t))
        recs.append(PrefixCounters(t, 0, 8 * (min(i, 99) // 10 + 1), 0, 0, 0))  # stops moving at 9.0 s
    path = str(tmp_path / "b.duckdb")
    build(path, recs)
    f = findings(path)
    assert set(f) == {"telemetry-prefix-counters-stuck", "telemetry-gpu-timing-stopped"}
    p = f["telemetry-prefix-counters-stuck"].evidence
    assert p["last_move_s"] - p["last_admission_s"] == pytest.approx(9.0 - 29.0)
    assert p["stuck_s"] == pytest.approx(20.0)
    # requests admitted at 10.0 .. 29.0 s, 8 prompt tokens each, each prefilled in one step
    assert (p["admissions_after"], p["admitted_prompt_tokens_after"]) == (20, 160)
    assert p["prefill_steps_after"] == 20 and p["prefill_tokens_after"] == 160
    assert "20 requests (160 prompt tokens) admitted over 20.0 s" in f["telemetry-prefix-counters-stuck"].expected_effect
    g = f["telemetry-gpu-timing-stopped"].evidence
    assert g["timed_steps"] == 100 and g["steps_after"] == 200
    # 4 admissions after the last move are under the quarter of min_stale_steps (5): not stuck, however long
    assert "telemetry-prefix-counters-stuck" not in findings(path, min_stale_steps=84)
    assert "telemetry-prefix-counters-stuck" in findings(path, min_stale_steps=83)


def test_re_prefills_after_the_last_admission_are_no_stuck_counter(tmp_path):
    """The false alarm of a loaded host (kv-pressure on a busy 2-core CI machine): every request was admitted
    and counted in the first 2 s, then preempted requests were re-prefilled for 30 s. A re-admission is no
    prefix lookup, so the counters standing still is the truth, not a stuck adapter."""
    recs = []
    for i in range(300):
        t = i * S // 10
        recs.append(step(i, t, prefill=64 if i % 5 == 0 else 0))  # a (re-)prefill every 0.5 s throughout
        recs.append(kv(t))
        if i < 20 and i % 5 == 0:  # 4 requests admitted in the first 2 s, each counted at once
            recs += [ev(t, "arrival", f"r{i}", 64), ev(t, "scheduled", f"r{i}"),
                     PrefixCounters(t, 0, 64 * (i // 5 + 1), 0, 0, 0)]
        elif i % 5 == 0:  # later prefills: r0..r15 preempted and re-admitted in turn
            rid = f"r{5 * ((i // 5) % 4)}"
            recs += [ev(t - 1, "preempted", rid), ev(t, "scheduled", rid)]
    path = str(tmp_path / "r.duckdb")
    build(path, recs)
    assert "telemetry-prefix-counters-stuck" not in findings(path)
    # the same run with the re-admissions read as new requests (new ids) is the stuck adapter it would be
    renamed = [r._replace(request_id=f"n{k}") if isinstance(r, RequestEvent) and r.ts_ns >= 2 * S else r
               for k, r in enumerate(recs)]
    path2 = str(tmp_path / "n.duckdb")
    build(path2, [r for r in renamed if not (isinstance(r, RequestEvent) and r.event == REQUEST_EVENTS.index("preempted"))])
    f = findings(path2)
    assert f["telemetry-prefix-counters-stuck"].evidence["admissions_after"] == 56


def test_clock_skew_and_adapter_partial(tmp_path):
    path = str(tmp_path / "c.duckdb")
    build(path, [step(i, i * S // 10) for i in range(10)] + [RunLabel(0, "adapter_missing", "cache.pool")],
          behind_s=5.0)  # the probe's wall clock is 5 s behind
    f = findings(path)
    assert set(f) == {"telemetry-clock-skew", "telemetry-adapter-partial"}
    assert f["telemetry-clock-skew"].evidence["skew_s"] == pytest.approx(-5.0, abs=0.5)
    assert f["telemetry-adapter-partial"].evidence["adapter_missing"] == "cache.pool"


def test_a_lowered_detail_is_named_with_what_is_off_and_why(tmp_path):
    """The vLLM adapter's budget lowering (adapters/vllm/budget.py) is a finding, never silent; no label, none."""
    path = str(tmp_path / "l.duckdb")
    why = "KV walks off from engine step 384: adapter 0.81% of step time > budget 0.50%"
    build(path, [step(i, i * S // 10) for i in range(10)]
          + [RunLabel(0, "vllm_adapter_budget", "0.005"), RunLabel(0, "detail_lowered", why)])
    f = findings(path)
    assert set(f) == {"telemetry-detail-lowered"}
    assert f["telemetry-detail-lowered"].evidence["detail_lowered"] == why
    assert f["telemetry-detail-lowered"].evidence["budget_share"] == "0.005"
    assert f["telemetry-detail-lowered"].severity == "info"  # the budget at work, said; no fault of the server's
    path2 = str(tmp_path / "n.duckdb")
    build(path2, [step(i, i * S // 10) for i in range(10)] + [RunLabel(0, "vllm_adapter_budget", "0.005")])
    assert "telemetry-detail-lowered" not in findings(path2)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def gauge(reg: CollectorRegistry) -> dict:
    return {s.labels["reason"]: s.value for m in reg.collect() if m.name == "phasescope_telemetry_degraded"
            for s in m.samples}


def test_live_gauge_follows_the_records():
    reg, clock = CollectorRegistry(), Clock()
    w = TelemetryWatch(reg, stale_s=10, clock=clock, wall_ns=lambda: 0)
    w.on_records([(1, [Hello(0, 0, 1, 0, 1, "r", "m", "hf-cb")])])
    w.on_records([(1, [step(0, 0, prefill=8, gpu=1.0), kv(0), PrefixCounters(0, 0, 8, 0, 0, 0),
                       ProbeHealth(0, 0, 1, 10, 0, 0, 1, 0, 0)])])
    assert set(gauge(reg)) == set(REASONS) and not any(gauge(reg).values())
    for k in range(1, 13):  # 12 s of steps and moving prefix counters, but no KV snapshot, no GPU time
        clock.t += 1
        w.on_records([(1, [step(k, k, prefill=8), PrefixCounters(0, 0, 8 + 8 * k, 0, 0, 0)])])
    g = gauge(reg)
    assert g["kv-snapshots-stopped"] == 1 and g["gpu-timing-stopped"] == 1 and g["prefix-counters-stuck"] == 0
    w.on_records([(1, [kv(0), ProbeHealth(0, 0, 1, 20, 5, 0, 2, 0, 0), RunLabel(0, "adapter_missing", "x")])])
    g = gauge(reg)
    assert g["kv-snapshots-stopped"] == 0 and g["records-dropped"] == 1 and g["adapter-partial"] == 1
    clock.t += 60  # the server went idle: no steps, nothing is "stopped while serving"
    g = gauge(reg)
    assert g["gpu-timing-stopped"] == 0 and g["records-dropped"] == 0


def test_real_fixture_fires_kv_and_prefix_reasons_with_its_numbers(scenario_db):
    path, run_id = scenario_db("telemetry-silent")
    con = duckdb.connect(path, read_only=True)
    try:
        found = {f.id: f for f in diagnose(con, run_id)}
        steps_after_kv = con.execute(
            "SELECT count(*) FROM steps WHERE ts_ns > (SELECT max(ts_ns) FROM kv_snapshots)").fetchone()[0]
    finally:
        con.close()
    kvf = found["telemetry-kv-snapshots-stopped"].evidence
    assert kvf["steps_after"] == steps_after_kv > 20 and kvf["silent_s"] >= 10
    assert "telemetry-prefix-counters-stuck" in found


@pytest.mark.parametrize("as_chunks", [False, True], ids=["records", "columns"])
def test_live_gauge_reads_first_admissions_not_re_admissions(as_chunks):
    """The same verdicts whether request events come as records or as the columns the sidecar hands sinks."""
    reg, clock = CollectorRegistry(), Clock()
    w = TelemetryWatch(reg, stale_s=10, clock=clock, wall_ns=lambda: 0)
    if as_chunks:  # frames split by type, as the sidecar commits them: the watch's columnar types as Chunks
        put = w.on_records

        def as_sidecar(recs: list) -> list:
            out = []
            for code, arrs in columnar.split_records(recs)[0].items():
                cls = columnar.TYPES[code].cls
                out += ([Chunk(cls, a) for a in arrs] if cls in w.columnar_types
                        else columnar.records_of({code: arrs}))
            return out
        w.on_records = lambda b: put([(sid, as_sidecar(recs)) for sid, recs in b])
    put0 = TelemetryWatch.on_records.__get__(w)
    put0([(1, [Hello(0, 0, 1, 0, 1, "r", "m", "hf-cb")])])
    w.on_records([(1, [ev(0, "arrival", "a", 64), ev(0, "scheduled", "a"), step(0, 0, prefill=64),
                       PrefixCounters(0, 0, 64, 0, 0, 0)])])
    for k in range(1, 13):  # 12 s of re-prefills of a preempted request: no lookup, the counters rightly stand
        clock.t += 1
        w.on_records([(1, [ev(k, "preempted", "a"), ev(k, "scheduled", "a"), step(k, k, prefill=64)])])
    assert gauge(reg)["prefix-counters-stuck"] == 0
    for k in range(13, 25):  # 12 s of new requests admitted, the counters standing still: stuck
        clock.t += 1
        w.on_records([(1, [ev(k, "arrival", f"n{k}", 64), ev(k, "scheduled", f"n{k}"), step(k, k, prefill=64)])])
    assert gauge(reg)["prefix-counters-stuck"] == 1
    w.on_records([(1, [PrefixCounters(0, 0, 128, 0, 0, 0)])])
    assert gauge(reg)["prefix-counters-stuck"] == 0
