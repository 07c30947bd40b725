"""The Prometheus exporter on the crafted workload: exact values through a private registry."""

from __future__ import annotations

import math
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from conftest import MODEL, crafted_batch, ev, hello
from phasescope.exporters import buckets
from phasescope.exporters.prometheus import MetricsServer, PrometheusExporter, SidecarStatsCollector, parse_host_port
from hang import HTTP_S


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def exp():
    reg = CollectorRegistry()
    clock = Clock()
    e = PrometheusExporter(reg, clock=clock)
    e.test_clock = clock
    e.on_records(crafted_batch())
    return e


def val(e: PrometheusExporter, name: str, **labels: str) -> float | None:
    return e.registry.get_sample_value(name, labels)


def test_request_latencies_follow_the_definitions(exp):
    m = {"model": MODEL}
    # TTFT observed at the first token: r1 .11, r2 .32, r3 3.0 and r4 .10 (later aborted)
    assert val(exp, "gen_ai_server_time_to_first_token_seconds_count", **m) == 4
    assert val(exp, "gen_ai_server_time_to_first_token_seconds_sum", **m) == pytest.approx(0.11 + 0.32 + 3.0 + 0.10)
    assert val(exp, "gen_ai_server_time_to_first_token_seconds_bucket", le="2.5", **m) == 3
    assert val(exp, "gen_ai_server_time_to_first_token_seconds_bucket", le="0.1", **m) == 1
    # TPOT only when output_tokens > 1: r1 .05, r2 .025
    assert val(exp, "gen_ai_server_time_per_output_token_seconds_count", **m) == 2
    assert val(exp, "gen_ai_server_time_per_output_token_seconds_sum", **m) == pytest.approx(0.075)
    # E2E of successful requests: .21 + .37 + 3.0
    assert val(exp, "gen_ai_server_request_duration_seconds_count", **m) == 3
    assert val(exp, "gen_ai_server_request_duration_seconds_sum", **m) == pytest.approx(3.58)
    # ITL: r1 .05 .05; r2 a chunk of 2 after 50 ms -> .025 .025; r4 has one token only
    assert val(exp, "phasescope_inter_token_latency_seconds_count", **m) == 4
    assert val(exp, "phasescope_inter_token_latency_seconds_sum", **m) == pytest.approx(0.15)
    assert val(exp, "phasescope_request_queue_time_seconds_sum", **m) == pytest.approx(0.01 + 0.02 + 0.0)
    assert val(exp, "phasescope_request_prefill_time_seconds_sum", **m) == pytest.approx(0.10 + 0.30 + 3.0)
    assert val(exp, "phasescope_request_decode_time_seconds_sum", **m) == pytest.approx(0.10 + 0.05 + 0.0)
    assert val(exp, "phasescope_requests_finished_total", reason="finished", **m) == 3
    assert val(exp, "phasescope_requests_finished_total", reason="aborted", **m) == 1
    assert val(exp, "phasescope_request_preemptions_total", **m) == 1
    # server-side token counters: prompt tokens as requests arrive (r1..r5), generated tokens as produced
    assert val(exp, "phasescope_prompt_tokens_total", **m) == 100 + 50 + 7 + 9 + 5
    assert val(exp, "phasescope_generation_tokens_total", **m) == 3 + 3 + 1 + 1
    assert val(exp, "gen_ai_client_token_usage_sum", token_type="input", **m) is None
    # r5 arrived and was never scheduled: one waiting, none running
    assert val(exp, "phasescope_requests_waiting", **m) == 1 and val(exp, "phasescope_requests_running", **m) == 0
    assert val(exp, "phasescope_exporter_requests_in_flight") == 1  # r5
    assert val(exp, "phasescope_exporter_request_evictions_total") == 0


def test_steps_tp_skew_and_straggler(exp):
    assert val(exp, "phasescope_step_host_seconds_count", model=MODEL, rank="0", phase="prefill") == 1
    assert val(exp, "phasescope_step_host_seconds_count", model=MODEL, rank="1", phase="decode") == 2
    assert val(exp, "phasescope_step_host_seconds_sum", model=MODEL, rank="1", phase="decode") == pytest.approx(0.015)
    # rank 1's third step has no GPU time
    assert val(exp, "phasescope_step_gpu_seconds_count", model=MODEL, rank="1", phase="decode") == 1
    assert val(exp, "phasescope_step_gpu_seconds_sum", model=MODEL, rank="0", phase="prefill") == pytest.approx(0.018)
    assert val(exp, "phasescope_step_tokens_total", model=MODEL, rank="0", kind="prefill") == 64
    assert val(exp, "phasescope_step_tokens_total", model=MODEL, rank="0", kind="decode") == 4
    assert val(exp, "phasescope_tp_step_skew_ratio_count", model=MODEL) == 3
    assert val(exp, "phasescope_tp_step_skew_ratio_sum", model=MODEL) == pytest.approx(0.4)
    assert val(exp, "phasescope_tp_step_skew_ratio_bucket", model=MODEL, le="0.01") == 1
    assert val(exp, "phasescope_tp_slowest_rank_steps_total", model=MODEL, rank="1") == 2
    assert val(exp, "phasescope_tp_slowest_rank_steps_total", model=MODEL, rank="0") is None


def test_kv_prefix_probe_and_gpu_from_snapshots(exp):
    r0 = {"model": MODEL, "rank": "0"}
    assert val(exp, "phasescope_kv_block_usage_ratio", **r0) == 0.5
    assert val(exp, "phasescope_kv_token_usage_ratio", **r0) == 0.375
    assert val(exp, "phasescope_kv_internal_fragmentation_ratio", **r0) == 0.25
    assert val(exp, "phasescope_kv_external_fragmentation_ratio", **r0) == pytest.approx(0.6)
    assert val(exp, "phasescope_kv_pages", state="cached", **r0) == 5
    assert val(exp, "phasescope_kv_pages_allocated_total", **r0) == 70
    assert val(exp, "phasescope_kv_bytes", model=MODEL, rank="1") == 3000
    assert val(exp, "phasescope_kv_imbalance_ratio", model=MODEL) == 0.5
    assert val(exp, "phasescope_prefix_queried_tokens_total", **r0) == 2000  # the latest total
    assert val(exp, "phasescope_prefix_hit_tokens_total", **r0) == 1500
    assert val(exp, "phasescope_prefix_evicted_blocks_total", **r0) == 3
    assert val(exp, "phasescope_probe_dropped_records_total", **r0) == 2
    assert val(exp, "phasescope_probe_gpu_unsampled_steps_total", **r0) == 3
    assert val(exp, "phasescope_gpu_utilization_ratio", gpu="0") == 0.875
    assert val(exp, "phasescope_gpu_memory_used_bytes", gpu="0") == 70 << 30
    assert val(exp, "phasescope_gpu_sm_clock_hertz", gpu="0") == 1.98e9
    assert val(exp, "phasescope_gpu_xid_errors_total", gpu="0") == 0


def test_snapshots_of_silent_sources_go_stale(exp):
    exp.test_clock.t += exp.stale_after_s + 1
    assert val(exp, "phasescope_kv_block_usage_ratio", model=MODEL, rank="0") is None
    assert val(exp, "phasescope_prefix_hit_tokens_total", model=MODEL, rank="0") is None
    # histograms are cumulative and stay
    assert val(exp, "gen_ai_server_time_to_first_token_seconds_count", model=MODEL) == 4


def test_request_state_is_bounded_and_evictions_counted():
    reg = CollectorRegistry()
    e = PrometheusExporter(reg, max_requests=3, request_max_age_s=10.0)
    e.on_records([(1, [hello(0, 1)] + [ev(f"q{i}", "arrival", i) for i in range(5)])])
    assert len(e.tracker) == 3
    assert reg.get_sample_value("phasescope_exporter_request_evictions_total") == 2
    # a request not heard of for max_age_s of producer time is dropped
    e.on_records([(1, [ev("late", "arrival", 20_000)])])
    assert len(e.tracker) == 1
    assert reg.get_sample_value("phasescope_exporter_request_evictions_total") == 5
    # an evicted request's late token gives no TTFT (its arrival is gone)
    e.on_records([(1, [ev("q4", "token", 20_001, 1), ev("q4", "finished", 20_001, 1)])])
    assert reg.get_sample_value("gen_ai_server_time_to_first_token_seconds_count", {"model": MODEL}) is None


def test_buckets_are_supersets_of_vllm_and_semconv():
    assert set(buckets.VLLM_TTFT_S) <= set(buckets.TTFT_S) and set(buckets.SEMCONV_TTFT_S) <= set(buckets.TTFT_S)
    assert set(buckets.VLLM_TPOT_S) <= set(buckets.TPOT_S) and set(buckets.SEMCONV_TPOT_S) <= set(buckets.TPOT_S)
    assert set(buckets.VLLM_E2E_S) <= set(buckets.REQUEST_DURATION_S)
    assert set(buckets.SEMCONV_REQUEST_DURATION_S) <= set(buckets.REQUEST_DURATION_S)
    reg = CollectorRegistry()
    PrometheusExporter(reg).on_records(crafted_batch())
    les = {s.labels["le"] for m in reg.collect() if m.name == "gen_ai_server_time_to_first_token_seconds"
           for s in m.samples if s.name.endswith("_bucket")}
    assert {float(x) for x in les if x != "+Inf"} == set(buckets.TTFT_S)


def test_labels_have_bounded_cardinality(exp):
    allowed = {"model", "rank", "phase", "gpu", "reason", "token_type", "kind", "state", "le", "signal"}
    for m in exp.registry.collect():
        for s in m.samples:
            assert set(s.labels) <= allowed, (s.name, s.labels)
            assert not any(v.startswith("r") and v[1:].isdigit() for v in s.labels.values()), s  # no request ids


def test_metrics_endpoint_on_loopback_serves_the_registry(exp):
    exp.registry.register(SidecarStatsCollector(_Stats()))
    server = MetricsServer(exp.registry, "127.0.0.1:0").start()
    try:
        assert server.port > 0
        with urllib.request.urlopen(server.url, timeout=HTTP_S) as resp:
            text = resp.read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert fams["gen_ai_server_time_to_first_token_seconds"].type == "histogram"
        assert fams["phasescope_prefix_hit_tokens"].type == "counter"
        assert fams["phasescope_sidecar_bad_frames"].samples[0].value == 7
    finally:
        server.close()


def test_misuse_is_loud():
    with pytest.raises(ValueError):
        PrometheusExporter(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        parse_host_port("9464")
    assert parse_host_port("[::1]:9464") == ("::1", 9464)


def _Stats():
    from phasescope.agent.sidecar import SidecarStats

    st = SidecarStats()
    st.bad_frames_total = 7
    return st


def test_nan_free(exp):
    for m in exp.registry.collect():
        for s in m.samples:
            assert not math.isnan(s.value), s


def test_preemptions_count_when_they_happen_and_running_waiting_follow():
    from conftest import ev

    e = PrometheusExporter(CollectorRegistry())
    m = {"model": MODEL}
    e.on_records([(1, [hello(0), ev("p", "arrival", 0, tokens=10), ev("p", "scheduled", 1),
                       ev("q", "arrival", 0, tokens=10), ev("q", "scheduled", 1)])])
    assert val(e, "phasescope_requests_running", **m) == 2 and val(e, "phasescope_requests_waiting", **m) == 0
    e.on_records([(1, [ev("p", "preempted", 5)])])
    assert val(e, "phasescope_request_preemptions_total", **m) == 1  # before p ends
    assert val(e, "phasescope_requests_running", **m) == 1 and val(e, "phasescope_requests_waiting", **m) == 1
    e.on_records([(1, [ev("p", "scheduled", 9), ev("p", "token", 10, 1), ev("p", "finished", 10, tokens=1)])])
    assert val(e, "phasescope_request_preemptions_total", **m) == 1  # not counted again at the end
    assert val(e, "phasescope_requests_running", **m) == 1 and val(e, "phasescope_requests_waiting", **m) == 0


def test_no_created_series_are_exposed():
    from prometheus_client import generate_latest

    reg = CollectorRegistry()
    e = PrometheusExporter(reg)
    e.on_records(crafted_batch())
    text = generate_latest(reg).decode()
    assert "phasescope_requests_finished_total" in text
    assert "_created" not in text


def test_gaps_ended_by_a_long_prefill_step_are_counted_apart():
    from phasescope.agent.records.events import PHASE_DECODE, PHASE_MIXED, REQ_ARRIVAL, REQ_TOKEN, RequestEvent, Step

    e = PrometheusExporter(CollectorRegistry(), long_prefill_tokens=128)
    nan = float("nan")

    def step(i: int, prefill: int, rank: int = 0) -> Step:
        return Step(i * 10**8, i, rank, PHASE_MIXED if prefill else PHASE_DECODE, 2, prefill, 1, 0, 5.0, nan)

    def tok(i: int, n: int = 1) -> RequestEvent:
        return RequestEvent(i * 10**8 + 6 * 10**6, 0, REQ_TOKEN, "r", n, 0)

    e.on_records([(1, [hello(0), RequestEvent(0, 0, REQ_ARRIVAL, "r", 10, 0),
                       step(1, 0), tok(1),                      # first token
                       step(2, 0), tok(2),                      # 100 ms after a pure decode step
                       step(3, 300), step(3, 0, rank=1), tok(3, 2),  # 2 tokens after a 300-token prefill (rank 0)
                       step(4, 127), tok(4)])])                 # a short prefill: not counted apart
    m = {"model": MODEL}
    assert val(e, "phasescope_inter_token_latency_seconds_count", **m) == 4
    assert val(e, "phasescope_inter_token_latency_long_prefill_seconds_count", **m) == 2
    assert val(e, "phasescope_inter_token_latency_long_prefill_seconds_sum", **m) == pytest.approx(0.1)
