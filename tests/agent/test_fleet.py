"""Fleet view: `phasescope diagnose --fleet GLOB` over the Parquet exports of three simulated
hosts (3 days each, rolled by retention) names the host whose decode steps are slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from phasescope.agent.read.exports import hosts, list_files, open_host
from phasescope.analyzers.fleet import fleet_findings, host_metrics

NS = 1_000_000_000


@pytest.fixture(scope="module")
def fleet_exports(tmp_path_factory):
    """Exports of hosts a, b (20 ms decode steps) and c (45 ms), rolled over 3 simulated days."""
    from test_retention import simulate

    root = tmp_path_factory.mktemp("fleet")
    exp = str(root / "exports")
    for host, decode_ms in (("a", 20.0), ("b", 21.0), ("c", 45.0)):
        store, _, _ = simulate(str(root / f"{host}.duckdb"), exp, host, decode_ms=decode_ms, max_bytes=1 << 30,
                               step_every=10 * NS)
        store.close()
    return exp


def test_exports_read_in_place_as_a_store(fleet_exports):
    pattern = os.path.join(fleet_exports, "**", "*.parquet")
    assert hosts(pattern) == ["a", "b", "c"]
    tables = {t for _, _, t, _ in list_files(pattern)}
    assert {"steps", "request_events", "sources"} <= tables
    con = open_host(pattern, "c")
    # two rolled days of steps (the third is still in the store), one step every 10 s
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 2 * 86_400 // 10
    assert con.execute("SELECT count(*) FROM requests WHERE status = 'finished'").fetchone()[0] > 0
    assert con.execute("SELECT DISTINCT run_id FROM sources WHERE source_id > 0").fetchall() == [("run-c",)]
    con.close()


def test_fleet_findings_name_the_outlier(fleet_exports):
    pattern = os.path.join(fleet_exports, "**", "*.parquet")
    metrics = {}
    for h in hosts(pattern):
        con = open_host(pattern, h)
        metrics[h] = host_metrics(con)
        con.close()
    assert metrics["a"]["decode_step_ms_p50"] == 20.0 and metrics["c"]["decode_step_ms_p50"] == 45.0
    found = fleet_findings(metrics)
    assert [(f.evidence["host"], f.evidence["figure"]) for f in found] == [("c", "decode_step_ms_p50")]
    f = found[0]
    assert f.evidence["fleet_median"] == 21.0 and f.evidence["ratio"] == pytest.approx(45 / 21)
    assert f.severity == "warning"
    with pytest.raises(ValueError):
        fleet_findings(metrics, min_hosts=2)
    assert fleet_findings({h: metrics[h] for h in ("a", "c")}) == []  # two hosts: no median to stand out from


def test_diagnose_fleet_cli(fleet_exports):
    pattern = os.path.join(fleet_exports, "**", "*.parquet")
    out = subprocess.run([sys.executable, "-m", "phasescope.cli", "diagnose", "--fleet", pattern, "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert sorted(doc["hosts"]) == ["a", "b", "c"]
    outliers = [f for f in doc["findings"] if f["id"] == "fleet-outlier-host"]
    assert [f["evidence"]["host"] for f in outliers] == ["c"]
    text = subprocess.run([sys.executable, "-m", "phasescope.cli", "diagnose", "--fleet", pattern],
                          capture_output=True, text=True, timeout=300)
    assert text.returncode == 0 and "host c" in text.stdout


def _snapshot(folder: str) -> dict[str, tuple[int, int]]:
    return {os.path.join(d, f): (os.stat(os.path.join(d, f)).st_size, os.stat(os.path.join(d, f)).st_mtime_ns)
            for d, _, fs in os.walk(folder) for f in fs}


def test_open_reader_reads_an_export_folder_as_a_store(fleet_exports, tmp_path):
    """A folder of exports is a target like a DuckDB file: one host at a time, named queries and
    findings as on a store, the files never written."""
    from phasescope.agent.records.errors import ReadError as CliError
    from phasescope.agent.read.exports import export_glob
    from phasescope.agent.read.reader import ExportReader, FileReader, open_reader
    from phasescope.analyzers.diagnose import diagnose

    before = _snapshot(fleet_exports)
    reader = open_reader(fleet_exports, findings=diagnose)
    assert isinstance(reader, ExportReader) and reader.hosts == ["a", "b", "c"] and reader.host == "a"
    assert [r["run_id"] for r in reader.query("runs")] == ["run-a"]
    reader.close()
    reader = open_reader(os.path.join(fleet_exports, "host=*", "**", "*.parquet"), findings=diagnose, host="c")
    try:
        decode = next(r for r in reader.query("phase_summary", run_id="run-c") if r["phase"] == "decode")
        assert decode["p50_ms"] == 45.0 and decode["steps"] == 2 * 86_400 // 10 * 14 // 15
        assert isinstance(reader.findings("run-c"), list)
    finally:
        reader.close()
    # one host=... folder on its own is a target too
    sub = open_reader(os.path.join(fleet_exports, "host=b"))
    assert sub.hosts == ["b"]
    sub.close()
    with pytest.raises(CliError, match="hosts: a, b, c"):
        open_reader(fleet_exports, host="z")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CliError, match="no export files"):
        open_reader(str(empty))
    assert export_glob(str(tmp_path / "x.duckdb")) is None and export_glob("s3://b/exp") == "s3://b/exp/**/*.parquet"
    assert _snapshot(fleet_exports) == before
    db = tmp_path / "x.duckdb"
    from phasescope.agent.sidecar.store import Store

    Store(str(db)).close()
    plain = open_reader(str(db))
    assert type(plain) is FileReader
    plain.close()
    cli = [sys.executable, "-m", "phasescope.cli", "dashboard", str(empty)]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "no export files" in out.stderr and "Traceback" not in out.stderr, out.stderr
