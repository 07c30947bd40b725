"""cli/reports.py (a load generator's report read into load points) and cli/explain.py's window checks: the
committed vLLM sample (tests/agent/reports/README.md says how it was made) and small hand-made files; the
client-clock refinement over the `queueing` scenario's store. No server."""

from __future__ import annotations

import json
import pathlib
import time

import pytest

from test_windows import store  # noqa: F401 (a fixture: the queueing scenario loaded, (connection, run))
from phasescope.cli.reports import VLLM_DATE_SLACK_S, detect_kind, read_aiperf, read_report, read_vllm

SAMPLE = pathlib.Path(__file__).resolve().parent / "reports" / "vllm-0.32-bench-serve.jsonl"
AIPERF = pathlib.Path(__file__).resolve().parent / "reports" / "aiperf-0.13"  # a --request-rate 2,8 sweep


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
    assert detect_kind(str(AIPERF / "rate_2.0" / "profile_export_aiperf.json")) == "aiperf"
    assert detect_kind(str(SAMPLE)) == "vllm"
    for text in ("not json", "{}", json.dumps([{"date": "x"}]), ""):
        g.write_text(text)
        with pytest.raises(ValueError, match="not a report explain reads.*guidellm.*vLLM.*AIPerf"):
            detect_kind(str(g))
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(ValueError, match="no vLLM"):
        detect_kind(str(tmp_path / "empty-dir"))
    g.write_text(json.dumps(dict(_raw()[0], date="yesterday")))
    with pytest.raises(ValueError, match="date, duration or completed"):
        read_report(str(g))
    with pytest.raises(ValueError, match="not a guidellm"):
        read_report(str(g), "guidellm")


def _records(run_dir):
    return [json.loads(line) for line in open(run_dir / "profile_export.jsonl") if line.strip()]


def test_aiperf_sample_points(utc, tmp_path):
    """One point per run folder: its phase's rate, AIPerf's valid / error counts, the records' span as window;
    a summary given alone reads the same run; without records, the summary's local start/end times."""
    import shutil

    kind, pts = read_report(str(AIPERF))
    assert kind == "aiperf" and [p["rate_per_s"] for p in pts] == [2.0, 8.0]
    for p, d in zip(pts, ("rate_2.0", "rate_8.0")):
        recs = _records(AIPERF / d)
        summ = json.load(open(AIPERF / d / "profile_export_aiperf.json"))
        assert (p["successful"], p["not_successful"]) == \
            (summ["request_count"]["avg"], summ["error_request_count"]["avg"])
        assert p["successful"] + p["not_successful"] == len(recs) == 10
        assert p["not_successful"] == sum(r.get("error") is not None for r in recs)
        assert p["start_ns"] == min(r["metadata"]["request_start_ns"] for r in recs)
        assert p["end_ns"] == max(r["metadata"]["request_end_ns"] for r in recs) + 1
        assert p["window"] == "records" and p["strategy"] == "poisson"
    assert pts[0]["end_ns"] < pts[1]["start_ns"]
    assert read_aiperf(str(AIPERF / "rate_8.0" / "profile_export_aiperf.json"))[0]["start_ns"] == pts[1]["start_ns"]
    # no records (--export-level summary): the summary's start / end, local time to the microsecond
    shutil.copy(AIPERF / "rate_2.0" / "profile_export_aiperf.json", tmp_path / "profile_export_aiperf.json")
    (p,) = read_aiperf(str(tmp_path))
    summ = json.load(open(tmp_path / "profile_export_aiperf.json"))
    assert p["window"] == "summary" and p["start_ns"] == int(time.mktime(time.strptime(
        summ["start_time"][:19], "%Y-%m-%dT%H:%M:%S"))) * 10**9 + int(summ["start_time"][20:]) * 1000
    assert p["start_ns"] <= pts[0]["start_ns"] and pts[0]["end_ns"] <= p["end_ns"] + 1000  # holds the records
    # a concurrency run has no rate: what it achieved, records / window
    summ["input_config"]["phases"][0].update(rate=None, type="concurrency", concurrency=4)
    (tmp_path / "profile_export_aiperf.json").write_text(json.dumps(summ))
    shutil.copy(AIPERF / "rate_2.0" / "profile_export.jsonl", tmp_path / "profile_export.jsonl")
    (p,) = read_aiperf(str(tmp_path))
    assert p["rate_per_s"] == pytest.approx(10 / ((pts[0]["end_ns"] - pts[0]["start_ns"]) / 1e9))
    assert p["strategy"] == "concurrency, concurrency=4" and p["streams"] == 4




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
