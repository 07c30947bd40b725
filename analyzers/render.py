"""Terminal rendering (rich) of findings, KV plans and run comparisons."""

from __future__ import annotations

from typing import Any, Iterable

from rich.console import Console
from rich.table import Table

from phasescope.agent.read.summary import fold

from .findings import Finding
from .kvplan import GIB, PlanRow

_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def _num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_num(x)}" for k, x in v.items()) + "}"
    return str(v)


def print_findings(findings: list[Finding], run_id: str | None, console: Console | None = None,
                   show_queries: bool = False, evidence: bool = False) -> None:
    """One block per finding, most severe first, for a person: severity and title, what is wrong with its
    numbers, then what to change -> what it gains and the guide's section (a few lines at 80 columns).
    `evidence`: also the full suggestion and expected effect and the raw figures (their keys as stored)."""
    console = console or Console()
    if not findings:
        console.print(f"[green]run {run_id}: no findings[/] (every rule within its thresholds)")
        return
    counts = ", ".join(f"{n} {s}" for s in ("critical", "warning", "info")
                       if (n := sum(f.severity == s for f in findings)))
    console.print(f"[bold]phasescope diagnose[/] · run {run_id} · {counts}")
    for f in findings:
        summary, action = f.brief()
        grid = Table.grid(padding=(0, 1))
        grid.add_column(width=8, no_wrap=True)
        grid.add_column(ratio=1, overflow="fold")
        grid.add_row(f"[{_STYLE[f.severity]}]{f.severity.upper()}[/]", f"[bold]{f.title}[/]")
        grid.add_row("", summary)
        grid.add_row("", f"[green]→[/] {action} [dim]{f.reference} · {f.id}[/]")
        if evidence:
            grid.add_row("", f"[bold]suggestion[/]: {f.suggestion}")
            grid.add_row("", f"[bold]expected effect[/]: {f.expected_effect}")
            grid.add_row("", "[dim]" + " · ".join(f"{k}: {_num(v)}" for k, v in f.evidence.items()
                                                  if k != "query" and not isinstance(v, list) and v is not None)
                         + "[/]")
        console.print()
        console.print(grid)
    if not evidence:
        console.print("\n[dim]--evidence: each finding's full suggestion and its figures; --json: everything[/]")
    if show_queries:
        for f in findings:
            console.rule(f.id)
            console.print(f.evidence["query"], markup=False, highlight=False)


def print_plan(rows: Iterable[PlanRow], context: int, console: Console | None = None) -> None:
    console = console or Console()
    t = Table(title=f"KV capacity at {context} tokens per sequence, per GPU")
    for c in ("TP", "KV dtype", "B/token/GPU", "MiB/seq/GPU", "KV heads replicated", "KV budget GiB/GPU",
              "weights GiB/GPU", "max sequences"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r.tp), r.kv_dtype, f"{r.bytes_per_token_per_rank:,.0f}",
                  f"{r.bytes_per_sequence_per_rank / (1 << 20):,.1f}", f"{r.replication:g}x",
                  f"{r.budget_bytes_per_gpu / GIB:,.1f}",
                  "-" if r.weight_bytes_per_gpu is None else f"{r.weight_bytes_per_gpu / GIB:,.1f}",
                  f"{r.max_sequences:,}")
    console.print(fold(t))
    console.print("KV bytes/token = 2 x layers x kv_heads x head_dim x dtype bytes, heads split over TP ranks "
                  "(replicated below one head per rank)", style="dim")


def _fmt_metric(k: str, v: Any) -> str:
    if v is None:
        return "-"
    if k.endswith("_per_s"):
        return f"{v:.1f} tok/s" if k.endswith("tokens_per_s") else f"{v:.2f} /s"
    if k.endswith("_s"):
        return f"{v * 1e3:.1f} ms" if v < 10 else f"{v:.2f} s"
    if k == "survival_rate":
        return f"{v:.1%}"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


def _fmt_seconds(v: float | None, in_s: bool) -> str:
    if v is None:
        return "-"
    return f"{v:.2f} s" if in_s else f"{v * 1e3:.1f} ms"


def print_compare(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    a, b = result["a"], result["b"]
    t = Table(title="phasescope compare")
    t.add_column("metric")
    t.add_column(f"A {a['run_id']}", justify="right")
    t.add_column(f"B {b['run_id']}", justify="right")
    t.add_column("B vs A", justify="right")
    for k in ("ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s", "output_tokens_per_s", "requests",
              "prompt_tokens_mean", "output_tokens_mean", "survival_rate", "preemptions", "aborted", "oom_total"):
        ch = result["change"].get(k)
        x, y = a["metrics"].get(k), b["metrics"].get(k)
        if k.endswith("_s") and not k.endswith("_per_s"):  # one unit per row: ms unless either is >= 10 s
            in_s = any(v is not None and v >= 10 for v in (x, y))
            fx, fy = (_fmt_seconds(v, in_s) for v in (x, y))
        else:
            fx, fy = _fmt_metric(k, x), _fmt_metric(k, y)
        t.add_row(k, fx, fy, "-" if ch is None else f"{ch:+.1%}")
    console.print(fold(t))
    if result["differs"]:
        d = Table(title="labels that differ")
        for c in ("label", "A", "B"):
            d.add_column(c)
        for k, (x, y) in result["differs"].items():
            d.add_row(k, str(x), str(y))
        console.print(fold(d))
    if result["warning"]:
        console.print(f"[yellow]warning:[/] {result['warning']}")


def threshold_unit(name: str, default: Any) -> str:
    """The unit of a named threshold, from its name (names carry units: `_s`, `_tokens`, `_per_s`, ...)."""
    if name.endswith("_per_s"):
        return "1/s"
    if name.endswith("_s"):
        return "s"
    if name.endswith("_ms"):
        return "ms"
    if name.endswith(("_tokens", "_page_size")) or name == "min_page_size":
        return "tokens"
    if name.endswith(("_steps", "_preemptions", "_errors", "_rows")):
        return "count"
    if name.endswith(("_ratio", "_skew", "_imbalance")) or name in ("stall_ratio", "critical_ratio"):
        return "ratio"
    if isinstance(default, float) and 0 <= default <= 1:
        return "fraction (0-1)"
    return "-" if isinstance(default, str) else "number"


def print_thresholds(console: Console | None = None) -> None:
    """Every analyzer's named thresholds with default and unit (`diagnose --list-thresholds`)."""
    from .diagnose import thresholds

    console = console or Console()
    t = Table(title="diagnose thresholds (override with --set NAME=VALUE)")
    for c in ("analyzer", "threshold", "default", "unit"):
        t.add_column(c)
    for analyzer, params in thresholds().items():
        for name, default in params.items():
            t.add_row(analyzer, name, str(default), threshold_unit(name, default))
    console.print(fold(t))
