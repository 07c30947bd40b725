"""In-flight requests are not failures: a live reader (the agent's read API) judges only requests whose fate
is known; offline, a file no agent writes is complete and a request still running never finished."""

from __future__ import annotations

import time

import duckdb

from builders import synthetic
from phasescope.agent.records.events import REQUEST_EVENTS, Hello, RequestEvent
from phasescope.agent.sidecar.store import Store
from phasescope.analyzers.diagnose import diagnose, diagnose_live
from phasescope.analyzers.reliability import survival_rate

MS = 1_000_000
EV = {name: REQUEST_EVENTS.index(name) for name in ("arrival", "scheduled", "token", "finished")}


def _live_burst(path: str, requests: int = 128, finished: int = 18) -> tuple[str, int]:
    """The issue's live screen: 128 requests arrived at once, 18 finished so far, 110 in flight. Returns
    (run id, wall ns of the last request event)."""
    store = Store(path)
    t0 = 1_000_000_000
    wall_minus_mono = time.time_ns() - t0
    sid = store.register_source(Hello(t0, wall_minus_mono, 1, 0, 1, "live-run", "m", "hf-cb"))
    recs = []
    for i in range(requests):
        rid = f"r{i}"
        recs += [RequestEvent(t0, 0, EV["arrival"], rid, 64, 0)]
        if i < finished:
            recs += [RequestEvent(t0 + 2 * MS, 0, EV["scheduled"], rid, 0, 0),
                     RequestEvent(t0 + 10 * MS, 0, EV["token"], rid, 1, 0),
                     RequestEvent(t0 + 20 * MS, 0, EV["token"], rid, 1, 0),
                     RequestEvent(t0 + 20 * MS, 0, EV["finished"], rid, 2, 0)]
    store.append([(sid, recs)])
    store.close()
    return "live-run", t0 + 20 * MS + wall_minus_mono


def test_a_live_burst_is_not_a_failure_but_the_same_data_offline_is(tmp_path):
    run, last = _live_burst(str(tmp_path / "live.duckdb"))
    con = duckdb.connect(str(tmp_path / "live.duckdb"), read_only=True)
    try:
        assert not [f for f in diagnose_live(con, run) if f.id == "survival-rate-low"]
        live = survival_rate(con, run, now_ns=last + 5 * 10**9)
        assert live == []  # 18 of 18 judged requests finished; 110 in flight
        offline = {f.id: f for f in diagnose(con, run)}["survival-rate-low"]
        assert offline.severity == "critical"
        assert offline.evidence["unfinished"] == 110 and offline.evidence["in_flight"] == 0
        assert "18 of 128 requests finished" in offline.expected_effect and "110 never finished" in offline.expected_effect
    finally:
        con.close()


def test_in_flight_window_boundary(tmp_path):
    run, last = _live_burst(str(tmp_path / "w.duckdb"))
    con = duckdb.connect(str(tmp_path / "w.duckdb"), read_only=True)
    try:
        window = 60.0
        # last event 59.999999999 s ago: live; exactly the window ago: over, the 110 never finished
        assert survival_rate(con, run, now_ns=last + int(window * 1e9) - 1, in_flight_window_s=window) == []
        over = survival_rate(con, run, now_ns=last + int(window * 1e9), in_flight_window_s=window)
        assert over and over[0].evidence["survival_rate"] == 18 / 128 and over[0].evidence["live"] is False
    finally:
        con.close()


def test_live_failures_among_judged_requests_still_fire_and_say_what_is_in_flight(tmp_path):
    path = str(tmp_path / "o.duckdb")
    run = synthetic.overload(path)  # 90 finished, 6 aborted, 4 running; its records happen "now"
    con = duckdb.connect(path, read_only=True)
    try:
        f = {x.id: x for x in diagnose_live(con, run)}["survival-rate-low"]
        assert f.evidence["in_flight"] == 4 and f.evidence["judged"] == 96
        assert f.evidence["survival_rate"] == 90 / 96
        assert "4 still in flight" in f.expected_effect and "never finished" not in f.expected_effect
    finally:
        con.close()


def _hang_ups(path: str, end_event: str) -> str:
    """10 requests; 6 finish, 4 end with `end_event` after two tokens (the issue's streamed hang-ups)."""
    store = Store(path)
    t0 = 1_000_000_000
    sid = store.register_source(Hello(t0, time.time_ns() - t0, 1, 0, 1, "hang-ups", "m", "vllm"))
    recs = []
    for i in range(10):
        rid = f"r{i}"
        recs += [RequestEvent(t0, 0, EV["arrival"], rid, 64, 0),
                 RequestEvent(t0 + 2 * MS, 0, EV["scheduled"], rid, 0, 0),
                 RequestEvent(t0 + 10 * MS, 0, EV["token"], rid, 1, 0),
                 RequestEvent(t0 + 20 * MS, 0, EV["token"], rid, 1, 0)]
        end = "finished" if i < 6 else end_event
        recs.append(RequestEvent(t0 + 20 * MS, 0, REQUEST_EVENTS.index(end), rid, 2, 0))
    store.append([(sid, recs)])
    store.close()
    return "hang-ups"


def test_client_cancels_are_not_failures_but_server_aborts_are(tmp_path):
    """Issue 27 item 4: 'Requests fail under load' (critical) fired on 4 deliberate client disconnects."""
    run = _hang_ups(str(tmp_path / "c.duckdb"), "cancelled")
    con = duckdb.connect(str(tmp_path / "c.duckdb"), read_only=True)
    try:
        assert survival_rate(con, run) == []  # 6 of 6 judged finished; 4 cancelled by their clients
        assert con.execute("SELECT count(*) FROM requests WHERE status = 'running'").fetchone()[0] == 0
    finally:
        con.close()
    run = _hang_ups(str(tmp_path / "a.duckdb"), "aborted")
    con = duckdb.connect(str(tmp_path / "a.duckdb"), read_only=True)
    try:
        f = survival_rate(con, run)[0]
        assert f.severity == "critical" and (f.evidence["aborted"], f.evidence["cancelled"]) == (4, 0)
        assert "6 of 10 requests finished" in f.expected_effect
    finally:
        con.close()
