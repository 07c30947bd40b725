"""`phasescope demo`: the main job on its embedded default.

Builds a small Llama from a config with random weights (never a download; CPU
by default, CUDA + bf16 when a GPU is there), serves a service-like workload
through it with the probe attached and an in-process sidecar writing a DuckDB
file, and prints a per-phase summary.

The workload: requests arrive over time (Poisson), share a system prompt, carry
short or long user prompts and want short or long outputs. By default they are
served by HF continuous batching (`init_continuous_batching`: a paged KV cache with
prefix sharing, chunked prefill under a token budget, preemption when the cache
is full); `runtime="generate"` serves them with static batches through
`generate` instead (left padding).
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from phasescope.agent.records.address import Address


@dataclass(frozen=True)
class DemoRequest:
    request_id: str
    prompt: list[int]
    output_tokens: int
    arrival_offset_s: float
    # submit only once every earlier request has finished; this and later arrival offsets then count from
    # that moment (closed-loop phases)
    wait_idle: bool = False


@dataclass(frozen=True)
class DemoConfig:
    """Model and workload of the demo; defaults run in well under a minute on 2 CPU cores."""

    requests: int = 48
    seed: int = 0
    max_batch: int = 8
    system_prompt_tokens: int = 96
    short_prompt: tuple[int, int] = (8, 48)
    long_prompt: tuple[int, int] = (256, 512)
    long_prompt_share: float = 0.3
    short_output: tuple[int, int] = (4, 16)
    long_output: tuple[int, int] = (48, 96)
    long_output_share: float = 0.3
    arrival_rate_per_s: float = 12.0
    runtime: str = "cb"  # "cb": continuous batching; "generate": static batches
    page_size: int = 32  # tokens per KV page (continuous batching)
    num_pages: int = 96  # KV pages: 3072 tokens, tight enough to show pressure (and preemption)
    max_batch_tokens: int = 256  # token budget per step: longer prompts are prefilled in chunks
    max_requests_per_batch: int = 0  # continuous batching's cap on requests per step (0: transformers' default)
    vocab_size: int = 4096
    hidden_size: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    device: str | None = None  # None: cuda if available else cpu
    # > 0: after this many seconds of serving the adapter stops reporting KV snapshots and prefix
    # counters (steps and requests go on): an adapter gone silent, for the telemetry-degraded scenario
    adapter_silent_after_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def build_model(cfg: DemoConfig) -> tuple[Any, Any]:
    """A random-weight Llama (eval mode) and its torch device."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(cfg.seed)
    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.hidden_size * 11 // 4,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    config._name_or_path = f"phasescope-demo-llama-{cfg.layers}L-{cfg.hidden_size}d"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    return model, device


def make_workload(cfg: DemoConfig) -> list[DemoRequest]:
    """Deterministic service-like requests for `cfg.seed`."""
    rng = random.Random(cfg.seed)
    system = [rng.randrange(2, cfg.vocab_size) for _ in range(cfg.system_prompt_tokens)]
    out, t = [], 0.0
    for i in range(cfg.requests):
        lo, hi = cfg.long_prompt if rng.random() < cfg.long_prompt_share else cfg.short_prompt
        user = [rng.randrange(2, cfg.vocab_size) for _ in range(rng.randint(lo, hi))]
        olo, ohi = cfg.long_output if rng.random() < cfg.long_output_share else cfg.short_output
        t += rng.expovariate(cfg.arrival_rate_per_s)
        out.append(DemoRequest(f"demo-{i:04d}", [1] + system + user, rng.randint(olo, ohi), t))
    return out


def serve(model: Any, device: Any, probe: Any, workload: list[DemoRequest], max_batch: int,
          progress: Any = None) -> dict[str, list[int]]:
    """Serve `workload` in arrival order with static batches; returns tokens per request."""
    import torch

    from phasescope.agent.probe.adapters.hf_generate import GenerateRequests

    start = time.monotonic_ns()
    pending = list(workload)
    results: dict[str, list[int]] = {}
    while pending:
        now_s = (time.monotonic_ns() - start) / 1e9
        if pending[0].arrival_offset_s > now_s:
            time.sleep(pending[0].arrival_offset_s - now_s)
            continue
        batch = [r for r in pending[:max_batch] if r.arrival_offset_s <= now_s]
        pending = pending[len(batch):]
        width = max(len(r.prompt) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt):] = 1
        tracker = None if probe is None else GenerateRequests(
            probe, [r.request_id for r in batch], [len(r.prompt) for r in batch],
            arrival_ns=[start + int(r.arrival_offset_s * 1e9) for r in batch],
        )
        with torch.inference_mode():
            seqs = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), streamer=tracker,
                max_new_tokens=max(r.output_tokens for r in batch), do_sample=False,
                pad_token_id=0, eos_token_id=None,
            )
        new = seqs[:, width:].cpu().tolist()
        # each request keeps its own number of tokens (static batching computes the rest anyway)
        if tracker is not None:
            tracker.finish([r.output_tokens for r in batch])
        for row, r in enumerate(batch):
            results[r.request_id] = new[row][: r.output_tokens]
        if progress is not None:
            progress(len(batch))
    return results


def serve_cb(model: Any, adapter: Any, workload: list[DemoRequest], cfg: DemoConfig, progress: Any = None,
             realtime: bool = True) -> dict[str, list[int]]:
    """Serve `workload` through HF continuous batching, submitting each request at its arrival time."""
    import threading

    from transformers import GenerationConfig

    from phasescope.agent.probe.adapters.hf_cb import cb_config

    gen = GenerationConfig(max_new_tokens=max(r.output_tokens for r in workload), do_sample=False, eos_token_id=-1)
    cap = {"max_requests_per_batch": cfg.max_requests_per_batch} if cfg.max_requests_per_batch > 0 else {}
    cb = cb_config(cfg.page_size, cfg.num_pages, cfg.max_batch_tokens, **cap)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    results: dict[str, list[int]] = {}

    def collect() -> None:
        while len(results) < len(workload):
            out = manager.get_result(timeout=30)
            if out is None:
                if not manager.is_running():
                    return
                continue
            if out.is_finished():
                results[out.request_id] = list(out.generated_tokens)
                if progress is not None:
                    progress(1)

    manager.start()
    collector = threading.Thread(target=collect, name="demo-collect", daemon=True)
    collector.start()
    try:
        start = time.monotonic()
        for i, r in enumerate(workload):
            if r.wait_idle:
                deadline = time.monotonic() + 600
                while len(results) < i and collector.is_alive() and time.monotonic() < deadline:
                    time.sleep(0.005)
                start = time.monotonic()
            if realtime:
                delay = start + r.arrival_offset_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            manager.add_request(r.prompt, request_id=r.request_id, max_new_tokens=r.output_tokens)
        collector.join(600)
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    return results


def demo_labels(cfg: DemoConfig) -> dict[str, Any]:
    """Run labels of a demo config: every knob of the workload and the engine (so `phasescope verify` can serve
    the same requests again, and `compare` tells what two runs varied) and the workload's prefix layout."""
    labels: dict[str, Any] = {k: (",".join(map(str, v)) if isinstance(v, (tuple, list)) else v)
                              for k, v in asdict(cfg).items() if k not in ("extra", "device")}
    labels.update(shared_prefix_tokens=cfg.system_prompt_tokens + 1, prefix_position="first")
    return labels


def record_workload(db_path: str, cfg: DemoConfig, workload: list[DemoRequest], model: Any = None,
                    device: Any = None, console: Any = None, labels: dict[str, Any] | None = None,
                    title: str | None = None, address: Address | None = None) -> str:
    """Serve `workload` with the probe attached and an in-process sidecar writing `db_path`, or, with `address`,
    the probe sending to the agent listening there (`db_path` unused: the agent writes its own store).

    Returns the run id. `labels` are added to (and override) `demo_labels(cfg)`; a rich
    `console` gets a progress bar (headed `title`, default "serving (RUNTIME)").
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from phasescope.agent.probe.adapters.hf_cb import HFContinuousBatching
    from phasescope.agent.sidecar.collectors import NvmlCollector
    from phasescope.agent.sidecar.host import HostCollector
    from phasescope.agent.probe import attach
    from phasescope.agent.sidecar import Sidecar

    if model is None:
        model, device = build_model(cfg)
    tmp = tempfile.mkdtemp(prefix="phasescope-demo-")
    addr = address or Address("unix", os.path.join(tmp, "agent.sock"), 0)
    sidecar = None
    if address is None:
        # the in-process sidecar samples the GPU like a real one (no GPU: no samples, quietly)
        host = HostCollector()  # the served process and the host, like a real agent (pids from the Hello)
        sidecar = Sidecar(db_path, listen=[addr], batch_interval_s=0.1, collectors=[NvmlCollector(), host],
                          sinks=[host], sample_interval_s=0.5).start()
    probe = None
    try:
        runtime = "hf-cb" if cfg.runtime == "cb" else "hf-generate"
        probe = attach(model, address=addr, runtime=runtime, flush_interval_s=0.05,
                       labels={**demo_labels(cfg), **(labels or {})})
        adapter = HFContinuousBatching(probe).instrument_model(model) if cfg.runtime == "cb" else None
        if adapter is not None and cfg.adapter_silent_after_s > 0:
            import threading

            def silence() -> None:
                adapter.emit_kv = adapter.emit_prefix = lambda *a, **k: None

            timer = threading.Timer(cfg.adapter_silent_after_s, silence)
            timer.daemon = True
            timer.start()
        with Progress(TextColumn(f"[bold]{title or f'serving ({runtime})'}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("requests"), TimeElapsedColumn(), console=console, transient=False,
                      disable=console is None) as bar:
            task = bar.add_task("serve", total=len(workload))
            advance = lambda n: bar.advance(task, n)  # noqa: E731
            if adapter is not None:
                serve_cb(model, adapter, workload, cfg, progress=advance)
                adapter.detach()
            else:
                serve(model, device, probe, workload, cfg.max_batch, progress=advance)
        run_id = probe.run_id
        probe.close()
        if sidecar is not None:
            sidecar.wait_rows(sidecar.drained, 10)
    finally:
        if probe is not None:
            probe.close()
        if sidecar is not None:
            sidecar.stop()
        try:
            os.rmdir(tmp)
        except OSError:
            pass
    return run_id


def run_demo(db_path: str = "phasescope.duckdb", cfg: DemoConfig | None = None, quiet: bool = False) -> dict[str, Any]:
    """Run the whole demo; returns the summary (also printed unless quiet)."""
    from rich.console import Console

    from phasescope.agent.read.queries import kv_summary, phase_summary, prefix_summary, probe_health, request_summary
    from phasescope.agent.sidecar.store import Store
    from phasescope.agent.read.summary import print_summary

    cfg = cfg or DemoConfig()
    t0 = time.monotonic()
    console = Console(stderr=True, quiet=quiet)
    with console.status("building a random-weight Llama"):
        model, device = build_model(cfg)
    if cfg.runtime not in ("cb", "generate"):
        raise ValueError(f"unknown demo runtime {cfg.runtime!r}; use 'cb' or 'generate'")
    workload = make_workload(cfg)
    if device.type == "cuda":
        # A GPU pays seconds of one-time kernel selection for every new shape (measured on an
        # H200: 10 s for the first pass over this workload, 1 s after). A real server warms up
        # before taking traffic, so the demo does too, unrecorded and with no arrival gaps.
        with console.status("warming up the GPU (not recorded)"):
            warm = [DemoRequest(r.request_id, r.prompt, r.output_tokens, 0.0) for r in workload]
            if cfg.runtime == "cb":
                serve_cb(model, None, warm, cfg, realtime=False)
            else:
                serve(model, device, None, warm, cfg.max_batch)
    run_id = record_workload(db_path, cfg, workload, model, device, console=console)
    con = Store.open_readonly(db_path)
    try:
        summary = {
            "db": db_path,
            "run_id": run_id,
            "model": model.config._name_or_path,
            "device": str(device),
            "elapsed_s": round(time.monotonic() - t0, 1),  # model build, warm-up and the recorded workload
            "phases": phase_summary(con, run_id),
            "requests": request_summary(con, run_id),
            "kv": kv_summary(con, run_id),
            "prefix": prefix_summary(con, run_id),
            "probe": probe_health(con, run_id),
        }
    finally:
        con.close()
    if not quiet:
        print_summary(summary)
    return summary
