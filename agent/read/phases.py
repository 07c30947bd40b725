"""The Phases page's reads from the ten-second step rollup (records/steprollup.py), for `quantiles="approx"`.

Counts and token sums are exact; step-time quantiles are within steprollup.REL_ERROR (0.55 %) of the exact
`quantile_cont` (tests/agent/test_steprollup.py). Each returns None when the rollup cannot answer exactly that
(no rollup, rows deleted below its watermark, no run named, a window or bucket that is not a multiple of its
10 s cells, a threshold other than the one it was classed by): the caller then reads the raw rows.
"""

from __future__ import annotations

import math
from typing import Any

from ..records import steprollup

CLASSES = {1: "decode only", 2: "with short prefill", 3: "with long prefill"}
APPROX_NOTE = (f"step-time quantiles read from 10-second histograms: within {steprollup.REL_ERROR:.2%} of the "
               "exact value; counts and token sums exact")


def _whole(x: float | None) -> bool:
    """None, or a multiple of the rollup's cell (t >= x <=> cell start >= x for such x)."""
    return x is None or (math.isfinite(x) and x / steprollup.CELL_S == math.floor(x / steprollup.CELL_S))


def _window(since_s: float | None, until_s: float | None) -> str | None:
    """WHERE text over `sec` for a window of whole cells; None for another one."""
    if not (_whole(since_s) and _whole(until_s)):
        return None
    where = "true"
    if since_s is not None and since_s > 0:
        where += f" AND sec >= {int(since_s)}"
    if until_s is not None:
        where += f" AND sec < {int(until_s)}"
    return where


def _hists(rows: list[tuple], width: int) -> dict[tuple, dict[str, Any]]:
    """Rows (group..., bin, steps, ms_min, ms_max, prefill, decode, gpu_timed) sorted by group and bin ->
    per group: its histogram and sums."""
    out: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        g = out.setdefault(tuple(r[:width]), {"hist": [], "steps": 0, "prefill": 0, "decode": 0, "gpu": 0})
        b, n, lo, hi, pre, dec, gpu = r[width:]
        g["hist"].append((b, int(n), lo, hi))
        g["steps"] += int(n)
        g["prefill"] += int(pre or 0)
        g["decode"] += int(dec or 0)
        g["gpu"] += int(gpu or 0)
    return out


_AGG = ("bin, sum(steps), min(ms_min), max(ms_max), CAST(sum(prefill_tokens) AS HUGEINT), "
        "CAST(sum(decode_tokens) AS HUGEINT), sum(gpu_timed)")


def _groups(con: Any, run_id: str, keys: list[str], where: str = "true") -> dict[tuple, dict[str, Any]] | None:
    """The run's rollup cells in `where` grouped by `keys` (columns, or `expression AS name`) and step-time bin ->
    per group: its histogram and sums (`_hists`); None when the rollup cannot answer (steprollup.usable)."""
    wm = steprollup.usable(con, run_id)
    if wm is None:
        return None
    names = ", ".join(k.rpartition(" AS ")[2] for k in keys)
    rows = con.execute(f"SELECT {', '.join(keys)}, {_AGG} FROM ({steprollup.cells('$run', wm)}) WHERE {where} "
                       f"GROUP BY {names}, bin ORDER BY {names}, bin", {"run": run_id}).fetchall()
    return _hists(rows, len(keys))


def phase_summary(con: Any, run_id: str | None) -> list[dict[str, Any]] | None:
    groups = _groups(con, run_id, ["phase"]) if run_id is not None else None
    if groups is None:
        return None
    out = []
    for (phase,), g in groups.items():
        p50, p95, p99 = steprollup.quantiles(g["hist"], [0.5, 0.95, 0.99])
        out.append({"phase": phase, "steps": g["steps"], "p50_ms": p50, "p95_ms": p95, "p99_ms": p99,
                    "prefill_tokens": g["prefill"], "decode_tokens": g["decode"], "gpu_timed": g["gpu"]})
    return out


def step_timeline(con: Any, run_id: str | None, bucket_s: float, since_s: float | None,
                  until_s: float | None) -> list[dict[str, Any]] | None:
    where = _window(since_s, until_s)
    if where is None or run_id is None or bucket_s < steprollup.CELL_S or not _whole(bucket_s):
        return None
    b = int(bucket_s)
    groups = _groups(con, run_id, [f"sec // {b} * {b} AS k", "phase"], where)
    if groups is None:
        return None
    out = []
    for (k, phase), g in groups.items():
        p50, p95 = steprollup.quantiles(g["hist"], [0.5, 0.95])
        out.append({"t_s": float(k), "phase": phase, "steps": g["steps"], "p50_ms": p50, "p95_ms": p95,
                    "prefill_tokens": g["prefill"], "decode_tokens": g["decode"]})
    return out


def interference(con: Any, run_id: str | None, long_prefill_tokens: int, since_s: float | None,
                 until_s: float | None) -> list[dict[str, Any]] | None:
    where = _window(since_s, until_s)
    if where is None or run_id is None or long_prefill_tokens != steprollup.LONG_PREFILL_TOKENS:
        return None
    groups = _groups(con, run_id, ["cls"], f"{where} AND cls > 0")
    if groups is None:
        return None
    out = []
    for (cls,), g in groups.items():
        p50, p95 = steprollup.quantiles(g["hist"], [0.5, 0.95])
        out.append({"class": CLASSES[cls], "steps": g["steps"], "p50_ms": p50, "p95_ms": p95,
                    "prefill_tokens_mean": g["prefill"] / g["steps"], "decode_tokens": g["decode"]})
    return sorted(out, key=lambda r: r["class"])
