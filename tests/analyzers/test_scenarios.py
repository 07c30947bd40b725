"""The scenario scripts reproduce their fixtures: a fresh real run still fires the scenario's rules
(timing-noisy: the scenario's rules, nothing its committed fixture does not show, the stated workload), and the synthetic
builders reproduce the committed records exactly."""

from __future__ import annotations

import inspect
import json
import os
import re

import duckdb
import pytest

from phasescope.cli.demo import DemoConfig
from phasescope.agent.read.thresholds import T
from phasescope.analyzers.diagnose import diagnose
from phasescope.analyzers.host import PROCESS_SQL
from phasescope.analyzers.kvcache import kv_external_fragmentation
from phasescope.analyzers.prefill import STALL_SQL, prefill_stalls_decode
from phasescope.analyzers.sql import one
from phasescope.agent.read.itl import attribution
from builders.scenarios import DATA_DIR, SCENARIOS, build_db

# vLLM runs are deterministic: test_prefix_miss.py rebuilds prefix-miss-vllm and checks its exact numbers
_STALL_MIN_STEPS = inspect.signature(prefill_stalls_decode).parameters["min_steps"].default
_MIN_TURNOVER = inspect.signature(kv_external_fragmentation).parameters["min_turnover_per_s"].default
REAL = [n for n, s in SCENARIOS.items() if s.kind not in ("synthetic", "vllm", "recorded")]
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


def _queue_p90(con_or_path, run_id: str) -> float:
    """p90 of the run's requests' queue time (s): how far the engine fell behind the arrivals."""
    con = duckdb.connect(con_or_path, read_only=True) if isinstance(con_or_path, str) else con_or_path
    try:
        return con.execute("SELECT quantile_cont(queue_s, 0.9) FROM requests WHERE run_id = ?",
                           [run_id]).fetchone()[0] or 0.0
    finally:
        if isinstance(con_or_path, str):
            con.close()


def _itl(con, run_id: str) -> dict:
    """The run's ITL tail attribution (agent/read/itl.py), read whether or not a rule fires on it."""
    return attribution(con, run_id, int(T["long_prefill_tokens"]), T["host_stall_ratio"], T["tpot_slo_s"],
                       min_spike_ratio=0)


# the KV pages a run allocated per second over its KV snapshots, per page of the cache (kv-external-fragmentation's
# churn, `pages_allocated_per_s / total_pages`), and its steps per second
_PACE_SQL = """SELECT (max(k.pages_allocated_total) - min(k.pages_allocated_total))
                      / nullif((max(k.ts_ns) - min(k.ts_ns)) / 1e9, 0) / max(k.total_pages) AS turnover_per_s,
                      (SELECT count(*) / nullif((max(x.ts_ns) - min(x.ts_ns)) / 1e9, 0) FROM steps x
                       JOIN sources s USING (source_id) WHERE s.run_id = $run) AS steps_per_s
               FROM kv_snapshots k JOIN sources s USING (source_id) WHERE s.run_id = $run"""


def _not_shown(name: str, found: set[str], allowed: set[str]) -> set[str]:
    """Findings of a rebuild of `name` that are not allowed, less those whose input table its fixture lacks."""
    unrecorded = [fid for fid, table in NEEDS_TABLE.items()
                  if not os.path.exists(os.path.join(DATA_DIR, name, f"{table}.parquet"))]
    return {f for f in found - allowed if not any(f.startswith(p) for p in unrecorded)}


@pytest.mark.slow
# two real runs; under 2 spinners at load 17 both attempts overran the 300 s default, and kv-pressure's two
# overran 900 s beside 4 spinners (a hang guard, not a verdict)
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", REAL)
def test_real_rebuild_fires(name, tmp_path, scenario):
    """A rebuild fires the scenario's rules and nothing its committed fixture does not show (give or take
    what load alone changes): an extra, wrong finding fails. The rules' numbers are pinned on the committed
    fixtures (test_rules.py)."""
    stated = set(SCENARIOS[name].expect)
    fixture_con, fixture_run = scenario(name)
    allowed = {f.id for f in diagnose(fixture_con, fixture_run)} | LOAD_DEPENDENT
    assert stated <= allowed
    # A real run on a shared 2-core machine is timing-noisy: one rebuild may be disturbed by
    # other processes, so a second attempt is allowed.
    seen: list[dict] = []  # each attempt's findings and its engine's CPU figures, for the failure message
    for attempt in range(2):
        expect = set(stated)
        path = str(tmp_path / f"run{attempt}.duckdb")
        run_id, config = build_db(name, path)
        con = duckdb.connect(path, read_only=True)
        try:
            findings = {f.id: f for f in diagnose(con, run_id)}
            found = set(findings)
            requests = con.execute("SELECT count(*) FROM requests WHERE run_id = ?", [run_id]).fetchone()[0]
            stall = one(con, STALL_SQL, run_id, long=int(T["long_prefill_tokens"]))
            run_itl, run_pace = _itl(con, run_id), one(con, _PACE_SQL, run_id)
            seen.append({"found": sorted(found), "engine_cpu": one(con, PROCESS_SQL, run_id)})
        finally:
            con.close()
        if (stall["cosched_steps"] or 0) < _STALL_MIN_STEPS:
            # measured in this very run: the engine prefilled so slowly (a CPU-heavy neighbour: decode steps
            # of 34-205 ms against the fixture's 7) that the arrivals, fixed in wall time, merged into fewer
            # co-scheduled steps than the rule needs to judge (3-4 of 5, each of 3-4k prompt tokens)
            expect.discard("prefill-stalls-decode")
        if "host-bound" not in stated:
            # whether the engine is starved of CPU depends on the machine's load during the rebuild (on a
            # busy shared CI machine it truly is), not on the scenario's configuration; the committed
            # fixtures pin it (test_host_rules.py)
            found.discard("host-bound")
        if "itl-spikes-queueing" in found and _queue_p90(path, run_id) > 2 * _queue_p90(
                fixture_con, fixture_run):
            # measured in this very run: requests waited over twice as long as when the fixture was recorded
            # (the arrival rate is fixed in wall time, a slower engine falls behind it), so requests also sit
            # out steps and queueing may be the larger part of the ITL tail
            found.discard("itl-spikes-queueing")
            expect = expect - {"itl-spikes-prefill"}
        if "itl-spikes-prefill" in expect and not any(f.startswith("itl-spikes-") for f in found):
            fixture_itl = _itl(fixture_con, fixture_run)
            if (run_itl["itl_p99_ms"] < T["itl_spike_ratio"] * run_itl["itl_p50_ms"]
                    and run_itl["itl_p50_ms"] >= 3 * fixture_itl["itl_p50_ms"]):
                # measured in this very run (2 spinners beside the suite, load ~6: p50 ITL 645 ms against the
                # fixture's tens of ms): the engine was so slow that arrivals, fixed in wall time, left a long
                # prefill in most steps, so the median gap is a prefill gap too and p99/p50 fell under
                # itl_spike_ratio: no tail to explain, rightly. The tail it has must still be the prefills'.
                causes = ("prefill", "preemption", "queueing", "host", "other", "unattributed")
                top = max(causes, key=lambda c: run_itl[f"tail_{c}_share"] or 0)
                assert top == "prefill", (name, {c: run_itl[f"tail_{c}_share"] for c in causes})
                expect.discard("itl-spikes-prefill")
        if "kv-external-fragmentation" in expect and "kv-external-fragmentation" not in found:
            fixture_pace = one(fixture_con, _PACE_SQL, fixture_run)
            if (run_pace["turnover_per_s"] < _MIN_TURNOVER <= fixture_pace["turnover_per_s"]
                    and run_pace["steps_per_s"] <= fixture_pace["steps_per_s"] / 4):
                # measured in this very run (load ~6: 177 steps over 87 s against the fixture's 402 over 3.6 s):
                # the rule judges churn per wall second (min_turnover_per_s, 0.1 of the cache a second), and an
                # engine slowed this much allocates the same pages over far more seconds: no churn to judge
                expect.discard("kv-external-fragmentation")
        if "prefix-hit-collapse" in found and "prefix-hit-collapse" not in allowed:
            # measured in this very run (4 spinners beside the suite, busy run of 2026-12-03): a slowed engine
            # admits the later requests only after the small pool has evicted the shared prefix, so the hit rate
            # of the run's second half truly collapses. True of this run when its own figures say so: the second
            # half below collapse_ratio x the first, with cached pages evicted in it
            e = findings["prefix-hit-collapse"].evidence
            assert e["evicted_blocks_second_half"] > 0, e
            assert e["hit_rate_second_half"] < T["collapse_ratio"] * e["hit_rate_first_half"], e
            found.discard("prefix-hit-collapse")
        if "itl-spikes-host" in found:
            # measured in this very run: host stalls (gaps far over their step's compute: the machine's load)
            # are the larger part of the ITL tail, so the ITL finding names them instead of the prefills
            expect = expect - {"itl-spikes-prefill"}
        if expect <= found and not _not_shown(name, found, allowed):
            break
    assert expect <= found, f"{name}: expected {sorted(expect)}, got {sorted(found)}; attempts: {seen}"
    extra = _not_shown(name, found, allowed)
    assert not extra, f"{name}: {sorted(extra)} fired, which the fixture does not show"
    # the run served the stated workload (every request of it is in the store)
    served = SCENARIOS[name].demo.get("requests", DemoConfig().requests)
    assert requests == served, (requests, served)


def _config(name: str) -> dict:
    with open(os.path.join(DATA_DIR, name, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def test_every_fixture_has_a_working_reproduce_entry():
    """Each tests/data folder is a scenario of the table, and the command that rebuilds it works: the builder
    accepts it and has a path for its kind; a GPU-recorded one names its hardware and commands that parse."""
    import shlex

    from builders import scenarios, synthetic, vllm_workload
    from phasescope.cli.main import build_parser

    # tests/data/gpu holds the GPU scenario matrix's fixtures (builders/gpu_matrix.py, tests/analyzers/test_gpu_matrix.py)
    folders = {d for d in os.listdir(DATA_DIR) if os.path.isdir(os.path.join(DATA_DIR, d)) and d != "gpu"}
    assert folders == set(SCENARIOS), f"no scenario entry: {sorted(folders - set(SCENARIOS))}"
    for name in sorted(folders):
        sc, config = SCENARIOS[name], _config(name)
        assert (config["scenario"], config["kind"], config["expect"]) == (name, sc.kind, list(sc.expect)), name
        if sc.kind != "recorded":
            assert scenarios.parser().parse_args(["build", name]).names == [name]
            if sc.kind == "synthetic":
                assert name in synthetic.BUILDERS
            elif sc.kind == "vllm":
                assert callable(getattr(vllm_workload, {"prefix-miss": "prefix_miss_workload"}.get(
                    sc.workload, f"{sc.workload}_workload")))
            else:
                assert sc.kind in ("demo", "prefix-last", "miss") and sc.demo is not None
            continue
        assert sc.needs and "GPU" in sc.needs and config["reproduce"] == sc.reproduce, name
        for cmd in re.split(r"\s*(?:&&|;|&)\s*", sc.reproduce):
            argv = shlex.split(cmd)
            if argv[:1] == ["phasescope"]:
                build_parser().parse_args(argv[1:])  # exits on a bad command line
            elif argv[:4] == ["PYTHONPATH=tests", "python", "-m", "builders.scenarios"]:
                assert scenarios.parser().parse_args(argv[4:]).name == name
            elif argv[:1] == ["python"] and argv[1].startswith("benchmarks/"):
                assert os.path.exists(os.path.join(os.path.dirname(DATA_DIR), "..", argv[1])), argv[1]
            elif argv[:1] == ["torchrun"]:
                script = next(a for a in argv if a.endswith(".py"))
                assert os.path.exists(os.path.join(os.path.dirname(DATA_DIR), "..", script)), script
            else:
                assert argv[:1] == ["kill"], cmd
        with pytest.raises(RuntimeError, match=f"recorded on {re.escape(sc.needs)}"):
            build_db(name, "/nonexistent/never-written.duckdb")


@pytest.mark.parametrize("name", ["healthy", "prefill-interference", "kv-pressure", "internal-fragmentation",
                                  "queueing", "prefix-miss", "service-mix", "host-bound", "telemetry-silent",
                                  "prefix-miss-causes"])
def test_cpu_demo_fixtures_state_their_library_versions(name):
    v = _config(name)["versions"]
    assert SCENARIOS[name].kind in ("demo", "prefix-last", "miss")
    assert v["torch"].startswith("2.13.0") and v["transformers"] and v["duckdb"]


def test_a_recorded_run_exports_as_its_fixture(tmp_path):
    """The `record` step of a GPU fixture's reproduce command, on CPU: the committed h200-demo fixture loaded into
    a DuckDB file and recorded again gives the same rows, the table's config and this machine's versions."""
    from builders.scenarios import load, record

    db = str(tmp_path / "run.duckdb")
    run_id = load(os.path.join(DATA_DIR, "h200-demo"), db)
    config = record("h200-demo", db, str(tmp_path / "out"))
    assert config["run_id"] == run_id and config["expect"] == list(SCENARIOS["h200-demo"].expect)
    assert config["versions"]["duckdb"] == duckdb.__version__
    again = str(tmp_path / "again.duckdb")
    assert load(str(tmp_path / "out"), again) == run_id
    for table in ("steps", "request_events", "kv_snapshots", "gpu_samples"):
        q = f"SELECT * FROM {table} ORDER BY ALL"
        a, b = duckdb.connect(db, read_only=True), duckdb.connect(again, read_only=True)
        try:
            assert repr(a.execute(q).fetchall()) == repr(b.execute(q).fetchall()), table
        finally:
            a.close()
            b.close()
