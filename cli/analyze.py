"""`phasescope diagnose`, `plan-kv` and `compare` (registered by cli/main.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .errors import CliError, UsageError
from .options import add_api_url, add_command, read_line, reader_target


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _overrides(items: list[str], known: dict[str, Any]) -> dict[str, Any]:
    """--set NAME=VALUE items as threshold overrides; UsageError for an unknown name or a bad value."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set takes NAME=VALUE, got {item!r}")
        if key not in known:
            raise UsageError(f"--set: unknown threshold {key!r}; list them with --list-thresholds")
        value = _value(val)
        if isinstance(known[key], (int, float)) and not isinstance(value, (int, float)):
            raise UsageError(f"--set {key}: {val!r} is not a number")
        if isinstance(value, (int, float)):
            out[key] = _checked_threshold(key, val, value, known[key])
            continue
        out[key] = value
    return out


def _checked_threshold(key: str, text: str, value: float, default: Any) -> float:
    """A numeric threshold within its unit's range (from its name, as --list-thresholds shows it): >= 0 and
    finite; a fraction 0 to 1; a count or token threshold a whole number. UsageError naming name, value, range."""
    import math

    from phasescope.analyzers.render import threshold_unit

    unit = threshold_unit(key, default)
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"--set {key}={text}: must be >= 0 ({unit})")
    if unit.startswith("fraction") and value > 1:
        raise UsageError(f"--set {key}={text}: a fraction, must be 0 to 1")
    if isinstance(default, int) and not float(value).is_integer():
        raise UsageError(f"--set {key}={text}: must be a whole number ({unit})")
    return int(value) if isinstance(default, int) else float(value)


def cmd_diagnose(args: argparse.Namespace) -> int:
    """findings with evidence and tuning suggestions for one run

    Run every analyzer over a run of a DuckDB file no agent holds. Model geometry and GPU come from the run's
    labels (run_info) unless given.
    """
    from phasescope.agent.read.reader import connect_readonly, open_reader, require_run

    from phasescope.analyzers.diagnose import diagnose, thresholds
    from phasescope.analyzers.findings import Finding
    from phasescope.analyzers.geometry import load_config
    from phasescope.analyzers.render import print_findings, print_thresholds

    if args.list_thresholds:
        if args.json:
            print(json.dumps(thresholds(), indent=2))
        else:
            print_thresholds()
        return 0
    if args.prometheus:
        from phasescope.analyzers.fleet_prom import PrometheusError, diagnose_prometheus, print_prometheus

        if not args.prometheus.startswith(("http://", "https://")):
            raise UsageError(f"--prometheus takes an http(s) URL, got {args.prometheus!r}")

        try:
            report = diagnose_prometheus(args.prometheus, selector=args.selector or "", range_=args.range,
                                         by=args.by, token=args.prometheus_token
                                         or os.environ.get("PHASESCOPE_PROMETHEUS_TOKEN"))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        except PrometheusError as exc:
            raise CliError(str(exc)) from None
        print(json.dumps(report, indent=2, default=str)) if args.json else print_prometheus(report)
        return 0
    if args.fleet:
        from phasescope.analyzers.fleet import diagnose_fleet, print_fleet

        report = diagnose_fleet(args.fleet)
        print(json.dumps(report, indent=2, default=str)) if args.json else print_fleet(report)
        return 0
    known = {n: v for params in thresholds().values() for n, v in params.items()}
    overrides = _overrides(args.set or [], known)
    target = reader_target(args)
    if target.startswith(("http://", "https://")):
        if overrides or args.model_config or args.gpu:
            raise UsageError("--set, --model-config and --gpu apply to a file; a running agent diagnoses with "
                             "its defaults and the run's labels")
        reader = open_reader(target)
        try:
            run_id = require_run(reader.query("runs"), args.run, target)
            findings = [Finding(**d) for d in reader.findings(run_id)]
        finally:
            reader.close()
    else:
        model = None
        if args.model_config:
            try:
                model = load_config(args.model_config)
            except FileNotFoundError:
                raise CliError(f"no such file {args.model_config!r} (--model-config takes an HF config.json)") \
                    from None
            except (OSError, ValueError) as exc:
                raise CliError(f"cannot read {args.model_config!r} as an HF config.json: {exc}") from None
        if args.gpu:
            from phasescope.analyzers.gpus import lookup

            if lookup(args.gpu) is None:
                raise UsageError(f"unknown GPU {args.gpu!r}")
        con = connect_readonly(target)
        try:
            from phasescope.agent.read.queries import runs

            run_id = require_run(runs(con), args.run, target)
            findings = diagnose(con, run_id, model=model, gpu=args.gpu, **overrides)
        finally:
            con.close()
    read = read_line(target)
    if args.json:
        print(json.dumps({"db": target, "run_id": run_id, "read": read, "findings": [f.to_dict() for f in findings]},
                         indent=2, default=str))
    else:
        from rich.console import Console

        print_findings(findings, run_id, show_queries=args.queries, evidence=args.evidence)
        Console().print(read, style="dim", markup=False, highlight=False)
    return 0


def _positive_ints(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated positive integers, got {text!r}") from None
    if not out or min(out) <= 0:
        raise UsageError(f"{flag} takes comma-separated positive integers, got {text!r}")
    return out


def _geometry_from_flags(args: argparse.Namespace) -> Any:
    from phasescope.analyzers.geometry import ModelGeometry

    if not (args.layers and args.kv_heads and args.head_dim):
        raise UsageError("give --config config.json, or --layers, --kv-heads and --head-dim "
                         "(and --hidden, --intermediate, --vocab for the weights)")
    for flag in ("layers", "heads", "kv_heads", "head_dim", "hidden", "intermediate", "vocab"):
        v = getattr(args, flag)
        if v is not None and v <= 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be > 0, got {v}")
    if args.params is not None and args.params <= 0:
        raise UsageError(f"--params must be > 0, got {args.params}")
    return ModelGeometry(layers=args.layers, heads=args.heads or args.kv_heads, kv_heads=args.kv_heads,
                         head_dim=args.head_dim, hidden=args.hidden or 0, intermediate=args.intermediate or 0,
                         vocab=args.vocab or 0, params=args.params or 0.0, dtype=args.dtype,
                         tied_embeddings=args.tied_embeddings)


def cmd_plan_kv(args: argparse.Namespace) -> int:
    """KV capacity planner: bytes per token, sequences that fit a budget

    Per TP layout and KV dtype: KV bytes per token and per sequence on each GPU, and how many sequences of
    --context tokens fit the per-GPU KV budget.
    """
    from dataclasses import asdict

    from phasescope.analyzers.geometry import dtype_bytes, load_config
    from phasescope.analyzers.gpus import lookup
    from phasescope.analyzers.kvplan import GIB, plan
    from phasescope.analyzers.render import print_plan

    if args.context <= 0:
        raise UsageError(f"--context must be > 0 tokens, got {args.context}")
    if args.budget_gib is not None and args.budget_gib <= 0:
        raise UsageError(f"--budget-gib must be > 0, got {args.budget_gib}")
    tps = _positive_ints(args.tp, "--tp")
    try:
        dtype_bytes(args.dtype)
    except ValueError as exc:
        raise UsageError(f"--dtype: {exc}") from None
    kv_dtypes = [x for x in args.kv_dtype.split(",") if x.strip()]
    for dt in kv_dtypes or [""]:
        try:
            dtype_bytes(dt)
        except ValueError as exc:
            raise UsageError(f"--kv-dtype: {exc}") from None
    if args.config:
        try:
            g = load_config(args.config)
        except FileNotFoundError:
            raise CliError(f"no such file {args.config!r} (--config takes a model's HF config.json)") from None
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot read {args.config!r} as an HF config.json: {exc}") from None
    else:
        g = _geometry_from_flags(args)
    weights_known = bool(args.config or args.params or (g.intermediate and g.vocab))
    gpu = lookup(args.gpu) if args.gpu else None
    if args.gpu and gpu is None:
        raise UsageError(f"unknown GPU {args.gpu!r}; give --budget-gib instead, or a known GPU name")
    if args.budget_gib is None and gpu is None:
        raise UsageError("give --budget-gib or --gpu")
    from phasescope.analyzers.kvplan import check_tp

    for tp in tps:
        try:
            check_tp(g, tp)
        except ValueError as exc:
            raise UsageError(f"--tp {tp}: {exc}") from None
    rows = plan(g, args.context, None if args.budget_gib is None else args.budget_gib * GIB, tps=tps,
                kv_dtypes=kv_dtypes, gpu_mem_bytes=gpu.mem_bytes if gpu else None, weights_known=weights_known)
    if rows and not any(r.max_sequences for r in rows):
        best = max(rows, key=lambda r: r.budget_bytes_per_gpu / r.bytes_per_sequence_per_rank)
        raise CliError(f"no layout fits one sequence of {args.context} tokens: at best (TP {best.tp}, "
                       f"{best.kv_dtype}) a sequence needs {best.bytes_per_sequence_per_rank / GIB:.2f} GiB per GPU "
                       f"of a {best.budget_bytes_per_gpu / GIB:.2f} GiB KV budget; give a larger --budget-gib, a "
                       "shorter --context, more TP or a smaller --kv-dtype")
    empty = [r for r in rows if not r.max_sequences]
    if args.json:
        print(json.dumps({"geometry": asdict(g), "weights_known": weights_known, "context_tokens": args.context,
                          "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print_plan(rows, args.context)
        if empty:
            print(f"{len(empty)} of {len(rows)} layouts fit no sequence of {args.context} tokens (max sequences 0)",
                  file=sys.stderr)
        if not weights_known:
            print("weights unknown: give --intermediate and --vocab (or --params, or --config) to count them",
                  file=sys.stderr)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """two runs side by side: TTFT, TPOT, throughput, OOM/preemptions, labels

    RUN is FILE (its latest run), FILE::RUN_ID, or a run id in --db FILE.
    """
    from phasescope.analyzers.compare import compare, resolve
    from phasescope.analyzers.render import print_compare

    if args.api and args.db:
        raise UsageError("give --db FILE or --api URL, not both")
    where = args.api or args.db
    try:
        result = compare(resolve(args.run_a, where), resolve(args.run_b, where))
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print_compare(result)
    return 0


def add_commands(sub: Any) -> None:
    """Register the three subcommands on an argparse subparsers object."""
    d = add_command(sub, cmd_diagnose)
    d.add_argument("db", nargs="?", help="DuckDB file no agent holds")
    add_api_url(d, "diagnose a running agent's store through its read API")
    d.add_argument("--run", help="run id (default: the latest)")
    d.add_argument("--json", action="store_true", help="JSON output")
    d.add_argument("--model-config", help="HF config.json of the served model (rooflines, planner rules)")
    d.add_argument("--gpu", help="GPU name: a table key (H100-SXM, A100-SXM-80GB, ...) or an NVML name")
    d.add_argument("--set", action="append", metavar="NAME=VALUE", help="override a named threshold; repeatable")
    d.add_argument("--evidence", action="store_true",
                   help="also print each finding's full suggestion, expected effect and raw figures")
    d.add_argument("--queries", action="store_true", help="also print the SQL behind each finding")
    d.add_argument("--list-thresholds", action="store_true", help="print every threshold, its default and unit")
    d.add_argument("--fleet", metavar="GLOB", help="compare hosts over Parquet exports (host=/date=/table=), "
                                                  "e.g. 'exports/**/*.parquet' or 's3://bucket/phasescope/**/*.parquet'")
    d.add_argument("--prometheus", metavar="URL",
                   help="fleet findings from a Prometheus-compatible query API (Prometheus, Thanos, Mimir, "
                        "VictoriaMetrics) that scrapes the sidecars: which pods stand out, and why")
    d.add_argument("--selector", metavar="MATCHERS", help='with --prometheus: label matchers, e.g. \'{namespace="prod"}\'')
    d.add_argument("--range", default="10m", metavar="DURATION", help="with --prometheus: the window (default: 10m)")
    d.add_argument("--by", default="pod", metavar="LABEL",
                   help="with --prometheus: the label that names a pod (default: pod; e.g. instance)")
    d.add_argument("--prometheus-token", metavar="TOKEN",
                   help="with --prometheus: a bearer token (or PHASESCOPE_PROMETHEUS_TOKEN; user:password@ in the "
                        "URL for basic auth)")

    p = add_command(sub, cmd_plan_kv)
    p.add_argument("--config", help="HF config.json")
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--hidden", type=int, help="hidden size (default: heads x head dim)")
    p.add_argument("--intermediate", type=int, help="MLP intermediate size (weights)")
    p.add_argument("--vocab", type=int, help="vocabulary size (embeddings and LM head)")
    p.add_argument("--tied-embeddings", action="store_true", help="the LM head shares the embedding matrix")
    p.add_argument("--dtype", default="bfloat16", help="weight dtype (default: %(default)s)")
    p.add_argument("--params", type=float, help="parameter count (overrides the estimate from the shapes)")
    p.add_argument("--context", type=int, required=True, help="tokens per sequence")
    p.add_argument("--budget-gib", type=float, help="KV budget per GPU, GiB (default: 45%% of --gpu memory)")
    p.add_argument("--gpu", help="GPU name, for its memory")
    p.add_argument("--tp", default="1", help="TP sizes, comma-separated (default: 1)")
    p.add_argument("--kv-dtype", default="bf16", help="KV dtypes, comma-separated (bf16,fp8,int8,int4)")
    p.add_argument("--json", action="store_true")

    c = add_command(sub, cmd_compare)
    c.add_argument("run_a")
    c.add_argument("run_b")
    c.add_argument("--db", help="DuckDB file holding both run ids")
    add_api_url(c, "the read API of a running agent holding both run ids")
    c.add_argument("--json", action="store_true")
