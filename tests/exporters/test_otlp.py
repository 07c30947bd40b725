"""The OTLP exporter against a local OTLP/HTTP receiver decoding the real protobuf requests."""

from __future__ import annotations

import os
import socket
import time

import pytest
from prometheus_client import CollectorRegistry

from conftest import MODEL, WALL0, crafted_batch, send_workload
from phasescope.exporters import buckets
from phasescope.exporters.otlp import OtlpExporter
from phasescope.exporters.prometheus import MetricsServer, PrometheusExporter
from hang import HANG_S, HTTP_S, Blocked

MS = 1_000_000


def attrs(kvs) -> dict:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in kvs}


def wait_for(pred, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


@pytest.fixture
def otel_env(otel_env, monkeypatch):
    """conftest's, with a service name of the environment's (checked on the resource)."""
    monkeypatch.setenv("OTEL_SERVICE_NAME", "phasescope-test")
    return otel_env


def test_metrics_names_units_bounds_and_values(otel_env):
    rx = otel_env
    exp = OtlpExporter(export_interval_s=60)  # only the explicit flush exports
    exp.on_records(crafted_batch())
    assert exp.flush(HANG_S)
    exp.close()
    assert rx.content_types == {"application/x-protobuf"}
    res = attrs(rx.metrics[-1].resource_metrics[0].resource.attributes)
    assert res["service.name"] == "phasescope-test"
    m = rx.last_metrics()
    expect = {
        "gen_ai.server.time_to_first_token": ("s", buckets.SEMCONV_TTFT_S),
        "gen_ai.server.time_per_output_token": ("s", buckets.SEMCONV_TPOT_S),
        "gen_ai.server.request.duration": ("s", buckets.SEMCONV_REQUEST_DURATION_S),
        "phasescope.step.duration": ("s", buckets.STEP_S),
    }
    assert set(expect) <= set(m)
    for name, (unit, bounds) in expect.items():
        assert m[name].unit == unit, name
        assert m[name].WhichOneof("data") == "histogram", name
        for dp in m[name].histogram.data_points:
            assert list(dp.explicit_bounds) == [float(b) for b in bounds], name

    def points(name):
        return {tuple(sorted(attrs(dp.attributes).items())): dp for dp in m[name].histogram.data_points}

    base = (("gen_ai.operation.name", "text_completion"), ("gen_ai.provider.name", "hf-generate"),
            ("gen_ai.request.model", MODEL))
    ttft = points("gen_ai.server.time_to_first_token")
    assert list(ttft) == [base]  # successful responses only: r1, r2, r3
    assert ttft[base].count == 3 and ttft[base].sum == pytest.approx(0.11 + 0.32 + 3.0)
    tpot = points("gen_ai.server.time_per_output_token")[base]
    assert tpot.count == 2 and tpot.sum == pytest.approx(0.075)
    dur = points("gen_ai.server.request.duration")
    assert dur[base].count == 3 and dur[base].sum == pytest.approx(3.58)
    aborted = tuple(sorted(base + (("error.type", "aborted"),)))
    assert dur[aborted].count == 1 and dur[aborted].sum == pytest.approx(0.2)
    assert "gen_ai.client.token.usage" not in m  # a client's metric; the server counts its own tokens
    for name, total in (("phasescope.prompt.tokens", 157), ("phasescope.generation.tokens", 7)):
        assert m[name].unit == "{token}" and m[name].WhichOneof("data") == "sum", name
        assert m[name].sum.is_monotonic
        dps = {tuple(sorted(attrs(dp.attributes).items())): dp for dp in m[name].sum.data_points}
        assert list(dps) == [base] and dps[base].as_int == total, name
    steps = points("phasescope.step.duration")
    assert sum(dp.count for dp in steps.values()) == 6


def test_one_span_per_request_with_prefill_and_decode_children(otel_env):
    rx = otel_env
    exp = OtlpExporter(export_interval_s=60, schedule_delay_s=0.05)
    exp.on_records(crafted_batch())
    assert exp.flush(HANG_S)
    exp.close()
    spans = rx.spans()
    roots = {attrs(s.attributes)["gen_ai.response.id"]: s for s in spans if not s.parent_span_id}
    assert sorted(roots) == ["r1", "r2", "r3", "r4"]  # r5 never ended
    children: dict[bytes, list] = {}
    for s in spans:
        if s.parent_span_id:
            children.setdefault(s.parent_span_id, []).append(s)
    assert len(spans) == 4 + 2 + 2 + 1 + 1
    r1 = roots["r1"]
    assert r1.name == f"text_completion {MODEL}"
    assert r1.kind == 2  # SPAN_KIND_SERVER
    assert (r1.start_time_unix_nano, r1.end_time_unix_nano) == (WALL0, WALL0 + 210 * MS)
    a = attrs(r1.attributes)
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.provider.name"] == "hf-generate"
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (100, 3)
    assert a["phasescope.cached_tokens"] == 64
    assert a["gen_ai.server.time_to_first_token"] == pytest.approx(0.11)
    assert a["gen_ai.server.time_per_output_token"] == pytest.approx(0.05)
    kids = {c.name: c for c in children[r1.span_id]}
    assert set(kids) == {"prefill", "decode"}
    assert all(c.trace_id == r1.trace_id for c in kids.values())
    assert (kids["prefill"].start_time_unix_nano, kids["prefill"].end_time_unix_nano) == (WALL0 + 10 * MS,
                                                                                          WALL0 + 110 * MS)
    assert (kids["decode"].start_time_unix_nano, kids["decode"].end_time_unix_nano) == (WALL0 + 110 * MS,
                                                                                        WALL0 + 210 * MS)
    assert attrs(roots["r2"].attributes)["phasescope.preemptions"] == 1
    assert [c.name for c in children[roots["r3"].span_id]] == ["prefill"]  # one output token: no decode
    r4 = roots["r4"]
    assert r4.status.code == 2 and attrs(r4.attributes)["error.type"] == "aborted"  # STATUS_CODE_ERROR
    assert len({s.trace_id for s in roots.values()}) == 4  # one trace per request


@pytest.mark.parametrize("mode", ["down", "hanging"])
def test_unreachable_collector_never_blocks_ingestion_and_failures_are_counted(mode, monkeypatch, short_tmp):
    from phasescope.agent.sidecar import Sidecar

    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k)
    hang = socket.socket()  # held to the end: no other process can take the port
    hang.bind(("127.0.0.1", 0))
    if mode == "hanging":
        hang.listen(64)  # accepts connections (backlog) and never answers
    # "down": bound, never listening: connections are refused
    port = hang.getsockname()[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.5")  # seconds (the standard variable)
    reg = CollectorRegistry()
    prom = PrometheusExporter(reg)
    otlp = OtlpExporter(registry=reg, export_interval_s=0.2, schedule_delay_s=0.05, close_timeout_s=2.0)
    server = MetricsServer(reg, "127.0.0.1:0").start()
    sc = Sidecar(os.path.join(short_tmp, "s.duckdb"), listen=[f"unix:{short_tmp}/a.sock"], batch_interval_s=0.05,
                 sinks=[prom, otlp]).start()
    try:
        with Blocked() as call:
            otlp.on_records(crafted_batch())  # the sink call never waits for the hung endpoint (0.5 s timeout)
        # less than one export timeout blocked (a call that waited for the endpoint would block 0.5 s or more);
        # a loaded machine's run-queue wait is not counted
        assert call.s < 0.5, call.s
        send_workload(sc.bound[0].path)
        n = sum(1 for sid, recs in crafted_batch() if sid for r in recs if type(r).__name__ != "Hello")
        assert sc.wait_rows(lambda: sc.stats.rows_written_total == n, timeout_s=HANG_S)
        assert wait_for(lambda: reg.get_sample_value("gen_ai_server_time_to_first_token_seconds_count",
                                                     {"model": MODEL}) == 4)
        assert wait_for(lambda: all((reg.get_sample_value("phasescope_otlp_export_failures_total",
                                                          {"signal": s}) or 0) >= 2 for s in ("metrics", "traces")))
        import urllib.request

        with urllib.request.urlopen(server.url, timeout=HTTP_S) as resp:
            text = resp.read().decode()
        assert 'phasescope_otlp_export_failures_total{signal="traces"}' in text
        assert 'gen_ai_server_time_to_first_token_seconds_count{model="tiny-llama"} 4.0' in text
        assert sc.stats.sink_errors_total == 0
    finally:
        t0 = time.monotonic()
        sc.stop()  # closes the sinks; OTLP shutdown is bounded by close_timeout_s
        assert time.monotonic() - t0 < 8
        server.close()
        hang.close()
    failures = reg.get_sample_value("phasescope_otlp_export_failures_total", {"signal": "metrics"})
    assert failures == reg.get_sample_value("phasescope_otlp_exports_total", {"signal": "metrics"})


def test_bad_arguments_are_loud():
    with pytest.raises(ValueError):
        OtlpExporter(export_interval_s=0)


def test_running_and_waiting_requests_are_exported_as_they_change(otel_env):
    from conftest import ev, hello

    rx = otel_env
    exp = OtlpExporter(export_interval_s=60)

    def in_flight() -> dict:
        assert exp.flush(HANG_S)
        m = rx.last_metrics()
        out = {}
        for name in ("phasescope.requests.running", "phasescope.requests.waiting"):
            assert m[name].unit == "{request}" and m[name].WhichOneof("data") == "sum", name
            assert not m[name].sum.is_monotonic, name
            (dp,) = m[name].sum.data_points
            assert attrs(dp.attributes) == {"gen_ai.request.model": MODEL}
            out[name.rsplit(".", 1)[1]] = dp.as_int
        return out

    exp.on_records([(1, [hello(0), ev("p", "arrival", 0, tokens=10), ev("p", "scheduled", 1),
                         ev("q", "arrival", 0, tokens=10), ev("q", "scheduled", 1), ev("r", "arrival", 2, tokens=5)])])
    assert in_flight() == {"running": 2, "waiting": 1}
    exp.on_records([(1, [ev("p", "preempted", 5)])])
    assert in_flight() == {"running": 1, "waiting": 2}
    exp.on_records([(1, [ev("p", "scheduled", 9), ev("p", "token", 10, 1), ev("p", "finished", 10, tokens=1),
                         ev("r", "scheduled", 11)])])
    assert in_flight() == {"running": 2, "waiting": 0}
    exp.close()
