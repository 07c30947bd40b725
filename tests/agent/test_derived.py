"""Derived tables (agent/records/derived.py): per-request rows and per-token gaps, kept incrementally.

The views `requests` and `itl` must give exactly what the views they replaced gave (their SQL is kept
in tests/reference_sql.py) on every recorded fixture, whatever state the derived tables are in: folded
in, not folded in at all, or folded in piecemeal from events that arrived out of order.
"""

from __future__ import annotations

import json
import os
import random
import time
import urllib.request

import duckdb
import pytest

from builders.scenarios import DATA_DIR, load
from phasescope.agent.read import queries
from phasescope.agent.records import derived
from phasescope.agent.records.events import REQUEST_EVENTS, Hello, RequestEvent
from phasescope.agent.sidecar.readapi import ReadAPI
from phasescope.agent.sidecar.store import Store
from reference_sql import VIEWS

def reference(con: duckdb.DuckDBPyConnection) -> tuple[list, list]:
    """Today's requests rows, and today's ITL samples counted per token event, both sorted (tests/reference_sql.py)."""
    log, rq, itl = (f"({VIEWS[v]})" for v in ("request_log", "requests", "itl"))
    rows = con.execute(f"WITH request_log AS {log}, r AS {rq} SELECT * FROM r").fetchall()
    samples = con.execute(f"WITH request_log AS {log}, i AS {itl} "
                          "SELECT run_id, request_id, ts_ns, count(*), any_value(itl_s) FROM i GROUP BY ALL").fetchall()
    return sorted(rows, key=repr), sorted(samples, key=repr)


def current(con: duckdb.DuckDBPyConnection) -> tuple[list, list]:
    rq = con.execute("SELECT * FROM requests").fetchall()
    itl = con.execute("SELECT run_id, request_id, ts_ns, tokens, itl_s FROM itl").fetchall()
    return sorted(rq, key=repr), sorted(itl, key=repr)


def forget(con: duckdb.DuckDBPyConnection) -> None:
    """Drop every derived row and the state: the views then derive everything from the raw events."""
    for t in ("request_rows", "token_gaps", "derived_state"):
        con.execute(f"DELETE FROM {t}")
    derived.install(con)


FIXTURES = sorted(n for n in os.listdir(DATA_DIR) if os.path.exists(os.path.join(DATA_DIR, n, "request_events.parquet")))


@pytest.mark.timeout(900)  # GPU fixtures: 6 partial folds and reference reads of ~100k events; ~80 s at load 10
@pytest.mark.parametrize("name", FIXTURES)
def test_views_equal_todays_views_however_far_they_are_folded_in(tmp_path, name):
    path = str(tmp_path / "run.duckdb")
    load(os.path.join(DATA_DIR, name), path)  # folds every event in, as a sidecar leaves a file
    con = duckdb.connect(path)
    want = reference(con)
    assert want[0], "a fixture with request events has requests"
    top = con.execute("SELECT max(rowid) FROM request_events").fetchone()[0]
    assert derived.state(con)[0] == top
    assert current(con) == want
    forget(con)  # nothing folded in: every event is delta
    assert current(con) == want
    # events arriving out of order, in chunks, folded in after every other chunk and read after each
    # (shuffled in SQL by a seeded hash of the row id: executemany inserts row by row, minutes for a GPU fixture)
    seed = random.Random(name).randrange(1 << 30)
    con.execute(f"CREATE TEMP TABLE shuffled AS SELECT *, row_number() OVER (ORDER BY hash(rowid + {seed}), rowid) - 1"
                " AS shuffled_pos FROM request_events")
    n = con.execute("SELECT count(*) FROM shuffled").fetchone()[0]
    con.execute("DELETE FROM request_events")
    forget(con)
    step = max(1, n // 6)
    for i in range(0, n, step):
        con.execute("INSERT INTO request_events SELECT * EXCLUDE (shuffled_pos) FROM shuffled"
                    " WHERE shuffled_pos >= ? AND shuffled_pos < ? ORDER BY shuffled_pos", [i, i + step])
        if i // step % 2:
            derived.refresh(con)
        assert current(con) == reference(con), f"after {min(i + step, n)} of {n} events"
    derived.refresh(con)
    assert current(con) == want
    assert derived.refresh(con) == 0  # nothing new
    con.close()


def test_parquet_exports_derive_everything_from_the_files(tmp_path):
    """Exports have no row ids: their views fold every event in at each read (agent/read/exports.py)."""
    src = os.path.join(DATA_DIR, "reused-ids")
    path = str(tmp_path / "run.duckdb")
    load(src, path)
    con = duckdb.connect(path, read_only=True)
    want = reference(con)
    con.close()
    mem = duckdb.connect()
    for t in ("sources", "request_events"):
        mem.execute(f"CREATE VIEW {t} AS SELECT * FROM read_parquet('{os.path.join(src, t + '.parquet')}')")
    for stmt in derived.ddl(rowids=False):
        mem.execute(stmt)
    assert current(mem) == want


def _events(n_requests: int, t0_ms: int = 0) -> list[RequestEvent]:
    ev = lambda rid, kind, ms, tokens=0: RequestEvent((t0_ms + ms) * 1_000_000, 0, REQUEST_EVENTS.index(kind), rid,
                                                       tokens, 0)
    out = []
    for k in range(n_requests):
        rid = f"r{k % 3}"  # ids reused, as HF generate_batch does
        base = 100 * k
        out += [ev(rid, "arrival", base, 16), ev(rid, "scheduled", base + 1), ev(rid, "token", base + 10, 1),
                ev(rid, "token", base + 20, 2), ev(rid, "token", base + 35, 1), ev(rid, "finished", base + 35, 4)]
    return out


def test_a_store_folds_in_at_close_and_its_views_stay_exact_in_between(tmp_path):
    path = str(tmp_path / "s.duckdb")
    store = Store(path)
    sid = store.register_source(Hello(1, 0, 1, 0, 1, "run", "m", "synthetic"))
    store.append([(sid, _events(30))])
    con = store.cursor()
    assert derived.state(con) is None  # written, not folded in: the views derive it all
    assert current(con) == reference(con)
    assert len(current(con)[0]) == 30 and sum(r[3] for r in current(con)[1]) == 30 * 3
    store.close()
    store = Store(path)
    con = store.cursor()
    assert derived.state(con)[0] == con.execute("SELECT max(rowid) FROM request_events").fetchone()[0]
    store.append([(sid, _events(12, t0_ms=3_000))])  # 12 more, on the same reused ids
    assert current(con) == reference(con)
    assert store.refresh_derived() == 12 * 6
    assert current(con) == reference(con) and len(current(con)[0]) == 42
    store.close()


def test_rows_deleted_under_the_watermark_are_loud_and_a_refresh_folds_the_deletion_in(tmp_path):
    """A retention roll deletes the oldest raw rows: the derived rows no longer describe them. A read says so
    (it never answers from them silently); a writable connection's refresh recomputes the keys that had events
    before the earliest left, and rebuilds everything when rows went missing anywhere else."""
    path = str(tmp_path / "s.duckdb")
    store = Store(path)
    sid = store.register_source(Hello(1, 0, 1, 0, 1, "run", "m", "synthetic"))
    store.append([(sid, _events(20))])
    store.refresh_derived()
    con = store.cursor()
    con.execute("DELETE FROM request_events WHERE ts_ns < 520 * 1000000")  # oldest first, mid-request (r2 of #6)
    with pytest.raises(duckdb.Error, match="deleted from request_events"):
        con.execute("SELECT count(*) FROM requests").fetchall()
    assert derived.refresh(con) == 0  # nothing new: the deletion folded in
    assert current(con) == reference(con)
    left = len(current(con)[0])
    assert left < 20
    con.execute("DELETE FROM request_events WHERE ts_ns BETWEEN 1200 * 1000000 AND 1300 * 1000000")  # not oldest
    derived.refresh(con)
    assert current(con) == reference(con) and len(current(con)[0]) < left
    store.close()


def test_a_token_count_of_two_to_the_31_is_a_weight_not_rows(tmp_path):
    """Issue 22: a RequestEvent with tokens = 2^31 - 1 (stored by an older writer: ingest now range-checks it)
    made the ITL histogram and the findings expand it into 2^31 rows. Now it is one gap of that weight."""
    from phasescope.analyzers.diagnose import diagnose

    path = str(tmp_path / "s.duckdb")
    store = Store(path)
    sid = store.register_source(Hello(1, 0, 1, 0, 1, "run", "m", "synthetic"))
    store.append([(sid, _events(6))])
    big = 2**31 - 1
    store.con.execute("INSERT INTO request_events VALUES (?, ?, 0, 'token', 'r0', ?, 0)", [sid, 40 * 1_000_000, big])
    t0 = time.perf_counter()
    hist = queries.latency_histogram(store.cursor(), "run", "itl")
    assert sum(b["count"] for b in hist) == 6 * 3 + big
    found = diagnose(store.cursor(), "run")
    store.refresh_derived()
    api = ReadAPI(store.reading, port=0, findings=lambda con, run: [f.id for f in diagnose(con, run)]).start()
    try:
        with urllib.request.urlopen(f"{api.url}/api/v1/findings?run_id=run", timeout=60) as r:
            assert json.load(r)["findings"] == [f.id for f in found]
        with urllib.request.urlopen(f"{api.url}/api/v1/query/latency_histogram?run_id=run&metric=itl",
                                    timeout=60) as r:
            assert sum(b["count"] for b in json.load(r)["rows"]) == 6 * 3 + big
    finally:
        api.stop()
        store.close()
    assert time.perf_counter() - t0 < 60  # expanding 2^31 rows took longer than any test may run


def _served_store(tmp_path, fold_every_s: float):
    """A store of run "run" holding 9 requests' events, and a read API over it (started)."""
    store = Store(str(tmp_path / "s.duckdb"))
    sid = store.register_source(Hello(1, 0, 1, 0, 1, "run", "m", "synthetic"))
    store.append([(sid, _events(9))])
    return store, sid, ReadAPI(store.reading, port=0, fold_every_s=fold_every_s).start()


def test_the_read_api_folds_new_events_in_before_it_reads(tmp_path):
    store, sid, api = _served_store(tmp_path, fold_every_s=0)
    try:
        with urllib.request.urlopen(f"{api.url}/api/v1/query/request_summary?run_id=run", timeout=60) as r:
            assert json.load(r)["rows"]["requests"] == 9
        con = store.cursor()
        assert derived.state(con)[1] == 9 * 6  # folded in by that read
        store.append([(sid, _events(3, t0_ms=2_000))])
        with urllib.request.urlopen(f"{api.url}/api/v1/query/request_summary?run_id=run", timeout=60) as r:
            assert json.load(r)["rows"]["requests"] == 12
        assert derived.state(con)[1] == 12 * 6
    finally:
        api.stop()
        store.close()


def test_the_read_api_folds_at_most_once_per_interval_and_reads_stay_exact(tmp_path):
    """A read within `fold_every_s` of the last fold does not fold (a fold is a write transaction: folding at every
    read kept a live dashboard page rendering), yet answers exactly: the views fold the rest in at read time."""
    store, sid, api = _served_store(tmp_path, fold_every_s=3600)
    try:
        url = f"{api.url}/api/v1/query/request_summary?run_id=run"
        with urllib.request.urlopen(url, timeout=60) as r:
            assert json.load(r)["rows"]["requests"] == 9
        con = store.cursor()
        assert derived.state(con)[1] == 9 * 6  # the first read folds
        store.append([(sid, _events(3, t0_ms=2_000))])
        with urllib.request.urlopen(url, timeout=60) as r:
            assert json.load(r)["rows"]["requests"] == 12  # exact, unfolded
        assert derived.state(con)[1] == 9 * 6  # within the interval: not folded
        api.fold_every_s = 0
        with urllib.request.urlopen(url, timeout=60) as r:
            assert json.load(r)["rows"]["requests"] == 12
        assert derived.state(con)[1] == 12 * 6
    finally:
        api.stop()
        store.close()
    with pytest.raises(ValueError, match="fold_every_s"):
        ReadAPI(store.reading, port=0, fold_every_s=-1)


# --- the steps kept with the gaps (ITL attribution) ----------------------------------------------------------

# the last two schedule asynchronously (GPU runs of vLLM 0.24): each end carries the larger prefill and time of its
# step and the one before (ATTRIBUTION_RULE 2), in the fold as at read time
ATTRIBUTION_FIXTURES = ["prefill-interference", "kv-pressure", "itl-spikes-vllm", "reused-ids", "telemetry-silent",
                        "prefill-interference-vllm-h200", "gpu/interference"]


def attribution(con, run: str, stored: bool) -> list:
    from phasescope.agent.read.base import async_scheduling
    from phasescope.agent.read.itl import ITL_GAPS, ITL_GAPS_ASYNC, STORED_GAPS

    gaps = ITL_GAPS_ASYNC if async_scheduling(con, run) else ITL_GAPS
    sql = STORED_GAPS if stored else f"WITH {gaps} SELECT * FROM gaps"
    rows = con.execute(f"SELECT request_id, ts_ns, tokens, steps_in_gap, step_ms, prefill_tokens, decode_tokens, cause "
                       f"FROM ({sql})", {"run": run, "long": 128, "host_ratio": 2.0}).fetchall()
    return sorted(rows, key=repr)


@pytest.mark.parametrize("order", ["shuffled", "by time"])
@pytest.mark.parametrize("name", ATTRIBUTION_FIXTURES)
def test_the_steps_kept_with_the_gaps_are_the_steps_joined_at_read_time(tmp_path, name, order):
    """Steps and events arriving in any order, folded in piecemeal: the gaps' stored steps (and so their causes)
    equal what joining every gap to every step gives, after every refresh."""
    path = str(tmp_path / "run.duckdb")
    run = load(os.path.join(DATA_DIR, name), path)
    con = duckdb.connect(path)
    want = attribution(con, run, stored=False)
    assert derived.attribution_current(con) and attribution(con, run, stored=True) == want
    steps = con.execute("SELECT * FROM steps").fetchall()
    events = con.execute("SELECT * FROM request_events").fetchall()
    rng = random.Random(name)
    rng.shuffle(steps)
    rng.shuffle(events)
    k = 5
    if order == "by time":  # as a live store gets them: in time order, steps and tokens in separate batches
        steps.sort(key=lambda r: r[1])
        events.sort(key=lambda r: r[1])
    con.execute("DELETE FROM steps")
    con.execute("DELETE FROM request_events")
    forget(con)
    con.execute("DELETE FROM derived_state")
    for i in range(k):
        part = (slice(i * len(steps) // k, (i + 1) * len(steps) // k), slice(i * len(events) // k, (i + 1) * len(events) // k)) \
            if order == "by time" else (slice(i, None, k), slice(i, None, k))
        con.executemany("INSERT INTO steps VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", steps[part[0]])
        con.executemany("INSERT INTO request_events VALUES (?, ?, ?, ?, ?, ?, ?)", events[part[1]])
        assert not derived.attribution_current(con)
        derived.refresh(con)
        assert derived.attribution_current(con)
        assert attribution(con, run, stored=True) == attribution(con, run, stored=False), f"after part {i + 1}"
    assert attribution(con, run, stored=True) == want
    con.close()


def test_gaps_tied_by_another_rule_are_tied_again(tmp_path):
    """A store whose gaps were tied to their steps by an earlier rule (ATTRIBUTION_RULE 1: each step's own shape, on
    a run scheduled asynchronously too) is not read as current, and its next refresh ties every gap again."""
    path = str(tmp_path / "run.duckdb")
    run = load(os.path.join(DATA_DIR, "gpu", "interference"), path)
    con = duckdb.connect(path)
    want = attribution(con, run, stored=False)
    assert derived.attribution_current(con) and attribution(con, run, stored=True) == want
    assert any(r[5] and r[5] >= 8000 for r in want)  # gaps tied to the 8000-token prefills
    con.execute("UPDATE token_gaps SET prefill_tokens = 0, step_ms = 0")  # what rule 1 may have left
    con.execute("UPDATE derived_state SET wm = 1 WHERE name = 'token_gaps'")
    assert not derived.attribution_current(con)
    derived.refresh(con)
    assert derived.attribution_current(con) and attribution(con, run, stored=True) == want
    assert con.execute("SELECT wm FROM derived_state WHERE name = 'token_gaps'").fetchone()[0] == \
        derived.ATTRIBUTION_RULE


@pytest.mark.parametrize("name", ["prefill-interference", "kv-pressure", "reused-ids"])
def test_a_retention_roll_keeps_requests_and_gaps_exact(tmp_path, name):
    """Steps and events older than a cutoff deleted (what a retention roll does), folded in: requests, gaps and
    their steps equal what the rows left give."""
    path = str(tmp_path / "run.duckdb")
    run = load(os.path.join(DATA_DIR, name), path)
    con = duckdb.connect(path)
    lo, hi = con.execute("SELECT min(t.ts_ns + s.wall_minus_mono_ns), max(t.ts_ns + s.wall_minus_mono_ns) "
                         "FROM steps t JOIN sources s USING (source_id)").fetchone()
    for frac in (0.2, 0.5):
        cut = lo + int((hi - lo) * frac)
        for t in ("steps", "request_events"):
            con.execute(f"DELETE FROM {t} WHERE source_id IN (SELECT source_id FROM sources) AND "
                        f"ts_ns + (SELECT wall_minus_mono_ns FROM sources s WHERE s.source_id = {t}.source_id) < ?",
                        [cut])
        derived.refresh(con)
        assert current(con) == reference(con), frac
        assert attribution(con, run, stored=True) == attribution(con, run, stored=False), frac
    con.close()


def test_a_store_from_before_the_derived_tables_reads_exactly(tmp_path):
    """A file written before issue 30 has no derived tables and today's views: the file reader derives the
    requests and gaps from its raw rows (temp views, read-only)."""
    from phasescope.agent.read.reader import open_reader

    path = str(tmp_path / "old.duckdb")
    load(os.path.join(DATA_DIR, "reused-ids"), path)
    con = duckdb.connect(path)
    want = reference(con)
    run = con.execute("SELECT run_id FROM sources LIMIT 1").fetchone()[0]
    want_summary = queries.request_summary(con, run)
    want_attr = queries.itl_attribution(con, run)
    for v in ("requests", "itl"):
        con.execute(f"DROP VIEW {v}")
    for t in derived.TABLES:
        con.execute(f"DROP TABLE {t}")
    for name, sql in VIEWS.items():
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {sql}")
    con.close()
    reader = open_reader(path)
    assert reader.query("request_summary", run_id=run) == want_summary
    got = reader.query("itl_attribution", run_id=run)
    assert {k: v for k, v in got.items() if k != "query"} == {k: v for k, v in want_attr.items() if k != "query"}
    assert reader._run(current) == want


def test_itl_runs_on_the_engine_stamps_ttft_on_the_receive_times(tmp_path):
    """Issue 27 item 3: a vLLM token event carries the EngineCore's output stamp as a lead (us) before its receive
    time: ITL gaps (stored, live and reference) are the engine's, TTFT and E2E stay the frontend's."""
    from phasescope.agent.probe.adapters.vllm import engine_lead_us
    from phasescope.exporters.requests import RequestTracker

    engine = [10_000_123, 20_000_456, 35_000_789]  # the engine's output stamps, ns
    received = [10_900_000, 20_200_001, 39_000_000]  # the frontend got them later, by uneven delays
    leads = [engine_lead_us(r, e) for r, e in zip(received, engine)]
    assert all(ts - 1000 * lead == e and 0 <= ts - r < 1000 for (lead, ts), r, e in zip(leads, received, engine))
    ev = [RequestEvent(0, 0, REQUEST_EVENTS.index("arrival"), "a", 16, 0)]
    ev += [RequestEvent(ts, 0, REQUEST_EVENTS.index("token"), "a", 1, lead) for lead, ts in leads]
    ev.append(RequestEvent(leads[-1][1], 0, REQUEST_EVENTS.index("finished"), "a", 3, 0))
    store = Store(str(tmp_path / "s.duckdb"))
    sid = store.register_source(Hello(1, 0, 1, 0, 1, "run", "m", "synthetic"))
    store.append([(sid, ev)])
    con = store.cursor()
    want = [(engine[1] - engine[0]) / 1e9, (engine[2] - engine[1]) / 1e9]
    for _ in range(2):  # derived at read time, then folded into the stored tables
        assert [r[0] for r in con.execute("SELECT itl_s FROM itl ORDER BY ts_ns").fetchall()] == want
        assert current(con) == reference(con)
        ttft, e2e, decode, tpot = con.execute("SELECT ttft_s, e2e_s, decode_s, tpot_s FROM requests").fetchone()
        assert (ttft, e2e) == (leads[0][1] / 1e9, leads[-1][1] / 1e9)
        assert (decode, tpot) == ((engine[2] - engine[0]) / 1e9, (engine[2] - engine[0]) / 1e9 / 2)  # vLLM's clock
        store.refresh_derived()
    store.close()
    gaps: list = []

    class Listener:
        def __getattr__(self, name):
            return lambda *a, **k: None

        def inter_token(self, source, gap_s, n):
            gaps.append(gap_s)

        def finished(self, timing):
            gaps.append(("decode", timing.decode_s, timing.tpot_s, timing.ttft_s))

    tracker = RequestTracker(Listener())
    from types import SimpleNamespace as NS

    for e in ev:
        tracker.on_event(1, NS(model="m"), e)
    assert gaps[:2] == pytest.approx(want, abs=1e-12)
    d = (engine[2] - engine[0]) / 1e9
    assert gaps[2] == ("decode", pytest.approx(d, abs=1e-12), pytest.approx(d / 2, abs=1e-12),
                       pytest.approx(leads[0][1] / 1e9, abs=1e-12))  # live exporter: the store's figures
