"""agent/sidecar/windows.py: one recorded run cut into time windows, each a run of its own (copied, labelled),
and cli/explain.py's guidellm report reader. Real DuckDB over the `queueing` scenario; no server."""

from __future__ import annotations

import json
import os

import duckdb
import pytest

from builders.scenarios import DATA_DIR, load
from phasescope.agent.sidecar.windows import split_run, window_runs


@pytest.fixture
def store(tmp_path):
    path = str(tmp_path / "run.duckdb")
    run = load(os.path.join(DATA_DIR, "queueing"), path)
    con = duckdb.connect(path)
    yield con, run
    con.close()


def _arrivals(con, run):
    return [r[0] for r in con.execute("""SELECT r.ts_ns + s.wall_minus_mono_ns FROM request_events r
        JOIN sources s USING (source_id) WHERE s.run_id = ? AND r.event = 'arrival' ORDER BY 1""", [run]).fetchall()]


def _count(con, table, run):
    return con.execute(f"SELECT count(*) FROM {table} x JOIN sources s USING (source_id) WHERE s.run_id = ?",
                       [run]).fetchone()[0]


def test_split_run_copies_each_window(store):
    con, run = store
    arr = _arrivals(con, run)
    assert len(arr) >= 4
    mid = arr[len(arr) // 2]
    before = {t: _count(con, t, run) for t in ("steps", "request_events", "kv_snapshots")}
    reqs_before = con.execute("SELECT count(*) FROM requests WHERE run_id = ?", [run]).fetchone()[0]
    new = split_run(con, run, [(arr[0], mid, "w0", {"sweep_point": 0}), (mid, arr[-1] + 1, "w1", {"sweep_point": 1})])
    assert new == ["w0", "w1"]
    # the source run is whole
    assert {t: _count(con, t, run) for t in before} == before
    # every request lands in exactly one window: the one its arrival falls in
    n = [con.execute("SELECT count(*) FROM requests WHERE run_id = ?", [w]).fetchone()[0] for w in new]
    assert n == [len([a for a in arr if a < mid]), len([a for a in arr if a >= mid])]
    assert sum(n) == reqs_before
    assert all(arr[0] <= a < mid for a in _arrivals(con, "w0"))
    # each window's requests keep their figures (TTFT of the copy == TTFT in the source run)
    src = dict(con.execute("SELECT request_id, ttft_s FROM requests WHERE run_id = ?", [run]).fetchall())
    for w in new:
        for rid, ttft in con.execute("SELECT request_id, ttft_s FROM requests WHERE run_id = ?", [w]).fetchall():
            assert ttft == src[rid]
    # steps: those of the window's span, no more
    lab = window_runs(con)
    assert set(lab) == {"w0", "w1"} and lab["w1"]["window_of"] == run and lab["w1"]["sweep_point"] == "1"
    end0 = int(lab["w0"]["window_end_ns"])
    raw = con.execute("""SELECT count(*) FROM steps t JOIN sources s USING (source_id) WHERE s.run_id = ?
        AND t.ts_ns + s.wall_minus_mono_ns BETWEEN ? AND ?""", [run, arr[0], end0]).fetchone()[0]
    assert _count(con, "steps", "w0") == raw > 0
    # the source run's own labels come along
    own = dict(con.execute("SELECT key, value FROM run_info WHERE run_id = ?", [run]).fetchall())
    assert all(lab["w0"][k] == v for k, v in own.items())


def test_split_run_refuses(store):
    con, run = store
    arr = _arrivals(con, run)
    with pytest.raises(ValueError, match="no run"):
        split_run(con, "nope", [(arr[0], arr[-1], "x", {})])
    with pytest.raises(ValueError, match="empty"):
        split_run(con, run, [(arr[-1], arr[0], "x", {})])
    split_run(con, run, [(arr[0], arr[-1] + 1, "x", {})])
    with pytest.raises(ValueError, match="exists"):
        split_run(con, run, [(arr[0], arr[-1] + 1, "x", {})])


def test_read_guidellm(tmp_path):
    from phasescope.cli.explain import read_guidellm

    rep = {"benchmarks": [
        {"config": {"strategy": {"type_": "constant", "rate": 2.0}}, "start_time": 100.5, "end_time": 104.0,
         "requests": {"successful": [{}] * 6, "errored": [{}], "incomplete": []}},
        {"config": {"strategy": {"type_": "synchronous"}}, "start_time": 110.0, "end_time": 114.0,
         "requests": {"successful": [{}] * 8, "errored": [], "incomplete": []}}]}
    p = tmp_path / "r.json"
    p.write_text(json.dumps(rep))
    pts = read_guidellm(str(p))
    assert [(x["rate_per_s"], x["start_ns"], x["end_ns"], x["successful"], x["not_successful"]) for x in pts] == \
        [(2.0, 100_500_000_000, 104_000_000_000, 6, 1), (2.0, 110_000_000_000, 114_000_000_000, 8, 0)]
    p.write_text("{}")
    with pytest.raises(ValueError, match="not a guidellm"):
        read_guidellm(str(p))


def test_requests_outside_every_window_are_said_not_dropped(store):
    """A request arriving between two benchmark windows, or after the last, is in no point: outside_windows
    names it with the benchmark it follows and how late; the points plus those hold every request."""
    from phasescope.cli.explain import outside_windows

    con, run = store
    arr = _arrivals(con, run)
    assert len(arr) >= 5 and len(set(arr)) == len(arr)
    # windows [arr0, arr1) and [arr2, arr4): arrival 1 falls in the gap, arrivals from 4 on after the last
    pts = [{"start_ns": arr[0], "end_ns": arr[1]}, {"start_ns": arr[2], "end_ns": arr[4]}]
    ow = outside_windows(con, run, pts)
    assert ow["requests"] == 1 + (len(arr) - 4)
    first = ow["rows"][0]
    assert first["after_benchmark"] == 0 and first["late_s"] == 0.0  # at the end instant: [start, end)
    assert ow["rows"][1]["after_benchmark"] == 1 and ow["rows"][1]["late_s"] == 0.0
    split_run(con, run, [(p["start_ns"], p["end_ns"], f"w{i}", {}) for i, p in enumerate(pts)])
    n = sum(con.execute("SELECT count(*) FROM requests WHERE run_id = ?", [w]).fetchone()[0] for w in ("w0", "w1"))
    total = con.execute("SELECT count(*) FROM requests WHERE run_id = ?", [run]).fetchone()[0]
    assert n + ow["requests"] == total
    # a request before the first window: a negative figure from benchmark 0's start
    ow = outside_windows(con, run, [{"start_ns": arr[1], "end_ns": arr[-1] + 1}])
    assert ow["requests"] == 1 and ow["rows"][0]["after_benchmark"] == -1 and ow["rows"][0]["late_s"] < 0
