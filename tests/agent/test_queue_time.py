"""Queue time as the runtime defines it (issue 27 item 2): vLLM's queue starts at the engine's QUEUED event, and
the frontend's part before it (arrival -> engine queue: tokenization, hand-off) is stored apart as frontend_s.
Runtimes without a queued event queue from the arrival (docs/definitions.md)."""

from __future__ import annotations

import time
from types import SimpleNamespace as NS

import duckdb

from phasescope.agent.probe.adapters import vllm as adapter
from phasescope.agent.probe.adapters.vllm import common as vllm_common
from phasescope.agent.records.events import REQ_ARRIVAL, REQ_QUEUED, REQUEST_EVENTS, Hello, RequestEvent
from phasescope.agent.sidecar.store import Store

MS = 1_000_000


def _ev(name: str) -> int:
    return REQUEST_EVENTS.index(name)


def test_requests_queue_from_the_engine_queue_and_keep_the_frontend_part_apart(tmp_path):
    path = str(tmp_path / "q.duckdb")
    store = Store(path)
    t0 = 1_000_000_000
    sid = store.register_source(Hello(t0, time.time_ns() - t0, 1, 0, 1, "q", "m", "vllm"))
    recs = [RequestEvent(t0, 0, _ev("arrival"), "v", 8, 0),  # vLLM: 7 ms in the frontend, then 3 ms queued
            RequestEvent(t0 + 7 * MS, 0, _ev("queued"), "v", 0, 0),
            RequestEvent(t0 + 10 * MS, 0, _ev("scheduled"), "v", 0, 0),
            RequestEvent(t0 + 20 * MS, 0, _ev("token"), "v", 1, 0),
            RequestEvent(t0 + 20 * MS, 0, _ev("finished"), "v", 1, 0),
            RequestEvent(t0, 0, _ev("arrival"), "h", 8, 0),  # a runtime without a queued event
            RequestEvent(t0 + 4 * MS, 0, _ev("scheduled"), "h", 0, 0),
            RequestEvent(t0 + 9 * MS, 0, _ev("token"), "h", 1, 0),
            RequestEvent(t0 + 9 * MS, 0, _ev("finished"), "h", 1, 0)]
    store.append([(sid, recs)])
    store.close()
    con = duckdb.connect(path, read_only=True)
    try:
        rows = dict((r, (q, f, t)) for r, q, f, t in con.execute(
            "SELECT request_id, round(queue_s * 1e3, 6), round(frontend_s * 1e3, 6), round(ttft_s * 1e3, 6) "
            "FROM requests").fetchall())
    finally:
        con.close()
    assert rows == {"v": (3.0, 7.0, 20.0), "h": (4.0, None, 9.0)}  # TTFT still from the arrival


def test_vllm_adapter_stamps_the_queue_with_vllms_own_queued_event(monkeypatch, tmp_path):
    monkeypatch.setenv("PHASESCOPE_AGENT", f"unix:{tmp_path}/none.sock")
    monkeypatch.setenv("PHASESCOPE_PREFIX_TABLE_PAGES", "0")
    monkeypatch.setattr(vllm_common, "_CHANNELS", {})
    kvm = NS(block_pool=None, enable_caching=True,
             coordinator=NS(single_type_managers=[NS(block_size=16, req_to_blocks={})]))
    sched = NS(vllm_config=NS(), kv_cache_manager=kvm, requests={}, kv_cache_config=None,
               add_request=lambda r: None, schedule=lambda: None, update_from_output=lambda o, so: {},
               _preempt_request=lambda r, t: None, finish_requests=lambda ids, st: [])
    hooks = adapter.EngineHooks(sched)
    seen: list = []
    hooks._event = lambda ts, event, rid, tokens=0, cached=0: seen.append((event, rid, ts))
    try:
        queued = NS(type=NS(name="QUEUED"), timestamp=123.456)  # vLLM's EngineCoreEvent, time.monotonic() s
        sched.add_request(NS(request_id="r", arrival_time=time.time(), num_prompt_tokens=5, events=[queued]))
        assert [e for e, _, _ in seen] == [REQ_ARRIVAL, REQ_QUEUED]
        assert seen[1][2] == int(123.456 * 1e9)
    finally:
        adapter.close_channels(0.1)
