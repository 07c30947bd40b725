"""Steps reach the OTLP exporter as numpy columns (a Chunk per frame) and arrive at a local OTLP/HTTP receiver
(real protobuf) with exact bucket counts, count, sum, min and max per attribute set; the same points as the
SDK's own histogram, in both temporalities; and no drops under a burst through a real sidecar."""

from __future__ import annotations

import bisect
import math
import os

import numpy as np
import pytest

from phasescope.agent.records import events as ev
from phasescope.agent.records.events import PHASES, Hello, Step
from phasescope.agent.sidecar import Chunk, columnar
from phasescope.exporters import buckets
from phasescope.exporters.otlp import INSTRUMENTS, OtlpExporter
from hang import HANG_S

STEP_CODE = next(code for code, t in columnar.TYPES.items() if t.cls is Step)
HELLO = Hello(ts_ns=1, wall_minus_mono_ns=0, pid=1, rank=0, world_size=1, run_id="r", model="m",
              runtime="hf-generate")
BASE = {"gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "hf-generate",
        "gen_ai.request.model": "m"}
NAME = "phasescope.step.duration"


def attrs(kvs) -> dict:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in kvs}


def _steps(n: int, seed: int, ranks: list[int]) -> np.ndarray:
    """`n` random steps in the sidecar's structured dtype: every phase and an unknown one (9), host times on
    every bound exactly, past the last bound, and a few NaN / inf (not finite: the SDK ignores them)."""
    rng = np.random.default_rng(seed)
    a = np.zeros(n, dtype=columnar.TYPES[STEP_CODE].dtype)
    a["_type"] = STEP_CODE
    a["ts_ns"] = np.arange(n) + 1_000
    a["step_id"] = np.arange(n)
    a["rank"] = rng.choice(ranks, n)
    a["phase"] = rng.choice([*range(len(PHASES)), 9], n)
    a["num_seqs"] = 8
    a["decode_tokens"] = 8
    host_ms = rng.lognormal(math.log(20), 1.5, n)
    exact = np.array(buckets.STEP_S) * 1e3  # ms values that land exactly on a bound (v <= b)
    host_ms[: len(exact) * 50] = np.tile(exact, 50)
    host_ms[-10:] = 20_000.0  # past the last bound: the +Inf bucket only
    host_ms[-20:-10] = [np.nan, np.inf] * 5
    a["host_ms"] = host_ms
    a["gpu_ms"] = np.nan
    return a


def _expected(a: np.ndarray) -> dict:
    """Independent computation, a Python loop over the rows: per attribute set the count in each bucket
    (first bound b with v <= b, the last one +Inf), count, sum, min and max of the host times in s."""
    bounds = list(buckets.STEP_S)
    out: dict = {}
    for rank, phase, host_ms in zip(a["rank"].tolist(), a["phase"].tolist(), a["host_ms"].tolist()):
        if not math.isfinite(host_ms):
            continue
        v = host_ms * 1e-3
        key = tuple(sorted({**BASE, "phasescope.rank": rank,
                            "phasescope.phase": PHASES[phase] if phase < len(PHASES) else str(phase)}.items()))
        h = out.setdefault(key, {"buckets": [0] * (len(bounds) + 1), "sum": 0.0, "min": math.inf, "max": -math.inf})
        h["buckets"][bisect.bisect_left(bounds, v)] += 1
        h["sum"] += v
        h["min"], h["max"] = min(h["min"], v), max(h["max"], v)
    return out


def _points(rx) -> dict:
    m = rx.last_metrics()[NAME]
    assert m.WhichOneof("data") == "histogram"
    return {tuple(sorted(attrs(dp.attributes).items())): dp for dp in m.histogram.data_points}


def test_a_large_columnar_step_batch_arrives_with_exact_buckets(otel_env):
    rx = otel_env
    a = _steps(200_000, seed=1, ranks=[0, 1, 2, 3])
    exp = OtlpExporter(export_interval_s=60)  # only the explicit flush exports
    # a batch as the sidecar hands it: the Hello, then one Chunk per frame of 8192 steps
    exp.on_records([(7, [HELLO] + [Chunk(Step, a[i:i + 8192]) for i in range(0, len(a), 8192)])])
    assert exp.flush(HANG_S)
    exp.close()
    m = rx.last_metrics()[NAME]
    unit, description, bounds = INSTRUMENTS[NAME]
    assert (m.unit, m.description) == (unit, description) == ("s", "Host wall time of one forward of the model, "
                                                                    "by phase.")
    assert m.histogram.aggregation_temporality == 2  # AGGREGATION_TEMPORALITY_CUMULATIVE
    expect = _expected(a)
    assert len(expect) == 4 * (len(PHASES) + 1)
    got = _points(rx)
    assert set(got) == set(expect)
    for key, e in expect.items():
        dp = got[key]
        assert list(dp.explicit_bounds) == [float(b) for b in bounds]
        assert list(dp.bucket_counts) == e["buckets"], key
        assert dp.count == sum(e["buckets"])
        assert dp.sum == pytest.approx(e["sum"], rel=1e-12)
        assert (dp.min, dp.max) == (e["min"], e["max"])
        assert dp.start_time_unix_nano <= dp.time_unix_nano
    assert sum(dp.count for dp in got.values()) == 200_000 - 10  # NaN and inf left out
    # the exact-bound values landed in their own bucket, not the next one
    first = got[tuple(sorted({**BASE, "phasescope.rank": 0, "phasescope.phase": "prefill"}.items()))]
    assert first.bucket_counts[0] >= 1


@pytest.mark.parametrize("temporality", ["cumulative", "delta"])
def test_the_same_points_as_the_sdk_histogram(temporality, otel_env, monkeypatch):
    """Two rounds of steps, a flush after each: the exported points equal those of the SDK's own histogram
    (one `record` per step, the same View) read by an in-memory reader of the same temporality."""
    from opentelemetry.sdk.metrics import Histogram, MeterProvider
    from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

    rx = otel_env
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", temporality)
    t = {"cumulative": AggregationTemporality.CUMULATIVE, "delta": AggregationTemporality.DELTA}[temporality]
    unit, description, bounds = INSTRUMENTS[NAME]
    ref_reader = InMemoryMetricReader(preferred_temporality={Histogram: t})
    ref = MeterProvider(metric_readers=[ref_reader],
                        views=[View(instrument_name=NAME, aggregation=ExplicitBucketHistogramAggregation(bounds))])
    hist = ref.get_meter("ref").create_histogram(NAME, unit=unit, description=description)
    exp = OtlpExporter(export_interval_s=60)
    exp.on_records([(3, [HELLO])])
    rounds = [_steps(20_000, seed=2, ranks=[0, 1]), _steps(5_000, seed=3, ranks=[1, 2])[:-20]]
    for k, a in enumerate(rounds):
        as_records = k == 1  # the second round as NamedTuples: the same aggregation
        recs = columnar.records_of({STEP_CODE: [a]}) if as_records else [Chunk(Step, a)]
        exp.on_records([(3, recs)])
        assert exp.flush(HANG_S)
        for rank, phase, host_ms in zip(a["rank"].tolist(), a["phase"].tolist(), a["host_ms"].tolist()):
            if math.isfinite(host_ms):
                hist.record(host_ms * 1e-3, {**BASE, "phasescope.rank": rank,
                                             "phasescope.phase": PHASES[phase] if phase < len(PHASES) else str(phase)})
        (want,) = [m for rm in ref_reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                   for m in sm.metrics]
        m = rx.metrics[-1].resource_metrics[0].scope_metrics[0].metrics
        (got_m,) = [x for x in m if x.name == NAME]
        assert (got_m.unit, got_m.description) == (want.unit, want.description)
        assert got_m.histogram.aggregation_temporality == want.data.aggregation_temporality.value
        got = {tuple(sorted(attrs(dp.attributes).items())): dp for dp in got_m.histogram.data_points}
        ref_points = {tuple(sorted(dp.attributes.items())): dp for dp in want.data.data_points}
        assert set(got) == set(ref_points), k
        for key, w in ref_points.items():
            dp = got[key]
            assert list(dp.bucket_counts) == list(w.bucket_counts), (k, key)
            assert list(dp.explicit_bounds) == list(w.explicit_bounds)
            assert dp.count == w.count and (dp.min, dp.max) == (w.min, w.max)
            assert dp.sum == pytest.approx(w.sum, rel=1e-12)
        if t is AggregationTemporality.DELTA and k == 1:  # only the second round, only its attribute sets
            assert sum(dp.count for dp in got.values()) == int(np.isfinite(rounds[1]["host_ms"]).sum())
    exp.close()
    ref.shutdown()


def test_steps_alone_are_exported(otel_env):
    """No request has ended, so the SDK's instruments hold nothing: the step histogram is exported alone,
    under the exporter's resource and scope."""
    rx = otel_env
    exp = OtlpExporter(export_interval_s=60)
    exp.on_records([(1, [HELLO, Chunk(Step, _steps(2000, seed=5, ranks=[0])[:-20])])])
    assert exp.flush(HANG_S)
    exp.close()
    assert len(rx.metrics) == 2  # the flush and the last collection at close
    (rm,) = rx.metrics[0].resource_metrics
    assert attrs(rm.resource.attributes)["service.name"] == "phasescope"
    (sm,) = rm.scope_metrics
    assert sm.scope.name == "phasescope"
    assert [m.name for m in sm.metrics] == [NAME]
    assert sum(dp.count for dp in sm.metrics[0].histogram.data_points) == 1980


def test_sidecar_burst_every_step_reaches_the_otlp_sink(otel_env, short_tmp):
    """A probe bursts 1.2M steps at 300k steps/s (frames of 8192) into a real sidecar whose only sink is the
    OTLP exporter and whose sink queue holds 4 MiB (~80k steps): the exporter takes them as columns as
    fast as they are committed, so none is dropped, and after the sidecar stops (the exporter flushes on
    close) the exported step histogram counts every stored step. One SDK `record` per step (~100k steps/s
    on one core, the NamedTuples included) could not."""
    from conftest import stream_paced
    from phasescope.agent.sidecar import Sidecar

    rx = otel_env
    n, frame, rate = 1_200_000, 8192, 300_000.0
    frames = [ev.encode_frame([Step(1_000 + j, j, 0, ev.PHASE_DECODE, 8, 0, 8, 4096, 1.5, float("nan"))
                               for j in range(i, min(i + frame, n))]) for i in range(0, n, frame)]
    exp = OtlpExporter(export_interval_s=60, close_timeout_s=10)
    sock = os.path.join(short_tmp, "a.sock")
    sc = Sidecar(os.path.join(short_tmp, "s.duckdb"), [f"unix:{sock}"], batch_interval_s=0.05, sinks=[exp],
                 sink_budget_bytes=4 << 20)
    with sc:
        s, took = stream_paced(sock, HELLO, frames, frame, rate)
        assert s.delivered == n and s.lost == 0
        assert sc.wait_rows(lambda: sc.stats.rows_written_total >= n, 30)
    # stopped: the sinks got what was queued, the exporter flushed on close
    assert sc.stats.sink_dropped_records_total == 0, (sc.stats.sink_dropped_records_total, n / took)
    assert sc.stats.sink_errors_total == 0
    key = tuple(sorted({**BASE, "phasescope.rank": 0, "phasescope.phase": "decode"}.items()))
    got = _points(rx)
    assert list(got) == [key]
    assert got[key].count == n
    assert got[key].sum == pytest.approx(n * 1.5e-3, rel=1e-9)
    assert n / took > 0.5 * rate, f"the burst ran at {n / took:,.0f} steps/s only"
