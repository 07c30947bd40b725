"""Bounded storage: a 3-day simulated run under a small size cap keeps the newest rows, the
per-minute rollups and the Parquet exports, loses no row and duplicates none, also while a
live sidecar ingests during the roll and across a crash between commit and publish."""

from __future__ import annotations

import glob
import os
import time

import duckdb
import pytest

from phasescope.agent.records.events import PHASE_DECODE, PHASE_PREFILL, REQ_ARRIVAL, REQ_FINISHED, Hello, RequestEvent, Step
from phasescope.agent.sidecar.retention import Retention, RetentionPolicy, used_bytes
from phasescope.agent.sidecar.store import Store
from hang import HANG_S

NS = 1_000_000_000
DAY = 86_400 * NS
T0 = 1_767_225_600 * NS  # 2026-01-01 00:00 UTC: the simulated run's wall-clock start
STEP_EVERY = NS // 4  # 345,600 steps a day: several DuckDB row groups, as at real scale
HOUR = 3600 * NS


def simulate(db: str, export_dir: str, host: str, *, days: int = 3, decode_ms: float = 20.0,
             max_bytes: int = 4 << 20, step_every: int = STEP_EVERY) -> tuple[Store, Retention, list]:
    """A step every `step_every` ns (every 15th a 512-token prefill starting a request that
    finishes 30 s later) for `days` days, appended and rolled hourly (age 1 day, size cap
    `max_bytes`). Returns the open store, its retention and every roll result."""
    now = [T0]
    store = Store(db)
    ret = Retention(store, RetentionPolicy(max_age_s=86_400, max_bytes=max_bytes, export_dir=export_dir, host=host),
                    clock_ns=lambda: now[0])
    sid = store.register_source(Hello(0, T0, 4242, 0, 1, f"run-{host}", "sim", "synthetic"))
    rolls, step = [], 0
    for hour in range(days * 24):
        recs: list = []
        for i in range(HOUR // step_every):
            ts = hour * HOUR + i * step_every
            phase = PHASE_PREFILL if i % 15 == 0 else PHASE_DECODE
            recs.append(Step(ts, step, 0, phase, 4, 512 if phase == PHASE_PREFILL else 0,
                             0 if phase == PHASE_PREFILL else 4, 1000 + i, 40.0 if phase == PHASE_PREFILL else decode_ms,
                             float("nan")))
            step += 1
            if i % 15 == 0:
                rid = f"r{hour}-{i}"
                recs.append(RequestEvent(ts, 0, REQ_ARRIVAL, rid, 512, 0))
                recs.append(RequestEvent(ts + 30 * NS, 0, REQ_FINISHED, rid, 16, 0))
        store.append([(sid, recs)])
        now[0] = T0 + (hour + 1) * HOUR
        rolls.append(ret.roll())
    return store, ret, rolls


def _exported(export_dir: str, table: str, select: str = "count(*)", where: str = "true") -> list[tuple]:
    """Rows of `SELECT select` over the exported Parquet files of `table`."""
    pattern = os.path.join(export_dir, "host=*", "date=*", f"table={table}", "*.parquet")
    con = duckdb.connect()
    try:
        return con.execute(f"SELECT {select} FROM read_parquet('{pattern}', hive_partitioning = true) "
                           f"WHERE {where}").fetchall()
    finally:
        con.close()


@pytest.mark.slow
def test_three_days_under_a_size_cap(tmp_path):
    exp = str(tmp_path / "exports")
    store, ret, rolls = simulate(str(tmp_path / "a.duckdb"), exp, "a")
    total = 3 * 24 * (HOUR // STEP_EVERY)
    con = store.cursor()
    kept = [r[0] for r in con.execute("SELECT step_id FROM steps ORDER BY step_id").fetchall()]
    exported = [r[0] for r in _exported(exp, "steps", "step_id")]
    # nothing lost, nothing twice; the store keeps the newest rows, the exports the oldest
    assert sorted(kept + exported) == list(range(total))
    assert kept and exported and min(kept) == max(exported) + 1
    assert max(kept) == total - 1
    # the age rule alone would keep a day; the size cap made the rolls drop more
    assert "size" in {r.reason for r in rolls}
    assert len(kept) < DAY // STEP_EVERY
    for r in rolls:
        assert r.used_bytes_after <= ret.policy.max_bytes, r
    assert used_bytes(con) <= ret.policy.max_bytes
    assert os.path.getsize(tmp_path / "a.duckdb") <= 1.5 * ret.policy.max_bytes
    # rollups: every exported step counted once, by UTC minute, on both older days
    n, steps, days = con.execute("SELECT count(*), sum(steps), count(DISTINCT minute::DATE) FROM rollup_steps_1m").fetchone()
    assert steps == len(exported) and days >= 2 and n >= 60 * 24
    per_min = con.execute("SELECT max(s) FROM (SELECT sum(steps) AS s FROM rollup_steps_1m GROUP BY minute)").fetchone()[0]
    assert per_min == 60 * NS // STEP_EVERY
    ev = con.execute("SELECT sum(events) FROM rollup_request_events_1m").fetchone()[0]
    assert ev == _exported(exp, "request_events")[0][0]
    # exports: hive layout host=/date=/table=, one folder per UTC day rolled, sources beside them
    dates = sorted({r[0].isoformat() for r in _exported(exp, "steps", "DISTINCT date")})
    assert dates[:2] == ["2026-01-01", "2026-01-02"]
    assert glob.glob(os.path.join(exp, "host=a", "date=*", "table=sources", "*.parquet"))
    assert not glob.glob(os.path.join(exp, ".staging-*"))
    con.close()
    store.close()


def test_rollups_expire_into_the_exports(tmp_path):
    exp = str(tmp_path / "exports")
    store, ret, rolls = simulate(str(tmp_path / "a.duckdb"), exp, "a", days=2, max_bytes=1 << 30, step_every=10 * NS)
    assert {r.reason for r in rolls} == {"", "age"}  # no size pressure: exactly the last day is kept
    con = store.cursor()
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == DAY // (10 * NS)
    before = con.execute("SELECT sum(steps) FROM rollup_steps_1m").fetchone()[0]
    short = Retention(store, RetentionPolicy(max_age_s=86_400, rollup_max_age_s=3600, export_dir=exp, host="a"),
                      clock_ns=lambda: T0 + 2 * DAY)
    r = short.roll()
    assert r.rows_rolled["rollup_steps_1m"] > 0
    left = con.execute("SELECT coalesce(sum(steps), 0) FROM rollup_steps_1m").fetchone()[0]
    gone = _exported(exp, "rollup_steps_1m", "sum(steps)")[0][0]
    assert left + gone == before
    con.close()
    store.close()


def test_a_crash_between_commit_and_publish_loses_nothing(tmp_path, monkeypatch):
    exp = str(tmp_path / "exports")
    store, ret, _ = simulate(str(tmp_path / "a.duckdb"), exp, "a", days=1, max_bytes=1 << 30, step_every=10 * NS)
    con = store.cursor()
    in_store = con.execute("SELECT count(*) FROM steps").fetchone()[0]
    ret._clock_ns = lambda: T0 + 3 * DAY  # everything is now older than a day

    def crash(self, con, staging):
        raise KeyboardInterrupt("simulated crash after the commit")

    monkeypatch.setattr(Retention, "_publish", crash)
    with pytest.raises(KeyboardInterrupt):
        ret.roll()
    monkeypatch.undo()
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 0
    assert glob.glob(os.path.join(exp, ".staging-*"))
    Retention(store, ret.policy)  # a restarted agent recovers the committed staging folder
    assert not glob.glob(os.path.join(exp, ".staging-*"))
    assert _exported(exp, "steps")[0][0] == in_store
    con.close()
    store.close()


def test_rows_acknowledged_during_a_roll_are_kept(short_tmp):
    """A live sidecar ingests from a probe while retention rolls every 50 ms with a clock
    10 days ahead (so every committed row is due): each step ends up exactly once, in the
    store or in the exports."""
    torch = pytest.importorskip("torch")
    from phasescope.agent.probe import attach
    from phasescope.agent.sidecar import Sidecar

    exp = os.path.join(short_tmp, "exports")
    sc = Sidecar(os.path.join(short_tmp, "s.duckdb"), listen=[f"unix:{short_tmp}/a.sock"], batch_interval_s=0.02).start()
    ret = Retention(sc.store, RetentionPolicy(max_age_s=86_400, export_dir=exp, host="live"),
                    clock_ns=lambda: time.time_ns() + 10 * DAY).start(interval_s=0.05)
    model = torch.nn.Linear(4, 4)
    probe = attach(model, agent=f"unix:{short_tmp}/a.sock", run_id="live", flush_interval_s=0.01)
    n = 0  # at least 3000 steps, and on until retention has rolled 4 times under ingest (a loaded machine rolls
    with torch.no_grad():  # fewer times per step: the step count follows the rolls, not a fixed count)
        while n < 3000 or (ret.rolls_total <= 3 and n < 60_000):
            model(torch.zeros(1, 4))
            if n % 300 == 0:
                time.sleep(0.05)
            n += 1
    assert probe.flush(HANG_S)
    probe.close()
    assert sc.wait_rows(sc.drained, HANG_S)
    time.sleep(0.3)
    ret.stop()
    assert ret.errors_total == 0 and ret.rolls_total > 3
    con = sc.store.cursor()
    kept = [r[0] for r in con.execute("SELECT step_id FROM steps t JOIN sources s USING (source_id) "
                                       "WHERE s.run_id = 'live'").fetchall()]
    con.close()
    sc.stop()
    exported = [r[0] for r in _exported(exp, "steps", "step_id", "source_id > 0")]
    assert len(exported) > 0
    assert sorted(kept + exported) == list(range(n))


def test_reads_right_after_a_roll(tmp_path):
    """A roll deletes the oldest request events and steps below the derived tables' watermarks; it folds the
    deletion in before its commit, so the very next read (no refresh between) works and is what the raw rows
    left give (tests/reference_sql.py): before, the views raised until the next fold."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from reference_sql import VIEWS
    from phasescope.agent.records.events import REQ_SCHEDULED, REQ_TOKEN

    now = [T0]
    store = Store(str(tmp_path / "r.duckdb"))
    ret = Retention(store, RetentionPolicy(max_age_s=3600, max_bytes=1 << 40, export_dir=None, host="h"),
                    clock_ns=lambda: now[0])
    sid = store.register_source(Hello(0, T0, 4242, 0, 1, "run-r", "sim", "synthetic"))
    recs: list = []
    for i in range(3 * 60):  # a request a minute for 3 hours, 8 tokens 0.5 s apart
        ts = i * 60 * NS
        rid = f"q{i % 7}"  # ids reused: the arrival numbering must survive the roll
        recs += [RequestEvent(ts, 0, REQ_ARRIVAL, rid, 100, 0), RequestEvent(ts + NS // 10, 0, REQ_SCHEDULED, rid, 0, 0)]
        recs += [RequestEvent(ts + NS + k * NS // 2, 0, REQ_TOKEN, rid, 1 + k % 2, 0) for k in range(8)]
        recs.append(RequestEvent(ts + 5 * NS, 0, REQ_FINISHED, rid, 12, 0))
        recs += [Step(ts + k * NS, i * 10 + k, 0, PHASE_DECODE, 1, 0, 1, 100, 20.0, float("nan")) for k in range(10)]
    store.append([(sid, recs)])
    store.refresh_derived()
    with store.reading() as con:
        assert con.execute("SELECT count(*) FROM requests").fetchone()[0] == 180
    now[0] = T0 + 3 * HOUR + 30 * 60 * NS  # age cut at 2.5 h: the first 150 requests go
    assert ret.roll().rows_rolled["request_events"] > 0
    with store.reading() as con:  # no refresh in between
        got = sorted(con.execute("SELECT * FROM requests").fetchall(), key=repr)
        log, rq, itl = (f"({VIEWS[v]})" for v in ("request_log", "requests", "itl"))
        want = sorted(con.execute(f"WITH request_log AS {log}, r AS {rq} SELECT * FROM r").fetchall(), key=repr)
        assert got == want and len(got) == 30
        got_itl = con.execute("SELECT count(*), sum(tokens), sum(itl_s * tokens) FROM itl").fetchone()
        want_itl = con.execute(f"WITH request_log AS {log}, i AS {itl} SELECT count(*), count(*), sum(itl_s) FROM i"
                               ).fetchone()
        assert got_itl[1] == want_itl[1] and got_itl[2] == pytest.approx(want_itl[2], rel=1e-12)
        assert con.execute("SELECT sum(steps) FROM step_rollup").fetchone()[0] == \
            con.execute("SELECT count(*) FROM steps").fetchone()[0] == 300
    store.close()
