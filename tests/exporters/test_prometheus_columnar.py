"""Steps reach the Prometheus exporter as numpy columns (a Chunk per frame): exact bucket counts and
counters on a large batch, the same /metrics as the per-record path, the label cap, and no drops under a
burst through a real sidecar."""

from __future__ import annotations

import bisect
import math
import os

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from phasescope.agent.records import events as ev
from phasescope.agent.records.events import PHASES, Hello, Step
from phasescope.agent.sidecar import Chunk, columnar
from phasescope.exporters import buckets
from phasescope.exporters.prometheus import PrometheusExporter, SidecarStatsCollector
from phasescope.exporters.sources import OTHER

STEP_CODE = next(code for code, t in columnar.TYPES.items() if t.cls is Step)
HELLO = Hello(ts_ns=1, wall_minus_mono_ns=0, pid=1, rank=0, world_size=1, run_id="r", model="m",
              runtime="hf-generate")


def _steps(n: int, seed: int, ranks: list[int], rank_p: list[float] | None = None) -> np.ndarray:
    """`n` random steps as the sidecar holds them (its structured dtype): every phase, GPU time on about
    half (NaN on the rest), host times that include every bucket bound exactly and values past the last."""
    rng = np.random.default_rng(seed)
    a = np.zeros(n, dtype=columnar.TYPES[STEP_CODE].dtype)
    a["_type"] = STEP_CODE
    a["ts_ns"] = np.arange(n) + 1_000
    a["step_id"] = np.arange(n)
    a["rank"] = rng.choice(ranks, n, p=rank_p)
    a["phase"] = rng.integers(0, len(PHASES), n)
    a["num_seqs"] = rng.integers(1, 64, n)
    a["prefill_tokens"] = np.where(rng.random(n) < 0.3, rng.integers(0, 4096, n), 0)
    a["decode_tokens"] = rng.integers(0, 256, n)
    a["context_tokens"] = rng.integers(0, 1 << 20, n)
    host_ms = rng.lognormal(math.log(20), 1.5, n)
    exact = np.array(buckets.STEP_S) * 1e3  # ms values that land exactly on a bound (v <= le)
    host_ms[: len(exact) * 50] = np.tile(exact, 50)
    host_ms[-10:] = 20_000.0  # past the last bound: +Inf only
    a["host_ms"] = host_ms
    a["gpu_ms"] = np.where(rng.random(n) < 0.5, host_ms * rng.uniform(0.5, 1.0, n), np.nan)
    return a


def _expected(a: np.ndarray, rank_label) -> dict:
    """Independent computation, a Python loop over the rows: per (rank label, phase) the cumulative count of
    values <= each bound (s), count and sum; tokens per (rank label, kind)."""
    bounds = list(buckets.STEP_S)
    host: dict = {}
    gpu: dict = {}
    tokens: dict = {}
    for row in a.tolist():
        _, _, _, rank, phase, _, pre, dec, _, host_ms, gpu_ms = row
        key = (rank_label(rank), PHASES[phase])
        for table, v in ((host, host_ms), (gpu, gpu_ms)):
            if math.isnan(v):
                continue
            h = table.setdefault(key, [[0] * (len(bounds) + 1), 0.0])
            h[0][bisect.bisect_left(bounds, v * 1e-3)] += 1  # first bound b with v <= b (len: +Inf only)
            h[1] += v * 1e-3
        for kind, k in (("prefill", pre), ("decode", dec)):
            if k:
                tokens[(key[0], kind)] = tokens.get((key[0], kind), 0) + k
    return {"host": host, "gpu": gpu, "tokens": tokens}


def _check(reg: CollectorRegistry, exp: dict) -> None:
    les = [repr(b) for b in buckets.STEP_S] + ["+Inf"]
    for family, table in (("phasescope_step_host_seconds", exp["host"]), ("phasescope_step_gpu_seconds", exp["gpu"])):
        assert table
        for (rank, phase), (counts, total) in table.items():
            labels = {"model": "m", "rank": rank, "phase": phase}
            cum = np.cumsum(counts).tolist()
            got = [reg.get_sample_value(f"{family}_bucket", {**labels, "le": le}) for le in les]
            assert got == cum, (family, rank, phase)
            assert reg.get_sample_value(f"{family}_count", labels) == cum[-1]
            assert reg.get_sample_value(f"{family}_sum", labels) == pytest.approx(total, rel=1e-12)
    for (rank, kind), n in exp["tokens"].items():
        assert reg.get_sample_value("phasescope_step_tokens_total", {"model": "m", "rank": rank, "kind": kind}) == n
    series = {(s.labels["rank"], s.labels["phase"]) for f in text_string_to_metric_families(_text(reg))
              if f.name == "phasescope_step_host_seconds" for s in f.samples if s.name.endswith("_count")}
    assert series == set(exp["host"])  # no other series


def _text(reg: CollectorRegistry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(reg).decode()


def test_a_large_columnar_batch_gives_exact_buckets_and_counters():
    a = _steps(200_000, seed=1, ranks=[0, 1, 2, 3])
    reg = CollectorRegistry()
    exp = PrometheusExporter(reg)
    # a batch as the sidecar hands it: the Hello, then one Chunk per frame of 8192 steps
    exp.on_records([(7, [HELLO] + [Chunk(Step, a[i:i + 8192]) for i in range(0, len(a), 8192)])])
    assert exp.record_errors_total == 0
    _check(reg, _expected(a, str))
    # the exact-bound values landed in their own bucket, not the next one
    assert reg.get_sample_value("phasescope_step_host_seconds_bucket",
                                {"model": "m", "rank": "0", "phase": "prefill", "le": "0.0005"}) >= 1


def test_chunks_and_records_give_the_same_metrics():
    """The columnar path is the per-record path, a column at a time: same series, same samples."""
    a = _steps(20_000, seed=2, ranks=[0, 1])
    regs = []
    for as_chunk in (True, False):
        reg = CollectorRegistry()
        exp = PrometheusExporter(reg)
        recs = [Chunk(Step, a)] if as_chunk else columnar.records_of({STEP_CODE: [a]})
        exp.on_records([(3, [HELLO] + recs)])
        regs.append({(s.name, tuple(sorted(s.labels.items()))): s.value
                     for f in text_string_to_metric_families(_text(reg)) for s in f.samples
                     if f.name.startswith("phasescope_step_")})
    chunked, records = regs
    assert chunked.keys() == records.keys()
    for k, v in records.items():
        assert chunked[k] == (pytest.approx(v, rel=1e-12) if k[0].endswith("_sum") else v), k


def test_columnar_steps_keep_the_rank_cap():
    """Two busy ranks keep their series; six quiet ones are folded into `other`, whose series hold their
    steps exactly; nothing is lost."""
    ranks = [0, 1, 10, 11, 12, 13, 14, 15]
    a = _steps(100_000, seed=3, ranks=ranks, rank_p=[0.45, 0.45] + [0.1 / 6] * 6)
    reg = CollectorRegistry()
    exp = PrometheusExporter(reg, max_ranks=2)
    exp.on_records([(5, [HELLO])])
    # the busy ranks take the two places first, then every frame holds all eight ranks
    busy = a[np.isin(a["rank"], [0, 1])][:1000]
    exp.on_records([(5, [Chunk(Step, busy)])])
    exp.on_records([(5, [Chunk(Step, a[i:i + 8192]) for i in range(0, len(a), 8192)])])
    both = np.concatenate([busy, a])
    _check(reg, _expected(both, lambda r: str(r) if r in (0, 1) else OTHER))
    assert exp.rank_cap.folded_total == int((~np.isin(a["rank"], [0, 1])).sum())


def test_sidecar_burst_every_step_reaches_the_prometheus_sink(short_tmp):
    """A probe bursts 1.2M steps at 300k steps/s (frames of 8192) into a real sidecar whose sink queue
    holds only 4 MiB (~80k steps): the exporter takes them as fast as they are committed, so it sees
    every one (no sink drops) and its counters equal what was stored. Taking them one NamedTuple at a
    time (~180k steps/s on one core) it could not."""
    from conftest import stream_paced
    from phasescope.agent.sidecar import Sidecar

    n, frame, rate = 1_200_000, 8192, 300_000.0
    frames = [ev.encode_frame([Step(1_000 + j, j, 0, ev.PHASE_DECODE, 8, 0, 8, 4096, 1.5, float("nan"))
                               for j in range(i, min(i + frame, n))]) for i in range(0, n, frame)]
    reg = CollectorRegistry()
    exp = PrometheusExporter(reg)
    sock = os.path.join(short_tmp, "a.sock")
    sc = Sidecar(os.path.join(short_tmp, "s.duckdb"), [f"unix:{sock}"], batch_interval_s=0.05, sinks=[exp],
                 sink_budget_bytes=4 << 20)
    reg.register(SidecarStatsCollector(sc.stats))
    with sc:
        s, took = stream_paced(sock, HELLO, frames, frame, rate)
        assert s.delivered == n and s.lost == 0
        labels = {"model": "m", "rank": "0", "phase": "decode"}
        seen = lambda: reg.get_sample_value("phasescope_step_host_seconds_count", labels) or 0  # noqa: E731
        sc.wait_rows(lambda: seen() + sc.stats.sink_dropped_records_total >= n, 30)
        assert sc.stats.sink_dropped_records_total == 0, (sc.stats.sink_dropped_records_total, n / took)
        assert seen() == n
        assert reg.get_sample_value("phasescope_step_tokens_total", {"model": "m", "rank": "0", "kind": "decode"}) == 8 * n
        assert reg.get_sample_value("phasescope_sidecar_sink_dropped_records_total") == 0
        assert sc.stats.rows_written_total >= n
    assert n / took > 0.5 * rate, f"the burst ran at {n / took:,.0f} steps/s only"


def _request_stream(n_requests: int, seed: int) -> list:
    """Interleaved request lifecycles of one source: arrivals, scheduling, token events (some carrying
    several tokens), preemptions and re-scheduling, aborts, finishes, a reused id; steps between them,
    some with long prefills (rank 0)."""
    from phasescope.agent.records.events import (REQ_ABORTED, REQ_ARRIVAL, REQ_FINISHED, REQ_PREEMPTED, REQ_SCHEDULED,
                                         REQ_TOKEN, RequestEvent)

    rng = np.random.default_rng(seed)
    out: list = []
    live: dict[str, int] = {}
    t = 0
    nxt = 0
    while nxt < n_requests or live:
        t += int(rng.integers(1, 3_000_000))
        if nxt < n_requests and (len(live) < 64 and rng.random() < 0.2):
            rid = f"req-{nxt % (n_requests // 2 + 1)}"  # ids come back: a reused id is a new request
            nxt += 1
            out.append(RequestEvent(t, 0, REQ_ARRIVAL, rid, int(rng.integers(1, 3000)), 0))
            out.append(RequestEvent(t + 1000, 0, REQ_SCHEDULED, rid, 0, int(rng.integers(0, 64))))
            live[rid] = 0
            continue
        if not live:
            continue
        rid = list(live)[int(rng.integers(0, len(live)))]
        u = rng.random()
        if u < 0.01:
            out.append(RequestEvent(t, 0, REQ_PREEMPTED, rid, 0, 0))
            out.append(RequestEvent(t + 500, 0, REQ_SCHEDULED, rid, 0, 0))
        elif u < 0.02 or live[rid] > 60:
            kind = REQ_ABORTED if rng.random() < 0.2 else REQ_FINISHED
            out.append(RequestEvent(t, 0, kind, rid, live[rid] if rng.random() < 0.5 else 0, 0))
            del live[rid]
        else:
            k = int(rng.choice([1, 1, 1, 4]))
            out.append(RequestEvent(t, 0, REQ_TOKEN, rid, k, 0))
            live[rid] += k
        if rng.random() < 0.05:
            pre = int(rng.choice([0, 16, 4096]))
            out.append(Step(t, len(out), 0, 0 if pre else 1, 4, pre, 4, 100, 3.0, float("nan")))
    return out


def test_request_event_chunks_give_the_same_metrics_as_records():
    """Request events as columns (tracker walked on tuples, gaps observed in bulk, counters summed) give
    the same request metrics as one NamedTuple each, frame by frame."""
    stream = _request_stream(2_000, seed=4)
    assert len(stream) > 50_000
    got = []
    for as_chunks in (True, False):
        reg = CollectorRegistry()
        exp = PrometheusExporter(reg, long_prefill_tokens=1024)
        exp.on_records([(9, [HELLO])])
        for i in range(0, len(stream), 8192):  # frames of 8192 records, split by type as the sidecar does
            arrays, _ = columnar.split_records(stream[i:i + 8192])
            if as_chunks:
                recs = [Chunk(columnar.TYPES[code].cls, a) for code, arrs in arrays.items() for a in arrs]
            else:
                recs = columnar.records_of(arrays)
            exp.on_records([(9, recs)])
        assert exp.record_errors_total == 0
        got.append({(s.name, tuple(sorted(s.labels.items()))): s.value
                    for f in text_string_to_metric_families(_text(reg)) for s in f.samples
                    if f.name.startswith(("gen_ai_", "phasescope_request", "phasescope_inter_token",
                                          "phasescope_prompt", "phasescope_generation", "phasescope_exporter"))})
    chunked, records = got
    assert chunked.keys() == records.keys()
    for k, v in records.items():
        assert chunked[k] == (pytest.approx(v, rel=1e-9) if k[0].endswith("_sum") else v), k
    itl = records[("phasescope_inter_token_latency_seconds_count", (("model", "m"),))]
    long = records[("phasescope_inter_token_latency_long_prefill_seconds_count", (("model", "m"),))]
    assert 0 < long < itl and itl > 40_000
