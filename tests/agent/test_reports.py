"""cli/reports.py (a load generator's report read into load points) and cli/explain.py's window checks: the
committed vLLM sample (tests/agent/reports/README.md says how it was made) and small hand-made files; the
client-clock refinement over the `queueing` scenario's store. No server."""

from __future__ import annotations

import json
import os
import pathlib
import time

import duckdb
import pytest

from builders.scenarios import DATA_DIR, load
from phasescope.cli.reports import VLLM_DATE_SLACK_S, detect_kind, read_report, read_vllm

SAMPLE = pathlib.Path(__file__).resolve().parent / "reports" / "vllm-0.32-bench-serve.jsonl"


@pytest.fixture
def utc(monkeypatch):
    """This process in UTC (vLLM's `date` is local time; the sample was written on a UTC machine)."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _raw(path=SAMPLE):
    return [json.loads(line) for line in open(path) if line.strip()]


def _unix(date: str) -> float:
    return time.mktime(time.strptime(date, "%Y%m%d-%H%M%S"))


def test_vllm_sample_points(utc):
    """Each --append-result line is a point: its rate, counts and `date` window (to the second, widened), and the
    client's span from start_times + latencies."""
    raw = _raw()
    assert len(raw) >= 2
    kind, pts = read_report(str(SAMPLE))
    assert kind == "vllm" and len(pts) == len(raw)
    for p, r in zip(pts, sorted(raw, key=lambda r: _unix(r["date"]) - r["duration"])):
        assert p["rate_per_s"] == float(r["request_rate"]) and p["strategy"] == "poisson"
        assert (p["successful"], p["not_successful"]) == (r["completed"], r["failed"])
        end = _unix(r["date"])
        assert p["end_ns"] == int((end + 1) * 1e9)
        assert p["start_ns"] == int((end - r["duration"] - VLLM_DATE_SLACK_S) * 1e9)
        lo = min(r["start_times"])
        hi = max(s + x for s, x in zip(r["start_times"], r["latencies"]))
        assert p["client_mono_ns"] == [int(lo * 1e9), int(hi * 1e9)] and p["window"] == "date"
    assert [p["benchmark"] for p in pts] == list(range(len(pts)))
    assert pts[0]["end_ns"] <= pts[1]["start_ns"]


def test_vllm_date_is_local_time(utc, monkeypatch):
    """The same file read in UTC+2 maps to windows two hours earlier (Unix time)."""
    a = read_vllm(str(SAMPLE))
    monkeypatch.setenv("TZ", "EET-2")
    time.tzset()
    b = read_vllm(str(SAMPLE))
    assert [x["start_ns"] - y["start_ns"] for x, y in zip(a, b)] == [7200 * 10**9] * len(a)


def test_vllm_shapes(utc, tmp_path):
    """A single --save-result file, a sweep's summary.json list and a sweep folder read the same results; an
    `inf` rate is the achieved one; a result without --save-detailed has no client span."""
    raw = _raw()
    plain = {k: v for k, v in raw[1].items() if k not in ("start_times", "latencies", "ttfts", "itls")}
    one = tmp_path / "one.json"
    one.write_text(json.dumps(plain))
    (p,) = read_vllm(str(one))
    assert "client_mono_ns" not in p and p["rate_per_s"] == float(raw[1]["request_rate"])
    lst = tmp_path / "list.json"
    lst.write_text(json.dumps(raw))
    assert [x["start_ns"] for x in read_vllm(str(lst))] == [x["start_ns"] for x in read_vllm(str(SAMPLE))]
    folder = tmp_path / "exp"
    for i, r in enumerate(raw):
        d = folder / f"BENCH-request_rate={r['request_rate']}"
        d.mkdir(parents=True)
        (d / "run=0.json").write_text(json.dumps(r))
        (d / "summary.json").write_text(json.dumps([r]))  # repeats run=0.json: left out
        (d / "warmup.json").write_text(json.dumps(r))  # not a point
    assert detect_kind(str(folder)) == "vllm"
    assert [x["start_ns"] for x in read_vllm(str(folder))] == [x["start_ns"] for x in read_vllm(str(SAMPLE))]
    inf = dict(plain, request_rate="inf", max_concurrency=4)
    one.write_text(json.dumps(inf))
    (p,) = read_vllm(str(one))
    assert p["rate_per_s"] == pytest.approx(inf["completed"] / inf["duration"])
    assert p["strategy"] == "poisson, max_concurrency=4" and p["streams"] == 4


def test_detect_kind_and_refusals(tmp_path):
    g = tmp_path / "g.json"
    g.write_text(json.dumps({"benchmarks": []}))
    assert detect_kind(str(g)) == "guidellm"
    for text in ("not json", "{}", json.dumps([{"date": "x"}]), ""):
        g.write_text(text)
        with pytest.raises(ValueError, match="not a report explain reads.*guidellm.*vLLM"):
            detect_kind(str(g))
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(ValueError, match="no vLLM"):
        detect_kind(str(tmp_path / "empty-dir"))
    g.write_text(json.dumps(dict(_raw()[0], date="yesterday")))
    with pytest.raises(ValueError, match="date, duration or completed"):
        read_report(str(g))
    with pytest.raises(ValueError, match="not a guidellm"):
        read_report(str(g), "guidellm")


@pytest.fixture
def store(tmp_path):
    path = str(tmp_path / "run.duckdb")
    run = load(os.path.join(DATA_DIR, "queueing"), path)
    con = duckdb.connect(path)
    yield con, run
    con.close()


def test_refine_windows_same_clock_only(store):
    """A client span on the store's host clock (inside its date window) becomes the window; one on another
    host's clock (hours off) leaves the date window and says why; overlapping windows are refused."""
    from phasescope.cli.explain import check_windows, refine_windows

    con, run = store
    (off,) = con.execute("SELECT DISTINCT wall_minus_mono_ns FROM sources WHERE run_id = ? AND runtime != "
                         "'sidecar'", [run]).fetchone()
    a, b = con.execute("""SELECT min(r.ts_ns), max(r.ts_ns) FROM request_events r JOIN sources s USING (source_id)
        WHERE s.run_id = ?""", [run]).fetchone()
    sec = 10**9
    same = {"benchmark": 0, "start_ns": a + off - sec, "end_ns": b + off + sec, "window": "date",
            "client_mono_ns": [a, b]}
    other = {"benchmark": 1, "start_ns": b + off + 5 * sec, "end_ns": b + off + 9 * sec, "window": "date",
             "client_mono_ns": [a - 3600 * sec, a - 3590 * sec]}
    refine_windows(con, run, [same, other])
    assert (same["start_ns"], same["end_ns"], same["window"]) == (a + off, b + off + 1, "client-clock")
    assert other["window"] == "date" and "another host" in other["window_note"]
    check_windows("r", [same, other])
    other["start_ns"] = same["end_ns"] - 1
    with pytest.raises(ValueError, match="overlap"):
        check_windows("r", [same, other])
