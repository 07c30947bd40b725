"""`phasescope diagnose`, `plan-kv` and `compare` (registered by agent/cli.py)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def cmd_diagnose(args: argparse.Namespace) -> int:
    from phasescope.agent.read.queries import latest_run
    from phasescope.agent.sidecar.store import Store

    from .diagnose import diagnose, thresholds
    from .geometry import load_config
    from .render import print_findings

    if args.list_thresholds:
        print(json.dumps(thresholds(), indent=2))
        return 0
    if args.fleet:
        from .fleet import diagnose_fleet, print_fleet

        report = diagnose_fleet(args.fleet)
        print(json.dumps(report, indent=2, default=str)) if args.json else print_fleet(report)
        return 0
    if not args.db:
        print("diagnose: give a DuckDB file", file=sys.stderr)
        return 2
    overrides = {}
    for item in args.set or []:
        key, _, val = item.partition("=")
        overrides[key] = _value(val)
    model = load_config(args.model_config) if args.model_config else None
    con = Store.open_readonly(args.db)
    try:
        run_id = args.run or latest_run(con)
        if run_id is None:
            print(f"{args.db}: no runs", file=sys.stderr)
            return 1
        findings = diagnose(con, run_id, model=model, gpu=args.gpu, **overrides)
    finally:
        con.close()
    if args.json:
        print(json.dumps({"db": args.db, "run_id": run_id, "findings": [f.to_dict() for f in findings]},
                         indent=2, default=str))
    else:
        print_findings(findings, run_id, show_queries=args.queries)
    return 0


def cmd_plan_kv(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .geometry import ModelGeometry, load_config
    from .gpus import lookup
    from .kvplan import GIB, plan
    from .render import print_plan

    if args.config:
        g = load_config(args.config)
    elif args.layers and args.kv_heads and args.head_dim:
        g = ModelGeometry(layers=args.layers, heads=args.heads or args.kv_heads, kv_heads=args.kv_heads,
                          head_dim=args.head_dim, params=args.params or 0.0)
    else:
        print("plan-kv: give --config config.json or --layers/--kv-heads/--head-dim", file=sys.stderr)
        return 2
    gpu = lookup(args.gpu) if args.gpu else None
    if args.gpu and gpu is None:
        print(f"plan-kv: unknown GPU {args.gpu!r}", file=sys.stderr)
        return 2
    if args.budget_gib is None and gpu is None:
        print("plan-kv: give --budget-gib or --gpu", file=sys.stderr)
        return 2
    rows = plan(g, args.context, None if args.budget_gib is None else args.budget_gib * GIB,
                tps=[int(x) for x in args.tp.split(",")], kv_dtypes=args.kv_dtype.split(","),
                gpu_mem_bytes=gpu.mem_bytes if gpu else None)
    if args.json:
        print(json.dumps({"geometry": asdict(g), "context_tokens": args.context, "rows": [asdict(r) for r in rows]},
                         indent=2))
    else:
        print_plan(rows, args.context)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .compare import compare, resolve
    from .render import print_compare

    try:
        result = compare(resolve(args.run_a, args.db), resolve(args.run_b, args.db))
    except ValueError as e:
        print(f"compare: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print_compare(result)
    return 0


def add_commands(sub: Any) -> None:
    """Register the three subcommands on an argparse subparsers object."""
    d = sub.add_parser("diagnose", help="findings with evidence and tuning suggestions for one run",
                       description="Run every analyzer over a run of a DuckDB file no agent holds. Model geometry "
                                   "and GPU come from the run's labels (run_info) unless given.")
    d.add_argument("db", nargs="?", help="DuckDB file")
    d.add_argument("--run", help="run id (default: the latest)")
    d.add_argument("--json", action="store_true", help="JSON output")
    d.add_argument("--model-config", help="HF config.json of the served model (rooflines, planner rules)")
    d.add_argument("--gpu", help="GPU name: a table key (H100-SXM, A100-SXM-80GB, ...) or an NVML name")
    d.add_argument("--set", action="append", metavar="NAME=VALUE", help="override a named threshold; repeatable")
    d.add_argument("--queries", action="store_true", help="also print the SQL behind each finding")
    d.add_argument("--list-thresholds", action="store_true", help="print every threshold and its default")
    d.add_argument("--fleet", metavar="GLOB", help="compare hosts over Parquet exports (host=/date=/table=), "
                                                  "e.g. 'exports/**/*.parquet' or 's3://bucket/phasescope/**/*.parquet'")
    d.set_defaults(func=cmd_diagnose)

    p = sub.add_parser("plan-kv", help="KV capacity planner: bytes per token, sequences that fit a budget",
                       description="Per TP layout and KV dtype: KV bytes per token and per sequence on each GPU, "
                                   "and how many sequences of --context tokens fit the per-GPU KV budget.")
    p.add_argument("--config", help="HF config.json")
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--params", type=float, help="parameter count (weights per GPU in the table)")
    p.add_argument("--context", type=int, required=True, help="tokens per sequence")
    p.add_argument("--budget-gib", type=float, help="KV budget per GPU, GiB (default: 45%% of --gpu memory)")
    p.add_argument("--gpu", help="GPU name, for its memory")
    p.add_argument("--tp", default="1", help="TP sizes, comma-separated (default: 1)")
    p.add_argument("--kv-dtype", default="bf16", help="KV dtypes, comma-separated (bf16,fp8,int8,int4)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan_kv)

    c = sub.add_parser("compare", help="two runs side by side: TTFT, TPOT, throughput, OOM/preemptions, labels",
                       description="RUN is FILE (its latest run), FILE::RUN_ID, or a run id in --db FILE.")
    c.add_argument("run_a")
    c.add_argument("run_b")
    c.add_argument("--db", help="DuckDB file holding both run ids")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_compare)
