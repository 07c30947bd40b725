"""A run whose raw rows retention rolled out reads as one history: from the store and its Parquet exports
(the same findings and summary as before the roll); when the exports are not there, a finding says where
they went instead of an empty, healthy-looking report."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from builders import synthetic
from phasescope.agent.sidecar.retention import DAY_S, Retention, RetentionPolicy
from phasescope.agent.sidecar.store import Store
from phasescope.cli.main import main

NS = 1_000_000_000


def _cli(argv, capsys) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _findings(path: str, capsys) -> dict[str, str]:
    return {f["id"]: f["severity"] for f in _cli(["diagnose", path, "--json"], capsys)["findings"]}


def _roll(path: str, export_dir: str | None) -> dict[str, int]:
    store = Store(path)
    try:
        later = time.time_ns() + int(10 * DAY_S * NS)  # ten days on: every row is past the 7-day age
        r = Retention(store, RetentionPolicy(export_dir=export_dir, host="h1"), clock_ns=lambda: later).roll()
    finally:
        store.close()
    return r.rows_rolled


@pytest.fixture
def rolled(tmp_path):
    path = str(tmp_path / "run.duckdb")
    synthetic.overload(path)  # survival-rate-low and probe-dropping, both critical
    return path


def test_a_rolled_run_reads_as_before_from_its_exports(rolled, tmp_path, capsys):
    before = _findings(rolled, capsys)
    summary_before = _cli(["summary", rolled, "--json"], capsys)
    assert before == {"survival-rate-low": "critical", "probe-dropping": "critical"}
    rows = _roll(rolled, str(tmp_path / "exports"))
    assert rows["request_events"] > 0 and rows["probe_health"] > 0
    assert _findings(rolled, capsys) == before
    summary_after = _cli(["summary", rolled, "--json"], capsys)
    assert summary_after["requests"] == summary_before["requests"]
    assert summary_after["probe"] == summary_before["probe"]


def test_exports_not_here_are_named_not_a_green_report(rolled, tmp_path, capsys):
    exports = str(tmp_path / "exports")
    _roll(rolled, exports)
    shutil.move(exports, str(tmp_path / "elsewhere"))
    out = _cli(["diagnose", rolled, "--json"], capsys)["findings"]
    f = next(x for x in out if x["id"] == "history-rolled")
    assert f["severity"] == "warning" and f["evidence"]["export_dir"] == os.path.abspath(exports)
    assert f["evidence"]["rolled_request_events"] == 100 * 3 + 90 * 2 + 6  # every event of the 100 requests
    assert f"phasescope diagnose {os.path.abspath(exports)}" in f["suggestion"]


def test_a_roll_without_export_is_critical_and_says_so(rolled, capsys):
    _roll(rolled, None)
    out = {f["id"]: f for f in _cli(["diagnose", rolled, "--json"], capsys)["findings"]}
    assert set(out) == {"history-rolled"}
    assert out["history-rolled"]["severity"] == "critical"
    assert "without --export-dir" in out["history-rolled"]["suggestion"]


def test_readers_say_what_they_read(rolled, tmp_path, capsys):
    exports = str(tmp_path / "exports")
    assert _cli(["summary", rolled, "--json"], capsys)["read"] == f"read {rolled}: phasescope store, schema version 1"
    _roll(rolled, exports)
    read = _cli(["diagnose", rolled, "--json"], capsys)["read"]
    assert read == (f"read {rolled}: phasescope store, schema version 1, with the rows retention rolled out, from "
                    f"{os.path.abspath(exports)}/host=h1")
    shutil.rmtree(exports)
    assert _cli(["summary", rolled, "--json"], capsys)["read"].endswith(
        f"rows retention rolled out to {os.path.abspath(exports)} are not here")


def test_the_finding_survives_a_snapshot(rolled, tmp_path):
    """Inside one read transaction (the dashboard's snapshot) too: a probing query that failed aborted the
    transaction and the finding was lost, so the page said 'No findings' (seen in the browser test)."""
    from phasescope.agent.read.reader import open_reader
    from phasescope.analyzers.diagnose import diagnose

    _roll(rolled, None)
    reader = open_reader(rolled, findings=diagnose)
    snap = reader.snapshot([("request_summary", {})], findings_run="")
    assert [f["id"] for f in snap["findings"]] == ["history-rolled"]


def test_a_partly_rolled_run_reads_its_requests_gaps_and_steps_as_before(tmp_path):
    """Half of a recorded run rolled out to Parquet: read back as one history, its request rows, ITL gaps and
    the step reads (the derived tables and the step rollup are the store's rows alone, so the history derives
    them again from the whole history's raw rows) are those of the store before the roll."""
    import duckdb

    from builders.scenarios import DATA_DIR, load
    from phasescope.agent.read import queries
    from phasescope.agent.read.reader import connect_readonly

    path = str(tmp_path / "run.duckdb")
    run = load(os.path.join(DATA_DIR, "itl-spikes-vllm"), path)
    reads = [("request_summary", {}), ("latency_histogram", {"metric": "itl"}), ("itl_attribution", {}),
             ("phase_summary", {}), ("step_timeline", {"bucket_s": 1.0}), ("interference", {}), ("run_span", {})]

    def read(con):
        rq = sorted(con.execute("SELECT * FROM requests").fetchall(), key=repr)
        itl = sorted(con.execute("SELECT run_id, request_id, ts_ns, prev_ns, tokens, itl_s FROM itl").fetchall(),
                     key=repr)
        return rq, itl, [queries.QUERIES[n](con, run, **kw) for n, kw in reads]

    con = duckdb.connect(path, read_only=True)
    before = read(con)
    lo, hi, events = con.execute("SELECT min(r.ts_ns + s.wall_minus_mono_ns), max(r.ts_ns + s.wall_minus_mono_ns), "
                                 "count(*) FROM request_events r JOIN sources s USING (source_id)").fetchone()
    con.close()
    assert before[0] and before[1]
    cut = (lo + hi) // 2
    store = Store(path)
    try:
        r = Retention(store, RetentionPolicy(max_age_s=DAY_S, export_dir=str(tmp_path / "exports"), host="h1"),
                      clock_ns=lambda: cut + int(DAY_S * NS)).roll()
    finally:
        store.close()
    assert 0 < r.rows_rolled["request_events"] < events and r.rows_rolled["steps"] > 0  # a part of it
    con = connect_readonly(path)  # the store and its exports, one history
    try:
        assert con.execute("SELECT count(*) FROM phasescope_read_from WHERE source = 'exports'").fetchone()[0] == 1
        after = read(con)
        assert after[0] == before[0] and after[1] == before[1]
        for (name, _), a, b in zip(reads, after[2], before[2]):
            assert a == b, name
        # the step rollup holds the store's rows only: the history's approximate reads are the exact ones
        assert queries.phase_summary(con, run, quantiles="approx") == before[2][3]
    finally:
        con.close()
