"""A request is one arrival: runtime ids reused across calls are never merged.

HF `generate_batch` names every call's requests `req_0`, `req_1`, ...; the store,
its queries and the exporters must see one request per arrival. A request's cached
tokens are those of its first admission; prefix reuse at a re-admission after
preemption is reported apart.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from phasescope.agent.records.events import REQUEST_EVENTS, Hello, RequestEvent
from phasescope.agent.read import queries
from phasescope.agent.sidecar.store import Store
from phasescope.exporters.prometheus import PrometheusExporter

T0 = 10_000_000_000


def _hello(run_id: str = "reuse") -> Hello:
    return Hello(ts_ns=T0, wall_minus_mono_ns=0, pid=1, rank=0, world_size=1, run_id=run_id, model="m",
                 runtime="hf-cb")


def ev(rid: str, kind: str, t_ms: float, tokens: int = 0, cached: int = 0) -> RequestEvent:
    return RequestEvent(T0 + int(t_ms * 1e6), 0, REQUEST_EVENTS.index(kind), rid, tokens, cached)


def _store(tmp_path, records: list) -> Store:
    store = Store(str(tmp_path / "a.duckdb"))
    sid = store.register_source(_hello())
    store.append([(sid, records)])
    return store


def _exporter(records: list) -> PrometheusExporter:
    e = PrometheusExporter(CollectorRegistry())
    e.on_records([(1, [_hello()] + records)])
    return e


def _call(k: int, n: int, *, t0_ms: float, gap_ms: float = 1.0) -> list[RequestEvent]:
    """Call k of generate_batch: requests req_0..req_{n-1}, each 2 s long with 3 tokens."""
    out = []
    for i in range(n):
        t = t0_ms + i * gap_ms
        out += [ev(f"req_{i}", "arrival", t, tokens=10), ev(f"req_{i}", "scheduled", t + 5),
                ev(f"req_{i}", "token", t + 1000, 1), ev(f"req_{i}", "token", t + 1500, 1),
                ev(f"req_{i}", "token", t + 2000, 1), ev(f"req_{i}", "finished", t + 2000, tokens=3)]
    return out


def test_reused_ids_make_one_request_per_arrival_in_store_queries_and_exporter(tmp_path):
    # 5 calls of 4 requests, back to back; each request takes 2 s
    records = [r for k in range(5) for r in _call(k, 4, t0_ms=k * 3000)]
    store = _store(tmp_path, records)
    con = store.con
    s = queries.request_summary(con, "reuse")
    assert s["requests"] == 20 and s["finished"] == 20
    assert s["e2e_p50_s"] == pytest.approx(2.0)
    assert s["e2e_p95_s"] == pytest.approx(2.0)
    assert s["ttft_p95_s"] == pytest.approx(1.0)
    assert s["output_tokens"] == 60
    ids = [r[0] for r in con.execute("SELECT request_id FROM requests ORDER BY arrival_ns").fetchall()]
    assert ids[:5] == ["req_0", "req_1", "req_2", "req_3", "req_0#2"] and len(set(ids)) == 20
    labels = con.execute("SELECT count(DISTINCT runtime_request_id) FROM requests").fetchone()[0]
    assert labels == 4
    # ITL: 2 gaps of .5 s per request, none across two arrivals of one id
    itl = con.execute("SELECT count(*), max(itl_s) FROM itl").fetchone()
    assert itl == (40, pytest.approx(0.5))
    hist = queries.latency_histogram(con, "reuse", "itl")
    assert sum(b["count"] for b in hist) == 40
    assert queries.slo_attainment(con, "reuse", ttft_slo_s=1.5, tpot_slo_s=1.0)["both_ok"] == 20
    store.close()
    e = _exporter(records)
    m = {"model": "m"}
    assert e.registry.get_sample_value("phasescope_requests_finished_total", {**m, "reason": "finished"}) == 20
    assert e.registry.get_sample_value("gen_ai_server_request_duration_seconds_sum", m) == pytest.approx(40.0)
    assert e.registry.get_sample_value("phasescope_inter_token_latency_seconds_count", m) == 40


def test_end_and_next_arrival_at_the_same_instant_are_two_requests(tmp_path):
    records = [ev("a", "arrival", 0, 4), ev("a", "scheduled", 1), ev("a", "token", 10, 1),
               ev("a", "finished", 10, 1),
               ev("a", "arrival", 10, 6), ev("a", "scheduled", 10), ev("a", "token", 30, 1),
               ev("a", "token", 40, 1), ev("a", "finished", 40, 2)]
    store = _store(tmp_path, records)
    rows = store.con.execute("""SELECT request_id, prompt_tokens, output_tokens, e2e_s FROM requests
                                ORDER BY arrival_ns""").fetchall()
    assert rows == [("a", 4, 1, pytest.approx(0.010)), ("a#2", 6, 2, pytest.approx(0.030))]
    store.close()


def test_an_id_reused_while_in_flight_starts_a_new_request_in_the_exporter():
    # the first 'x' never ends (its end was lost); the second arrival is a new request
    records = [ev("x", "arrival", 0, 4), ev("x", "scheduled", 1), ev("x", "token", 10, 1),
               ev("x", "arrival", 100, 4), ev("x", "scheduled", 101), ev("x", "token", 110, 1),
               ev("x", "finished", 110, 1)]
    e = _exporter(records)
    assert e.registry.get_sample_value("gen_ai_server_request_duration_seconds_sum", {"model": "m"}) == \
        pytest.approx(0.010)
    assert e.tracker.evicted_total == 1


def test_cached_tokens_are_the_first_admissions_readmission_reuse_apart(tmp_path):
    # computed its 48-token prefix itself, was soft-reset, re-admitted with 48 tokens from the cache
    records = [ev("p", "arrival", 0, 64), ev("p", "scheduled", 1, cached=0), ev("p", "token", 10, 1),
               ev("p", "preempted", 20), ev("p", "scheduled", 30, cached=48), ev("p", "token", 40, 1),
               ev("p", "finished", 40, 2),
               ev("q", "arrival", 0, 64), ev("q", "scheduled", 2, cached=48), ev("q", "token", 12, 1),
               ev("q", "finished", 12, 1)]
    store = _store(tmp_path, records)
    rows = store.con.execute("""SELECT request_id, cached_tokens, readmit_cached_tokens, preemptions
                                FROM requests ORDER BY request_id""").fetchall()
    assert rows == [("p", 0, 48, 1), ("q", 48, 0, 0)]
    assert store.con.execute("SELECT sum(cached_tokens) FROM requests").fetchone()[0] == 48
    store.close()
    seen = []

    class Listener:
        def first_token(self, *a): ...

        def inter_token(self, *a): ...

        def finished(self, t):
            seen.append((t.request_id, t.cached_tokens))

    from phasescope.exporters.requests import RequestTracker
    from phasescope.exporters.sources import UNKNOWN

    tr = RequestTracker(Listener())
    for r in records:
        tr.on_event(1, UNKNOWN, r)
    assert sorted(seen) == [("p", 0), ("q", 48)]


@pytest.mark.slow
def test_hf_generate_batch_called_repeatedly_counts_every_request(tmp_path):
    """Real HF continuous batching: 3 calls of generate_batch, each naming its requests req_0..req_3."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers import GenerationConfig

    from phasescope.agent import attach
    from phasescope.agent.probe.adapters.hf_cb import HFContinuousBatching, cb_config

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   pad_token_id=0, eos_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    records: list = []
    probe = attach(model, sink=records.extend, runtime="hf-cb")
    adapter = HFContinuousBatching(probe).instrument_model(model)
    gc = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1)
    prompts = [[1 + i, 2 + i, 3 + i, 4 + i, 5 + i] for i in range(4)]
    calls: list[tuple[int, int]] = []  # each call's [start, end] on the probe's clock (monotonic ns)
    try:
        for _ in range(3):
            t0 = time.monotonic_ns()
            out = model.generate_batch(inputs=prompts, generation_config=gc,
                                       continuous_batching_config=cb_config(16, 32, 64), warmup=False)
            calls.append((t0, time.monotonic_ns()))
            assert sorted(out) == ["req_0", "req_1", "req_2", "req_3"]
    finally:
        adapter.detach()
        probe.close()
    reqs = [r for r in records if type(r) is RequestEvent]
    # each call's window holds exactly its own 4 arrivals, admissions and ends (a clock shared with the probe,
    # so the verdict does not depend on how long each call took)
    for start, end in calls:
        inside = [REQUEST_EVENTS[r.event] for r in reqs if start <= r.ts_ns <= end]
        assert (inside.count("arrival"), inside.count("scheduled"), inside.count("finished")) == (4, 4, 4)
    assert all(any(s <= r.ts_ns <= e for s, e in calls) for r in reqs)
    store = Store(str(tmp_path / "hf.duckdb"))
    sid = store.register_source(_hello("hf"))
    store.append([(sid, records)])
    s = queries.request_summary(store.con, "hf")
    assert s["requests"] == 12 and s["finished"] == 12 and s["output_tokens"] == 60
    # each request lies within one call; merged ids would span several calls
    spans = store.con.execute("SELECT arrival_ns, last_token_ns FROM requests").fetchall()
    assert len(spans) == 12
    assert sorted(next(i for i, (s, e) in enumerate(calls) if s <= a and b <= e) for a, b in spans) == \
        [0] * 4 + [1] * 4 + [2] * 4
    store.close()
    e = _exporter(records)
    assert e.registry.get_sample_value("phasescope_requests_finished_total", {"model": "m", "reason": "finished"}) \
        == 12
