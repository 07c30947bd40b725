"""`phasescope sweep`: HF continuous batching in-process over a rate sweep, to the SLO knee and why (issue 28).

Each rate is one recorded run of the demo's random-weight Llama (cli/demo.py: `record_workload`) in one
DuckDB file, labelled `sweep_id`, `sweep_point` and `sweep_rate_per_s`; the figures and the binding
constraint come from analyzers/sweep.py over that file. Outputs: JSON and CSV of the points, a PNG plot
when matplotlib is installed (it is not a phasescope dependency: without it the plot is skipped and the
summary says so), and a one-screen rich summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import uuid
from typing import Any, Sequence

from .demo import DemoConfig, build_model, make_workload, record_workload
from .errors import UsageError
from .options import add_command
from .sweep_result import measure, print_summary, write_outputs  # noqa: F401 (their old home)


# `--tiny`: a 2-layer model with short prompts and outputs (the tests' sweeps): seconds per point on a CPU
TINY: dict[str, Any] = dict(layers=2, hidden_size=128, heads=4, kv_heads=2, vocab_size=1024, system_prompt_tokens=16,
                            short_prompt=(8, 32), long_prompt_share=0.0, short_output=(3, 6), long_output_share=0.0,
                            page_size=16, max_batch_tokens=128)


def run_sweep(db: str, base: DemoConfig, rates: Sequence[float], slo: Any, target: float = 0.9,
              console: Any = None, sweep_id: str | None = None, model: Any = None,
              device: Any = None) -> dict[str, Any]:
    """Record one run per rate (requests/s) into `db`, then measure every point and the constraint at the knee.
    Returns the sweep's result (what the JSON output holds). `model`/`device`: a model `build_model(base)` made."""
    rates = sorted(float(r) for r in rates)
    if len(rates) < 1 or any(r <= 0 for r in rates):
        raise ValueError(f"rates must be > 0 requests/s, got {rates}")
    sweep_id = sweep_id or uuid.uuid4().hex[:12]
    if model is None:
        model, device = build_model(base)
    runs = []
    for i, rate in enumerate(rates):
        cfg = dataclasses.replace(base, arrival_rate_per_s=rate)
        labels = {"sweep_id": sweep_id, "sweep_point": i, "sweep_rate_per_s": rate}
        runs.append(record_workload(db, cfg, make_workload(cfg), model, device, console=console, labels=labels,
                                    title=f"point {i + 1}/{len(rates)} at {rate:g} req/s"))
    return measure(db, list(zip(rates, runs)), slo, target, sweep_id, "hf-cb")


def _rates(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated requests/s, got {text!r}") from None
    if not out or any(r <= 0 for r in out):
        raise argparse.ArgumentTypeError(f"rates must be > 0, got {text!r}")
    return out


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, got {text!r}")
    return name.strip(), value.strip()


def cmd_sweep(args: argparse.Namespace) -> int:
    """sweep HF continuous batching over arrival rates to the SLO knee

    Serve the demo's random-weight Llama with HF continuous batching at each arrival rate (one labelled run per
    rate in --db), then report TTFT/TPOT/ITL percentiles, goodput, SLO attainment and survival per rate, the knee,
    and the constraint that binds there with the change that would move it."""
    from rich.console import Console

    from phasescope.analyzers.sweep import Slo

    if args.requests <= 0:
        raise UsageError(f"--requests must be > 0, got {args.requests}")
    if not 0 < args.target <= 1:
        raise UsageError(f"--target must be in (0, 1], got {args.target}")
    if args.num_blocks <= 0 or args.max_requests_per_batch < 0:
        raise UsageError("--num-blocks must be > 0 and --max-requests-per-batch >= 0")
    try:
        slo = Slo(ttft_s=args.ttft_slo, tpot_s=args.tpot_slo, e2e_s=args.e2e_slo)
    except ValueError as exc:
        raise UsageError(f"--{str(exc).split()[1].replace('_s', '').replace('_', '-')}-slo: {exc}") from None
    if args.url:
        return _cmd_sweep_server(args, slo)
    base = DemoConfig(requests=args.requests, seed=args.seed, device=args.device, num_pages=args.num_blocks,
                      max_requests_per_batch=args.max_requests_per_batch, **(TINY if args.tiny else {}))
    console = Console(stderr=True)
    result = run_sweep(args.db, base, args.rates, slo, args.target, console=console)
    paths = write_outputs(result, args.out)
    print_summary(result, paths, Console())
    return 0


def _cmd_sweep_server(args: argparse.Namespace, slo: Any) -> int:
    """`sweep --url URL`: guidellm against an OpenAI-compatible server (cli/sweep_server.py)."""
    import shlex

    from rich.console import Console

    from .sweep_server import sweep_server

    if not args.model:
        raise UsageError("--url needs --model (the served model name guidellm requests)")
    console = Console(stderr=True)
    try:
        result = sweep_server(args.db, args.url.rstrip("/"), args.rates, slo, model=args.model,
                              tokenizer=args.tokenizer or args.model, requests=args.requests,
                              prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                              target_attainment=args.target,
                              serve=shlex.split(args.serve) if args.serve else None, out_dir=args.out,
                              console=console, headers=dict(args.header or ()))
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    paths = write_outputs(result, args.out)
    print_summary(result, paths, Console())
    return 0


def add_commands(sub: Any) -> None:
    """Register `sweep` on an argparse subparsers object."""
    s = add_command(sub, cmd_sweep)
    s.add_argument("--db", default="phasescope-sweep.duckdb", help="DuckDB file (default: %(default)s)")
    s.add_argument("--rates", type=_rates, default=[2.0, 4.0, 8.0, 16.0, 32.0],
                   help="arrival rates, requests/s, comma-separated (default: 2,4,8,16,32)")
    s.add_argument("--requests", type=int, default=24, help="requests per point (default: %(default)s)")
    s.add_argument("--ttft-slo", type=float, default=2.5, help="TTFT SLO, s (default: %(default)s)")
    s.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT SLO, s (default: %(default)s)")
    s.add_argument("--e2e-slo", type=float, default=None, help="end-to-end SLO, s (default: none)")
    s.add_argument("--target", type=float, default=0.9, help="SLO attainment the knee keeps (default: %(default)s)")
    s.add_argument("--num-blocks", type=int, default=96, help="KV pages of the pool (default: %(default)s)")
    s.add_argument("--max-requests-per-batch", type=int, default=0,
                   help="continuous batching's cap on requests per step (default: transformers' own)")
    s.add_argument("--tiny", action="store_true",
                   help="a 2-layer model, 16 tokens per KV page, short prompts and 3-6 output tokens (seconds per "
                        "point on a CPU; default: the demo's model and workload)")
    s.add_argument("--seed", type=int, default=0, help="workload and weight seed (default: %(default)s)")
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    s.add_argument("--out", default=".", help="folder for the JSON, CSV and PNG (default: %(default)s)")
    g = s.add_argument_group("an OpenAI-compatible server, loaded by guidellm (its own venv: .ci/install-guidellm)")
    g.add_argument("--url", default=None, metavar="URL",
                   help="sweep this server (e.g. http://127.0.0.1:8000) instead of HF continuous batching in-process")
    g.add_argument("--serve", default=None, metavar="CMD",
                   help="start the server with this command, recorded into --db by a sidecar the sweep runs "
                        "(without it, an agent you run records it; then `phasescope explain REPORT --db FILE`); "
                        "with port 0 in --url and CMD, the port the server binds is read back")
    g.add_argument("--model", default=None, help="served model name (guidellm's request field)")
    g.add_argument("--tokenizer", default=None, help="tokenizer guidellm counts tokens with (default: --model)")
    g.add_argument("--prompt-tokens", type=int, default=64, help="synthetic prompt length, tokens (default: 64)")
    g.add_argument("--output-tokens", type=int, default=16, help="output length, tokens (default: 16)")
    g.add_argument("--header", type=_header, action="append", metavar="NAME:VALUE",
                   help="a header guidellm sends with every request, repeatable (e.g. X-data-parallel-rank:0 sends "
                        "every request to a vLLM DP server's engine 0; guidellm cannot vary it per request)")
