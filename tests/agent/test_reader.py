"""Live and offline reads: the read API of a running sidecar and a file reader give the same answers."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest

from phasescope.agent.records import events as ev
from phasescope.agent.read.reader import AgentReader, FileReader, StoreBusyError, open_reader
from phasescope.agent.sidecar import Sidecar


def _records():
    hello = ev.Hello(0, 0, 1, 0, 1, "run-r", "m", "hf-cb")
    steps = [ev.Step(i * 10_000_000, i, 0, ev.PHASE_PREFILL if i == 0 else ev.PHASE_DECODE, 2, 64 if i == 0 else 0,
                     0 if i == 0 else 2, 0 if i == 0 else 64 + 2 * i, 5.0 + i, float("nan")) for i in range(10)]
    reqs = []
    for r in ("a", "b"):
        reqs += [ev.RequestEvent(0, 0, ev.REQ_ARRIVAL, r, 32, 0), ev.RequestEvent(1_000_000, 0, ev.REQ_SCHEDULED, r, 0, 0)]
        reqs += [ev.RequestEvent(10_000_000 * (k + 1), 0, ev.REQ_TOKEN, r, 1, 0) for k in range(9)]
        reqs.append(ev.RequestEvent(90_000_000, 0, ev.REQ_FINISHED, r, 9, 0))
    return [hello] + steps + reqs


def test_live_reads_through_the_sidecar_match_the_file_afterwards(short_tmp):
    db = os.path.join(short_tmp, "live.duckdb")
    sc = Sidecar(db, listen=[f"unix:{short_tmp}/a.sock"], batch_interval_s=0.05, read_api="127.0.0.1:0").start()
    try:
        import socket

        s = socket.socket(socket.AF_UNIX)
        s.connect(f"{short_tmp}/a.sock")
        s.sendall(ev.encode_frame(_records()))
        s.close()
        assert sc.wait_rows(lambda: sc.stats.rows_written_total == 10 + 24)
        with pytest.raises(StoreBusyError, match="read API"):
            FileReader(db)  # the agent holds the file: offline readers are refused with a pointer
        live = open_reader(sc.read_api.url)
        assert isinstance(live, AgentReader)
        live_req = live.query("request_summary", run_id="run-r")
        live_phases = live.query("phase_summary", run_id="run-r")
        assert live.query("runs")[0]["run_id"] == "run-r"
        timeline = live.query("step_timeline", run_id="run-r", bucket_s=0.05)
        assert sum(r["steps"] for r in timeline) == 10
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(sc.read_api.url + "/api/v1/query/drop_tables")
        assert e.value.code == 404
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(sc.read_api.url + "/api/v1/query/runs?sql=select+1")
        assert e.value.code == 400
        health = json.load(urllib.request.urlopen(sc.read_api.url + "/api/v1/health"))
        assert health["records_total"] == 34 + 1  # and the Hello
    finally:
        sc.stop()
    offline = open_reader(db)
    try:
        assert offline.query("request_summary", run_id="run-r") == live_req
        assert offline.query("phase_summary", run_id="run-r") == live_phases
    finally:
        offline.close()
    assert live_req["requests"] == 2 and live_req["ttft_p50_s"] == pytest.approx(0.01)
    assert live_req["tpot_p50_s"] == pytest.approx(0.01)


def test_diagnose_summary_compare_read_a_live_agent(short_tmp, capsys):
    """`--agent URL` goes through the read API (never DuckDB's httpfs) and equals the file afterwards."""
    from phasescope.cli.main import main
    from phasescope.analyzers.diagnose import diagnose

    db = os.path.join(short_tmp, "agent.duckdb")
    sc = Sidecar(db, listen=[f"unix:{short_tmp}/b.sock"], batch_interval_s=0.05, read_api="127.0.0.1:0",
                 findings=diagnose).start()
    try:
        import socket

        s = socket.socket(socket.AF_UNIX)
        s.connect(f"{short_tmp}/b.sock")
        s.sendall(ev.encode_frame(_records()))
        s.close()
        assert sc.wait_rows(lambda: sc.stats.rows_written_total == 10 + 24)
        url = sc.read_api.url
        assert main(["summary", "--agent", url, "--json"]) == 0
        live = json.loads(capsys.readouterr().out)
        assert live["run_id"] == "run-r" and live["requests"]["requests"] == 2 and live["model"] == "m"
        assert main(["diagnose", "--agent", url, "--json"]) == 0
        live_findings = json.loads(capsys.readouterr().out)
        assert main(["diagnose", url, "--json"]) == 0  # a URL in place of the file reads the API too
        assert json.loads(capsys.readouterr().out)["run_id"] == "run-r"
        assert main(["compare", "run-r", "run-r", "--agent", url, "--json"]) == 0
        cmp = json.loads(capsys.readouterr().out)
        assert cmp["a"]["metrics"]["requests"] == 2 and cmp["change"]["ttft_p50_s"] == 0
        assert main(["summary", "--agent", url, "--run", "nosuchrun"]) == 1
        assert "no run 'nosuchrun'" in capsys.readouterr().err
    finally:
        sc.stop()
    assert main(["summary", db, "--json"]) == 0
    offline = json.loads(capsys.readouterr().out)
    assert offline["requests"] == live["requests"] and offline["phases"] == live["phases"]
    assert main(["diagnose", db, "--json"]) == 0
    assert [f["id"] for f in json.loads(capsys.readouterr().out)["findings"]] == \
        [f["id"] for f in live_findings["findings"]]
