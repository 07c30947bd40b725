"""The scenario scripts reproduce their fixtures: a fresh real run still fires the scenario's rules
(timing-noisy: the scenario's rules, nothing its committed fixture does not show, the stated workload), and the synthetic
builders reproduce the committed records exactly."""

from __future__ import annotations

import os

import duckdb
import pytest

from phasescope.cli.demo import DemoConfig
from phasescope.analyzers.diagnose import diagnose
from builders.scenarios import DATA_DIR, SCENARIOS, build_db

# vLLM runs are deterministic: test_prefix_miss.py rebuilds prefix-miss-vllm and checks its exact numbers
REAL = [n for n, s in SCENARIOS.items() if s.kind not in ("synthetic", "vllm")]
SYNTHETIC = [n for n, s in SCENARIOS.items() if s.kind == "synthetic"]


@pytest.mark.parametrize("name", SYNTHETIC)
def test_synthetic_rebuild_is_exact(name, tmp_path, scenario_db):
    path = str(tmp_path / "run.duckdb")
    run_id, _ = build_db(name, path)
    fixture, fixture_run = scenario_db(name)
    assert run_id == fixture_run
    q = "SELECT * EXCLUDE (connected_ns, wall_minus_mono_ns, pid) FROM sources WHERE source_id > 0 ORDER BY ALL"
    for sql in (q, "SELECT * FROM steps ORDER BY ALL", "SELECT * FROM kv_snapshots ORDER BY ALL",
                "SELECT * FROM gpu_samples ORDER BY ALL", "SELECT * FROM request_events ORDER BY ALL",
                "SELECT * FROM run_info ORDER BY ALL"):
        c1, c2 = duckdb.connect(path, read_only=True), duckdb.connect(fixture, read_only=True)
        try:
            assert repr(c1.execute(sql).fetchall()) == repr(c2.execute(sql).fetchall()), sql  # NaN-safe
        finally:
            c1.close()
            c2.close()


# findings a loaded machine may add to a real rebuild, whatever the scenario: CPU taken from the engine
# (host-bound), requests waiting longer for a slower engine (ttft-queueing), inter-token gaps longer than their
# step's compute (itl-spikes-host)
LOAD_DEPENDENT = {"host-bound", "ttft-queueing", "itl-spikes-host"}
# findings that read a table some fixtures were recorded before (no such Parquet file in the folder): the
# committed fixture cannot show them, a rebuild records the table and may
NEEDS_TABLE = {"prefix-miss-": "prefix_lookups", "kv-evicted-before-reuse": "page_events",
               "host-bound": "process_samples"}


def _not_shown(name: str, found: set[str], allowed: set[str]) -> set[str]:
    """Findings of a rebuild of `name` that are not allowed, less those whose input table its fixture lacks."""
    unrecorded = [fid for fid, table in NEEDS_TABLE.items()
                  if not os.path.exists(os.path.join(DATA_DIR, name, f"{table}.parquet"))]
    return {f for f in found - allowed if not any(f.startswith(p) for p in unrecorded)}


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL)
def test_real_rebuild_fires(name, tmp_path, scenario):
    """A rebuild fires the scenario's rules and nothing its committed fixture does not show (give or take
    what load alone changes): an extra, wrong finding fails. The rules' numbers are pinned on the committed
    fixtures (test_rules.py)."""
    expect = set(SCENARIOS[name].expect)
    fixture_con, fixture_run = scenario(name)
    allowed = {f.id for f in diagnose(fixture_con, fixture_run)} | LOAD_DEPENDENT
    assert expect <= allowed
    # A real run on a shared 2-core machine is timing-noisy: one rebuild may be disturbed by
    # other processes, so a second attempt is allowed.
    for attempt in range(2):
        path = str(tmp_path / f"run{attempt}.duckdb")
        run_id, config = build_db(name, path)
        con = duckdb.connect(path, read_only=True)
        try:
            found = {f.id for f in diagnose(con, run_id)}
            requests = con.execute("SELECT count(*) FROM requests WHERE run_id = ?", [run_id]).fetchone()[0]
        finally:
            con.close()
        if "host-bound" not in expect:
            # whether the engine is starved of CPU depends on the machine's load during the rebuild (on a
            # busy shared CI machine it truly is), not on the scenario's configuration; the committed
            # fixtures pin it (test_host_rules.py)
            found.discard("host-bound")
        if expect <= found and not _not_shown(name, found, allowed):
            break
    assert expect <= found, f"{name}: expected {sorted(expect)}, got {sorted(found)}"
    extra = _not_shown(name, found, allowed)
    assert not extra, f"{name}: {sorted(extra)} fired, which the fixture does not show"
    # the run served the stated workload (every request of it is in the store)
    stated = SCENARIOS[name].demo.get("requests", DemoConfig().requests)
    assert requests == stated, (requests, stated)
