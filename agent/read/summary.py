"""Terminal rendering of a run's summary (rich tables)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


NO_REQUESTS = ("no request records: a plain attach(model) times every forward (the steps above) but cannot see "
               "where a request starts or ends. For TTFT, TPOT and queue time per request, pass "
               "GenerateRequests(probe, ids, prompt_lens) as generate's streamer "
               "(phasescope.agent.probe.adapters.hf_generate), use the continuous-batching adapter (HFContinuousBatching),"
               " or run the program under `phasescope run -- python serve.py`, which does it for you.")


def requests_hint(summary: dict[str, Any]) -> str | None:
    """What to do when a run has steps but no request records (NO_REQUESTS), else None."""
    steps = sum(p.get("steps") or 0 for p in summary.get("phases") or [])
    return NO_REQUESTS if steps and not (summary.get("requests") or {}).get("requests") else None


def fold(table: Table) -> Table:
    """Long cells wrap inside their column (a long name folds) instead of being cut with an ellipsis."""
    for col in table.columns:
        col.overflow = "fold"
    return table


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _s_as_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    """Per-phase step times, request latencies and probe health."""
    console = console or Console()
    console.print(f"[bold]phasescope[/] run [cyan]{summary['run_id']}[/] · {summary.get('model', '')}"
                  f" on {summary.get('device', '?')} → {summary['db']}")
    t = Table(title="Engine steps by phase, ms (CUDA-event time where timed, else host time)")
    for col in ("phase", "steps", "p50", "p95", "p99", "prefill tok", "decode tok", "timed"):
        t.add_column(col, justify="right" if col != "phase" else "left")
    for p in summary["phases"]:
        t.add_row(p["phase"], str(p["steps"]), _ms(p["p50_ms"]), _ms(p["p95_ms"]), _ms(p["p99_ms"]),
                  str(p["prefill_tokens"]), str(p["decode_tokens"]), str(p["gpu_timed"]))
    console.print(fold(t))
    r = summary["requests"]
    rt = Table(title="Requests, ms")
    for col in ("metric", "p50", "p95"):
        rt.add_column(col, justify="right" if col != "metric" else "left")
    for name in ("ttft", "tpot", "queue", "e2e"):
        rt.add_row(name.upper(), _s_as_ms(r.get(f"{name}_p50_s")), _s_as_ms(r.get(f"{name}_p95_s")))
    console.print(fold(rt))
    console.print("TTFT = first token - arrival; TPOT = decode time / (output tokens - 1)", style="dim")
    tps = r.get("output_tokens_per_s")
    console.print(f"requests: {r['requests']} ({r['finished']} finished) · output tokens: {r['output_tokens'] or 0}"
                  + (f" · {tps:.0f} tok/s" if tps else ""))
    hint = requests_hint(summary)
    if hint:
        console.print(f"[yellow]{hint}[/]")
    kv = summary.get("kv") or []
    if kv:
        kt = Table(title="Paged KV cache")
        for col in ("rank", "pages x size", "block use mean/max", "token use", "int. frag", "ext. frag",
                    "alloc pages/s"):
            kt.add_column(col, justify="right")
        for k in kv:
            kt.add_row(str(k["rank"]), f"{k['total_pages']} x {k['page_size']}",
                       f"{_pct(k['block_usage_mean'])} / {_pct(k['block_usage_max'])}", _pct(k["token_usage_mean"]),
                       _pct(k["internal_fragmentation_mean"]), _pct(k["external_fragmentation_mean"]),
                       "-" if k["pages_allocated_per_s"] is None else f"{k['pages_allocated_per_s']:.0f}")
        console.print(fold(kt))
        console.print("means over per-step snapshots; fragmentation = slack inside used pages (internal), "
                      "scattered free pages (external)", style="dim")
    px = summary.get("prefix") or {}
    if px.get("queried_tokens"):
        console.print(f"prefix cache: hit rate {_pct(px['hit_rate'])} ({px['hit_tokens']} of {px['queried_tokens']} "
                      f"prompt tokens) · {px['preemptions']} preemptions, {px['recomputed_tokens']} tokens recomputed"
                      f" · {px['evicted_blocks']} cached pages evicted")
    h = summary.get("probe") or {}
    if h:
        console.print(f"probe: {h['records_total']} records, {h['dropped_total']} dropped, {h['errors_total']} errors")
    if summary.get("read"):
        console.print(summary["read"], style="dim", markup=False, highlight=False)
    if summary.get("elapsed_s") is not None:
        console.print(f"took {summary['elapsed_s']:.1f} s (measured, model build included)")
