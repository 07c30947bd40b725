"""vLLM on a GPU with phasescope's plugin and a real sidecar: timing truth, cost and fidelity.

Each phase starts a `phasescope agent` process (DuckDB store, Unix socket) and runs vLLM's offline
`LLM` in a child process with the plugin armed (PHASESCOPE_AGENT), random weights of a real
geometry (`load_format="dummy"`, config.json only, token-id prompts), and vLLM's defaults otherwise:
torch.compile, CUDA graphs (FULL_AND_PIECEWISE), prefix caching, chunked prefill, async scheduling.

- truth: vLLM's own reference (vllm_ref.py) records CUDA events of its own around the same
  `execute_model` + `sample_tokens` for every step, the scheduler's token counts, the graph mode of
  each step, and vLLM's SchedulerStats; compared with the probe's steps and KV snapshots, and the
  plugin's counters with `LLM.get_metrics()` (fidelity, ample KV).
- pressure: the same fidelity checks on a KV cache small enough to preempt (and a fixture).
- cost: engines in one process, one armed and others not, serving identical blocks alternately
  (ABBA), decode throughput and median step period at batch 1, 8 and 64.
- toggle: one armed engine whose adapter is taken off and put back between blocks (pause.py), ABBA:
  the same comparison without a second engine's position in the process and on the GPU.
- interference: decoders with long prompts arriving (chunked prefill), a fixture for diagnose.

    python vllm_h200.py --out DIR [--phases truth,cost,pressure,interference] [--deadline-s 540]

Writes DIR/results.json (updated after every phase), DIR/<phase>.duckdb and the child logs to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

HERE = pathlib.Path(__file__).resolve().parent
MODELS = HERE / "models"
RESULT_TAG = "H200_RESULT "
_LLMS: list = []  # the child's engines, shut down after the result is written

# phase -> (seconds it may take at most, seconds it needs at least to be worth starting)
PHASE_TIME = {"truth": (240, 120), "cost": (450, 150), "toggle": (540, 120), "pressure": (150, 80), "interference": (150, 80)}


# --- child side: runs vLLM ------------------------------------------------------------------------

def _engine_args(model: str, cpu: bool, **extra: Any) -> dict:
    """vLLM's defaults, random weights; on the CPU build (a local check of this script) small and eager."""
    args = dict(model=model, load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=True,
                disable_log_stats=False, max_model_len=4096, seed=0)
    if cpu:
        args.update(dtype="float32", enforce_eager=True, block_size=32, max_model_len=1024,
                    max_num_batched_tokens=1024, max_num_seqs=64)
    else:
        args.update(dtype="bfloat16", gpu_memory_utilization=0.40)
    args.update(extra)
    return args


def _metrics(llm: Any) -> dict:
    """vLLM's own metrics (`LLM.get_metrics()`): counters/gauges by name, histograms as _count/_sum."""
    out: dict = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)):
            out[m.name] = out.get(m.name, 0) + value
        elif isinstance(getattr(m, "count", None), int):
            out[m.name + "_count"] = out.get(m.name + "_count", 0) + m.count
            out[m.name + "_sum"] = out.get(m.name + "_sum", 0.0) + float(getattr(m, "sum", 0.0))
    return out


_VOCAB = [32000]  # token ids are drawn below this (the model's vocabulary, read by child_main)


def _prompts(rng: random.Random, n: int, length: int, shared: list[int] | None = None) -> list[list[int]]:
    lo, hi = min(1000, _VOCAB[0] // 4), min(30000, _VOCAB[0] - 1)
    return [(shared or []) + [rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> int:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)


def _rpc(llm: Any, fn: Any, *args: Any) -> Any:
    try:
        return llm.collective_rpc(fn, args=args)[0]
    except Exception as exc:  # noqa: BLE001 - the reference is optional; the run goes on
        return {"error": repr(exc)[:400]}


def child_fidelity(model: str, cpu: bool, pressure: bool) -> dict:
    """truth / pressure: one armed engine, vLLM's reference installed, a mixed workload."""
    import vllm_ref
    from vllm import LLM

    extra = {}
    if pressure:
        # a pool the workload outgrows while decoding: vLLM preempts (recomputes) requests
        extra = dict(num_gpu_blocks_override=(40 if cpu else 700) + 1)
    t0 = time.monotonic()
    llm = LLM(**_engine_args(model, cpu, **extra))
    res: dict = {"engine_start_s": round(time.monotonic() - t0, 1)}
    res["ref_worker"] = _rpc(llm, vllm_ref.install_worker)
    res["ref_sched"] = _rpc(llm, vllm_ref.install_scheduler)
    rng = random.Random(1 if pressure else 0)
    t0 = time.monotonic()
    served = 0
    if pressure:
        shared = _prompts(rng, 1, 256 if cpu else 512)[0]
        n, own, out = (12, 64, 48) if cpu else (96, 128, 384)
        prompts = _prompts(rng, n * 3 // 4, own, shared) + _prompts(rng, n - n * 3 // 4, own + len(shared))
        served += _generate(llm, prompts, out)
    else:
        shared = _prompts(rng, 1, 256 if cpu else 1024)[0]
        n = 16 if cpu else 64
        # a wave of n (3 in 4 behind a shared prefix): prefill, mixed and decode steps at batch n
        served += _generate(llm, _prompts(rng, n * 3 // 4, 64, shared) + _prompts(rng, n // 4, 512), 32 if cpu else 96)
        served += _generate(llm, _prompts(rng, 1, 128), 32 if cpu else 256)  # batch 1
        served += _generate(llm, _prompts(rng, 8, 128), 32 if cpu else 256)  # batch 8
    res["workload_s"] = round(time.monotonic() - t0, 2)
    res["client_output_tokens"] = served
    res["metrics"] = _metrics(llm)
    res["ref_steps"] = _rpc(llm, vllm_ref.collect_worker)
    res["ref_stats"] = _rpc(llm, vllm_ref.collect_scheduler)
    _LLMS.append(llm)
    return res


def _timed_block(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict:
    """Serve one block; wall time, output tokens, and the frontend's engine-step periods."""
    engine = llm.llm_engine
    original = engine.step
    stamps: list[float] = []

    def step(*a: Any, **k: Any) -> Any:
        r = original(*a, **k)
        stamps.append(time.perf_counter())
        return r

    engine.step = step
    cpu0 = _cpu_s()
    try:
        t0 = time.perf_counter()
        tokens = _generate(llm, prompts, max_tokens)
        wall = time.perf_counter() - t0
    finally:
        del engine.step
    cpu1 = _cpu_s()
    periods = [b - a for a, b in zip(stamps, stamps[1:])][2:]  # decode steps: after the prefill
    # CPU seconds of this process (the frontend) and of its children (the EngineCores: only the one serving
    # this block works, the others wait on their sockets) over the block: where an armed engine's extra time goes
    return {"wall_s": wall, "tokens": tokens, "steps": len(stamps),
            "p50_step_ms": statistics.median(periods) * 1e3 if periods else float("nan"),
            "frontend_cpu_s": round(cpu1[0] - cpu0[0], 6), "engines_cpu_s": round(cpu1[1] - cpu0[1], 6),
            "engine_probe_threads_cpu_s": round(cpu1[2] - cpu0[2], 6)}


# pid -> native ids of the phasescope background threads in it (the toggle phase reads them from the acks)
_PROBE_THREADS: dict[int, list[int]] = {}


def _task_cpu_s(pid: int, tids: list[int] | None = None) -> float:
    """CPU seconds of process `pid`'s threads (or of those in `tids`), from /proc/<pid>/task/<tid>/schedstat (the
    scheduler's run time, ns: exact, where psutil's figures tick at 10 ms, a 39 us quantum per step in a block of
    256 steps); threads that ended before the read are not counted."""
    total = 0
    for tid in tids if tids is not None else os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def _cpu_s() -> tuple[float, float, float]:
    """(this process's CPU s, its live children's CPU s, recursively, the CPU s of the phasescope background threads
    of those children: _PROBE_THREADS), from the scheduler's per-thread run times; nans where unreadable."""
    try:
        import psutil

        me = os.getpid()
        kids = sum(_task_cpu_s(c.pid) for c in psutil.Process(me).children(recursive=True))
        probe = sum(_task_cpu_s(pid, tids) for pid, tids in _PROBE_THREADS.items() if pid != me)
        return _task_cpu_s(me), kids, probe
    except Exception:  # noqa: BLE001 - a figure of the report, never the run's failure
        return float("nan"), float("nan"), float("nan")


def cond_d_env(value: str) -> dict[str, str] | None:
    """The environment condition D adds to A's (PHASESCOPE_BENCH_COND_D; None: no condition D)."""
    value = value.strip()
    if not value or value == "0":
        return None
    named = {"1": {"PHASESCOPE_CUDA_TIMING": "0"}, "same": {}, "plain": {"PHASESCOPE_AGENT": ""},
             "nosidecar": {"PHASESCOPE_AGENT": "unix:/tmp/phasescope-bench-nobody.sock"}}
    if value in named:
        return named[value]
    return dict(kv.split("=", 1) for kv in value.split(",") if "=" in kv)


def child_cost(model: str, cpu: bool, budget_s: float, batches: list[int], max_tokens: int,
               checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Three engines of one setup: phasescope armed (A, vLLM's stats off), plain (B, both off) and vLLM's own
    stats (C, `disable_log_stats=False`, the `vllm serve` default; phasescope off); identical blocks, the order
    A B C / C B A alternating by round. PHASESCOPE_BENCH_COND_D adds D, an armed engine made last (its own run id),
    order A B C D / D C B A: `1` armed as A with PHASESCOPE_CUDA_TIMING=0 (what the CUDA events cost), `same` armed
    exactly as A (what being made first costs A: a control of the order of creation), `plain` not armed at all
    (D - B is then the engines' position alone, both plain), `nosidecar` armed with
    PHASESCOPE_AGENT at a socket no one serves (what the sidecar and the sends cost), or `K=V,K=V` (any env).
    D's frontend is never hooked: the plugin's catchers arm the first OutputProcessor of a process only, and every
    engine's frontend lives in this process; so D - B is the engine side's cost (EngineCore and worker) alone."""
    import vllm_ref
    from vllm import LLM

    cond_d = cond_d_env(os.environ.get("PHASESCOPE_BENCH_COND_D", ""))
    util = {} if cpu else dict(gpu_memory_utilization=0.2 if cond_d is not None else 0.25)
    t0 = time.monotonic()
    cores: dict[str, int | None] = {}
    seen = _engine_cores(set())
    llm_a = LLM(**_engine_args(model, cpu, disable_log_stats=True, **util))  # PHASESCOPE_AGENT is set
    cores["A"], seen = _new_core(seen)
    agent = os.environ.pop("PHASESCOPE_AGENT")  # B's and C's EngineCores (spawned) start with the plugin off
    llm_b = LLM(**_engine_args(model, cpu, disable_log_stats=True, **util))
    cores["B"], seen = _new_core(seen)
    llm_c = LLM(**_engine_args(model, cpu, disable_log_stats=False, **util))
    cores["C"], seen = _new_core(seen)
    engines = {"A": llm_a, "B": llm_b, "C": llm_c}
    if cond_d is not None:  # D: armed as A, made last, with the ablation's environment on top
        rid = os.environ.get("PHASESCOPE_RUN_ID")
        env_d = dict({"PHASESCOPE_AGENT": agent, "PHASESCOPE_RUN_ID": "bench-cond-d"}, **cond_d)
        os.environ.update(env_d)
        res_d = {"cond_d_env": cond_d}
        try:
            engines["D"] = LLM(**_engine_args(model, cpu, disable_log_stats=True, **util))
            cores["D"], seen = _new_core(seen)
        finally:
            for k in env_d:
                os.environ.pop(k, None)
            os.environ.update({"PHASESCOPE_RUN_ID": rid} if rid else {})
    res: dict = {"engine_start_s": round(time.monotonic() - t0, 1), **(res_d if cond_d is not None else {}),
                 "armed": {k: _rpc(v, vllm_ref.armed) for k, v in engines.items()}}
    rng = random.Random(2)
    for bs in batches:  # warm-up: one block of each size on each
        p = _prompts(rng, bs, 32)
        for llm in engines.values():
            _timed_block(llm, p, 16)
    rows = []
    t_end = time.monotonic() + budget_s
    spy_s = float(os.environ.get("PHASESCOPE_BENCH_PYSPY_S", "0") or 0)
    spies = _pyspy(cores, spy_s) if spy_s > 0 else []
    res["engine_core_pids"] = cores
    spy_end = time.monotonic() + spy_s if spies else 0.0
    r = 0
    while time.monotonic() < t_end or r < 4:
        profiled = time.monotonic() < spy_end
        for bs in batches:
            p = _prompts(rng, bs, 32)
            order = tuple(engines) if r % 2 == 0 else tuple(reversed(engines))
            for cond in order:
                row = _timed_block(engines[cond], p, max_tokens)
                rows.append(dict(row, round=r, bs=bs, cond=cond, profiled=profiled))
        r += 1
        res.update(rows=rows, rounds=r, partial=True)
        if checkpoint is not None:  # a child killed at the phase's deadline still leaves its finished rounds
            checkpoint(res)
        if r >= 60:
            break
    res["partial"] = False
    _LLMS.extend(engines.values())
    return res


def child_toggle(model: str, cpu: bool, budget_s: float, batches: list[int], max_tokens: int,
                 checkpoint: Callable[[dict], None] | None = None) -> dict:
    """One armed engine (vLLM's stats off) serving identical blocks armed (A) and paused (B) in turn, the order
    A B / B A alternating by round. Between blocks the adapter's wrappers come off vLLM's instances and go back in
    every process of the engine (frontend, EngineCore, workers: `pause.py`, through PHASESCOPE_BENCH_PAUSE_FILE,
    each process acknowledging). One engine, one place in the process and on the GPU: no position effect to
    confound the two (the three-engine `cost` phase's problem). Paused, the probes' background threads still wake
    (nothing to send): their idle cost is in both conditions, not in A - B. PHASESCOPE_BENCH_TOGGLE_PARTS adds
    conditions with some roles paused (an ablation: which part costs what); the order A B C.. / ..C B A by round."""
    import glob

    from vllm import LLM

    path = os.environ["PHASESCOPE_BENCH_PAUSE_FILE"]
    util = {} if cpu else dict(gpu_memory_utilization=0.4)
    t0 = time.monotonic()
    llm = LLM(**_engine_args(model, cpu, disable_log_stats=True, **util))  # PHASESCOPE_AGENT is set
    res: dict = {"engine_start_s": round(time.monotonic() - t0, 1)}

    def acks() -> dict[str, dict]:
        out = {}
        for f in glob.glob(path + ".ack.*"):
            try:
                out[f.rsplit(".", 1)[1]] = json.loads(pathlib.Path(f).read_text())
            except (OSError, ValueError):
                pass  # being replaced: read again
        return out

    _generate(llm, _prompts(random.Random(1), 2, 16), 4)  # every process's channel is open and waking
    time.sleep(3)
    pids = sorted(acks())
    res["processes"] = pids  # frontend + EngineCore (+ worker where it has a process of its own)
    for pid, ack in acks().items():
        _PROBE_THREADS[int(pid)] = list(ack.get("threads", []))
    res["probe_threads"] = {str(k): v for k, v in _PROBE_THREADS.items()}
    switches: list[dict] = []

    # A: armed; B: every role paused; C, D, ...: the roles PHASESCOPE_BENCH_TOGGLE_PARTS names paused, one condition
    # per ";"-separated group (e.g. "worker;frontend": C the worker's wrappers off, D the frontend's)
    parts = [g.strip() for g in os.environ.get("PHASESCOPE_BENCH_TOGGLE_PARTS", "").split(";") if g.strip()]
    conds: dict[str, str | None] = {"A": None, "B": "", **{chr(ord("C") + i): g for i, g in enumerate(parts)}}
    res["conditions"] = {k: ("armed" if v is None else "paused: " + (v or "all")) for k, v in conds.items()}
    roles = ("engine", "frontend", "worker")

    def set_paused(content: str | None) -> None:
        if content is None:
            if os.path.exists(path):
                os.remove(path)
            want: list[str] = []
        else:
            pathlib.Path(path + ".tmp").write_text(content)
            os.replace(path + ".tmp", path)  # whole: a process never reads it half written
            want = sorted(roles) if not content else sorted(r.strip() for r in content.split(","))
        t = time.monotonic()
        while True:
            now = acks()
            if all(now.get(pid, {}).get("paused") == want for pid in pids):
                break
            if time.monotonic() - t > 15:
                raise RuntimeError(f"no acknowledgement of paused={want} from every process: {now}")
            time.sleep(0.02)
        switches.append({pid: now[pid]["wrappers"] for pid in pids})

    rng = random.Random(2)
    for bs in batches:  # warm-up: one block of each size in each condition
        p = _prompts(rng, bs, 32)
        for content in conds.values():
            set_paused(content)
            _timed_block(llm, p, 16)
    rows = []
    t_end = time.monotonic() + budget_s
    r = 0
    while time.monotonic() < t_end or r < 4:
        for bs in batches:
            p = _prompts(rng, bs, 32)
            for cond in (tuple(conds) if r % 2 == 0 else tuple(reversed(conds))):
                set_paused(conds[cond])
                rows.append(dict(_timed_block(llm, p, max_tokens), round=r, bs=bs, cond=cond, profiled=False))
        r += 1
        res.update(rows=rows, rounds=r, partial=True, switches=switches[:8], wrappers_per_switch=sorted(
            {tuple(sorted(s.items())) for s in switches}))
        if checkpoint is not None:
            checkpoint(res)
        if r >= 200:
            break
    set_paused(None)  # the figures the store keeps at the end are armed ones
    res["partial"] = False
    _LLMS.append(llm)
    return res


def _engine_cores(seen: set[int]) -> set[int]:
    """Pids of this process's EngineCore processes (vLLM titles them `VLLM::EngineCore`) plus `seen`."""
    try:
        import psutil

        found = set(seen)
        for c in psutil.Process().children(recursive=False):  # the EngineCore is a direct child (spawn)
            try:
                cmd = " ".join(c.cmdline())
                # titled `VLLM::EngineCore` where setproctitle is installed; else a multiprocessing spawn child
                if "EngineCor" in cmd or "EngineCor" in c.name() or "spawn_main" in cmd:
                    found.add(c.pid)
            except psutil.Error:
                pass
        return found
    except Exception:  # noqa: BLE001 - profiling is optional
        return set(seen)


def _new_core(seen: set[int]) -> tuple[int | None, set[int]]:
    """The EngineCore started since `seen` was taken (None when not exactly one), and the new `seen`."""
    now = _engine_cores(seen)
    new = now - seen
    if len(new) != 1:
        print(f"py-spy: {len(new)} new EngineCore candidates {sorted(new)}; this engine is not profiled", flush=True)
    return (new.pop() if len(new) == 1 else None), now


def _pyspy(cores: dict[str, int | None], seconds: float) -> list[subprocess.Popen]:
    """py-spy (if installed) sampling each EngineCore at 200 Hz for `seconds`, without pausing it (--nonblocking),
    every thread, stacks by function, into PHASESCOPE_BENCH_PYSPY_DIR/<cond>.txt (collapsed: `stack count`)."""
    exe = shutil.which("py-spy")
    where = os.environ.get("PHASESCOPE_BENCH_PYSPY_DIR", "")
    if exe is None or not where:
        print("py-spy: not installed or no PHASESCOPE_BENCH_PYSPY_DIR; no profile", flush=True)
        return []
    procs = []
    for cond, pid in cores.items():
        if pid is None:
            continue
        cmd = [exe, "record", "-p", str(pid), "-r", "200", "-d", str(int(seconds)), "--nonblocking", "--function",
               "-f", "raw", "-o", os.path.join(where, f"pyspy_{cond}.txt")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr))
    print(f"py-spy: profiling {cores} for {seconds:.0f} s", flush=True)
    return procs


def serve_stepped(llm: Any, work: list) -> tuple[int, int]:
    """Drive the engine step by step, adding each (name, prompt ids, max tokens, at step) of `work` (ordered by
    step) when its step comes; returns (engine steps, output tokens of the finished requests)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    step = outputs = 0
    while work or engine.has_unfinished_requests():
        while work and work[0][3] <= step:
            name, prompt, mt, _ = work.pop(0)
            engine.add_request(name, TokensPrompt(prompt_token_ids=prompt),
                               SamplingParams(max_tokens=mt, ignore_eos=True, temperature=0))
        for out in engine.step():
            if out.finished:
                outputs += len(out.outputs[0].token_ids)
        step += 1
    return step, outputs


def child_interference(model: str, cpu: bool) -> dict:
    """Decoders running while long prompts arrive, prefilled in chunks next to their decodes."""
    from vllm import LLM

    budget = 256 if cpu else 2048
    llm = LLM(**_engine_args(model, cpu, max_num_batched_tokens=budget, enable_chunked_prefill=True))
    rng = random.Random(3)
    n_dec, dec_out = (3, 96) if cpu else (16, 768)
    n_long, long_len, every = (3, 600, 24) if cpu else (6, 3000, 96)
    work = [(f"dec{i}", _prompts(rng, 1, 32)[0], dec_out, 0) for i in range(n_dec)]
    work += [(f"long{k}", _prompts(rng, 1, long_len)[0], 4, 16 + every * k) for k in range(n_long)]
    t0 = time.monotonic()
    step, outputs = serve_stepped(llm, work)
    _LLMS.append(llm)
    return {"engine_steps": step, "client_output_tokens": outputs, "workload_s": round(time.monotonic() - t0, 2),
            "budget_tokens": budget, "decoders": n_dec, "decode_tokens": dec_out, "long_prompts": n_long,
            "long_tokens": long_len, "every_steps": every, "metrics": _metrics(llm)}


def _write_result(path: str, res: dict) -> None:
    """`res` as JSON at `path`, whole or not at all (a kill mid-write leaves the previous checkpoint)."""
    tmp = path + ".tmp"
    pathlib.Path(tmp).write_text(json.dumps(res))
    os.replace(tmp, path)


def child_main(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    _VOCAB[0] = int(json.loads((pathlib.Path(a.model) / "config.json").read_text()).get("vocab_size", 32000))
    if a.child in ("truth", "pressure"):
        res = child_fidelity(a.model, a.cpu, a.child == "pressure")
    elif a.child == "toggle":
        res = child_toggle(a.model, a.cpu, a.cost_budget_s, [int(b) for b in a.batches.split(",")], a.max_tokens,
                           checkpoint=lambda partial: _write_result(a.result, partial))
    elif a.child == "cost":
        res = child_cost(a.model, a.cpu, a.cost_budget_s, [int(b) for b in a.batches.split(",")], a.max_tokens,
                         checkpoint=lambda partial: _write_result(a.result, partial))
    else:
        res = child_interference(a.model, a.cpu)
    _write_result(a.result, res)
    print(RESULT_TAG + "written", flush=True)
    for llm in _LLMS:  # end the EngineCore processes now (their probes flush at exit), free the GPU
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as exc:  # noqa: BLE001
            print("engine shutdown:", repr(exc), flush=True)


# --- parent side: sidecar, child, comparison ------------------------------------------------------

def _agent(db: str, sock: str) -> subprocess.Popen:
    exe = os.environ.get("PHASESCOPE_BENCH_AGENT_PYTHON", sys.executable)  # a local --cpu check: the project's
    cmd = [exe, "-c", "import sys; from phasescope.cli.main import main; sys.exit(main())",
           "agent", "--db", db, "--listen", f"unix:{sock}", "--no-api", "--no-metrics", "--sample-s", "1.0"]
    cpus = os.environ.get("PHASESCOPE_BENCH_AGENT_CPUS")  # e.g. "14-15": the sidecar kept off the server's cores
    if cpus:
        cmd = ["taskset", "-c", cpus] + cmd
    proc = subprocess.Popen(cmd, stdout=sys.stdout, stderr=sys.stderr)
    t0 = time.monotonic()
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() - t0 > 60:
            raise RuntimeError("phasescope agent did not start")
        time.sleep(0.1)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_child(cmd: list[str], env: dict, timeout_s: float) -> str:
    """Run the child (a session of its own), killed with its group after `timeout_s`; its status in words."""
    child = subprocess.Popen(cmd, env=env, stdout=sys.stdout, stderr=sys.stderr, start_new_session=True)
    try:
        rc = child.wait(timeout_s)
        status = "ok" if rc == 0 else f"child exit {rc}"
    except subprocess.TimeoutExpired:
        status = f"timed out after {timeout_s:.0f} s"
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    time.sleep(1.0)  # the probes' last flush
    return status


def run_phase(phase: str, a: argparse.Namespace, timeout_s: float, out: pathlib.Path) -> dict:
    tmp = tempfile.mkdtemp(prefix=f"ps-{phase}-", dir="/tmp")
    sock, db, result = f"{tmp}/agent.sock", f"{tmp}/{phase}.duckdb", f"{tmp}/result.json"
    agent = _agent(db, sock)
    env = dict(os.environ, PHASESCOPE_AGENT=f"unix:{sock}", PYTHONPATH=os.pathsep.join(
        [str(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("PHASESCOPE_RUN_ID", None)
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # engine B of `cost` must not inherit A's hooks
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of the reference's functions (cloudpickle)
    if phase == "toggle":  # every process of the engine follows this file: present, the adapter is off (pause.py)
        env["PHASESCOPE_BENCH_PAUSE_FILE"] = f"{tmp}/paused"
    # the child's engine starts, warm-up and exit, s (a fourth engine: +60; an H100 start of 4 took ~180 s)
    reserve = 230 if cond_d_env(os.environ.get("PHASESCOPE_BENCH_COND_D", "")) is not None else 170
    reserve = 110 if phase == "toggle" else reserve  # one engine to start
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", phase, "--model", a.model,
           "--result", result, "--cost-budget-s", str(min(a.cost_budget_s, max(30.0, timeout_s - reserve))), "--batches", a.batches,
           "--max-tokens", str(a.max_tokens)] + (["--cpu"] if a.cpu else [])
    t0 = time.monotonic()
    try:
        status = run_child(cmd, env, timeout_s)
    finally:
        _stop(agent)
    res: dict = {"status": status, "phase_s": round(time.monotonic() - t0, 1)}
    if os.path.exists(result):
        res["child"] = json.loads(pathlib.Path(result).read_text())
    if os.path.exists(db):
        try:
            import compare

            res["compare"] = compare.analyze(phase, db, res.get("child", {}))
        except Exception as exc:  # noqa: BLE001 - the raw data comes back; analysis can be redone
            res["compare_error"] = repr(exc)[:600]
        res["db_bytes"] = os.path.getsize(db)
        if res["db_bytes"] < 15 * 2**20:  # what comes back from a lent machine: files under 16 MiB
            shutil.copy(db, out / f"{phase}.duckdb")
    shutil.rmtree(tmp, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--phases", default="truth,cost,pressure,interference")
    ap.add_argument("--model", default=str(MODELS / "llama-3.2-1b"))
    ap.add_argument("--deadline-s", type=float, default=540.0, help="stop starting phases after this, s")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--max-tokens", type=int, default=256, help="output tokens per request of a cost block")
    ap.add_argument("--cpu", action="store_true", help="vLLM's CPU build: a small, eager local check")
    ap.add_argument("--child")
    ap.add_argument("--result")
    ap.add_argument("--cost-budget-s", type=float, default=90.0)
    a = ap.parse_args()
    if a.child:
        child_main(a)
        return
    sys.path.insert(0, str(HERE))
    t_start = time.monotonic()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"started_unix_s": time.time(), "model": a.model, "phases": {}}
    try:
        import torch
        import vllm

        results["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__,
                               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    except Exception as exc:  # noqa: BLE001
        results["versions"] = {"error": repr(exc)[:400]}
    print("versions", results["versions"], flush=True)
    for phase in a.phases.split(","):
        left = a.deadline_s - (time.monotonic() - t_start)
        most, least = (x * (3 if a.cpu else 1) for x in PHASE_TIME[phase])  # the CPU build starts slowly
        if left < least:
            results["phases"][phase] = {"status": f"skipped: {left:.0f} s left"}
        else:
            print(f"=== phase {phase} ({min(most, left):.0f} s at most)", flush=True)
            results["phases"][phase] = run_phase(phase, a, min(most, left), out)
            summary = {k: v for k, v in results["phases"][phase].items() if k != "child"}
            print(f"=== {phase}: " + json.dumps(summary, default=str)[:3000], flush=True)
        (out / "results.json").write_text(json.dumps(results, default=str))
    print("done in %.0f s" % (time.monotonic() - t_start), flush=True)


if __name__ == "__main__":
    main()
