"""Offered prefill load over a window that makes sense for a burst of arrivals."""

from __future__ import annotations

import pytest

from phasescope.agent.records.events import REQUEST_EVENTS, Hello, RequestEvent
from phasescope.agent.sidecar.store import Store
from phasescope.analyzers.sql import one
from phasescope.analyzers.queueing import QUEUE_SQL


def test_a_burst_of_arrivals_gives_the_rate_over_the_time_to_serve_it(tmp_path):
    # 40 requests of 1000 prompt tokens arrive within 4 us; prefilled one after another, 0.1 s each
    t0 = 5_000_000_000
    records = []
    for i in range(40):
        rid = f"b{i}"
        a = t0 + i * 100
        first = t0 + int((i + 1) * 0.1e9)
        records += [RequestEvent(a, 0, REQUEST_EVENTS.index("arrival"), rid, 1000, 0),
                    RequestEvent(first - 50_000_000, 0, REQUEST_EVENTS.index("scheduled"), rid, 0, 0),
                    RequestEvent(first, 0, REQUEST_EVENTS.index("token"), rid, 1, 0),
                    RequestEvent(first, 0, REQUEST_EVENTS.index("finished"), rid, 1, 0)]
    store = Store(str(tmp_path / "burst.duckdb"))
    sid = store.register_source(Hello(t0, 0, 1, 0, 1, "burst", "m", "hf-cb"))
    store.append([(sid, records)])
    e = one(store.con, QUEUE_SQL, "burst")
    store.close()
    assert e["arrival_span_s"] == pytest.approx(3.9e-6)
    assert e["demand_window_s"] == pytest.approx(4.0)
    # 40 000 tokens over the 4 s it took to serve them: 10 000 tokens/s, not 40 000 / 3.9 us = 1e10
    assert e["prefill_demand_tokens_per_s"] == pytest.approx(10_000)
