"""A sweep's result, shared by `phasescope sweep` (cli/sweep.py) and `explain` (cli/explain.py): every point's
figures measured from the store, the knee and the binding constraint (`measure`), then written as JSON, CSV and
a PNG plot (`write_outputs`; the plot only where matplotlib is installed) and printed on one screen
(`print_summary`). Imports nothing of the other CLI modules, so `sweep` -> `sweep_server` -> `explain` -> here
runs one way."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from typing import Any, Sequence


def measure(db: str, runs: Sequence[tuple[float, str]], slo: Any, target: float, sweep_id: str,
            runtime: str, con: Any = None, **extra: Any) -> dict[str, Any]:
    """Every point's figures (one run per offered rate, requests/s), the knee and the constraints at the evidence
    point, from the store in `db` (or the open connection `con`): what `sweep` and `explain` report."""
    from phasescope.agent.sidecar.store import Store
    from phasescope.analyzers import sweep as an
    from phasescope.analyzers.runinfo import read_run_info

    own = con is None
    con = Store.open_readonly(db) if own else con
    try:
        points = []
        for i, (rate, run_id) in enumerate(runs):
            points.append({"point": i, "rate_per_s": rate, "run_id": run_id, **an.point_metrics(con, run_id, slo)})
        knee = an.find_knee(points, target)
        at = an.evidence_point(points, target)
        cons = an.constraints_at(con, points[at]["run_id"], read_run_info(con, points[at]["run_id"]), slo) \
            if at is not None else []
    finally:
        if own:
            con.close()
    bind = an.binding(cons)
    return {"sweep_id": sweep_id, "db": db, "runtime": runtime, "slo": dataclasses.asdict(slo), "target": target,
            "points": points, "knee_point": knee, "knee_rate_per_s": None if knee is None else points[knee]["rate_per_s"],
            "evidence_point": at, "binding": None if bind is None else dataclasses.asdict(bind),
            "constraints": [dataclasses.asdict(c) for c in cons], **extra}


def write_outputs(result: dict[str, Any], out_dir: str) -> dict[str, str | None]:
    """JSON and CSV of the points (and the PNG plot when matplotlib is importable) in `out_dir`; their paths."""
    from phasescope.analyzers.findings import _clean
    from phasescope.analyzers.sweep import POINT_KEYS

    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"sweep-{result['sweep_id']}")
    with open(base + ".json", "w") as f:
        json.dump(_clean(result), f, indent=2, default=str)
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(POINT_KEYS), extrasaction="ignore")
        w.writeheader()
        for p in result["points"]:
            w.writerow(p)
    return {"json": base + ".json", "csv": base + ".csv", "png": plot_png(result, base + ".png")}


def plot_png(result: dict[str, Any], path: str) -> str | None:
    """Goodput and p99 TTFT / TPOT against offered load, the knee marked; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    pts = result["points"]
    x = [p["rate_per_s"] for p in pts]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax1.plot(x, [p["goodput_req_per_s"] for p in pts], "o-", label="goodput (req/s)")
    ax1.plot(x, x, ":", color="grey", label="offered")
    ax1.set_ylabel("requests/s")
    ax2.plot(x, [(p["ttft_p99_s"] or float("nan")) * 1e3 for p in pts], "o-", label="p99 TTFT (ms)")
    ax2.plot(x, [(p["tpot_p99_s"] or float("nan")) * 1e3 for p in pts], "s-", label="p99 TPOT (ms)")
    ax2.set_ylabel("ms")
    ax2.set_xlabel("offered load (requests/s, log scale)")
    ax2.set_xscale("log", base=2)
    if result["knee_rate_per_s"] is not None:
        b = result["binding"]
        for ax in (ax1, ax2):
            ax.axvline(result["knee_rate_per_s"], color="red", linestyle="--")
        ax1.annotate(f"knee {result['knee_rate_per_s']:g} req/s" + (f": {b['name']}" if b else ""),
                     (result["knee_rate_per_s"], ax1.get_ylim()[1] * 0.9), color="red")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def print_summary(result: dict[str, Any], paths: dict[str, str | None], console: Any) -> None:
    """One screen: a row per point, the knee, and the binding constraint with its figures and change."""
    from rich.table import Table

    t = Table(title=f"sweep {result['sweep_id']} (SLO {result['slo']}, target {result['target']:.0%})")
    for c in ("#", "rate/s", "reqs", "goodput/s", "attain", "survive", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
              "ITL p99 ms", "preempt"):
        t.add_column(c, justify="right")
    for p in result["points"]:
        mark = " *" if p["point"] == result["knee_point"] else ""
        t.add_row(f"{p['point']}{mark}", f"{p['rate_per_s']:g}", str(p["requests"]),
                  "-" if p["goodput_req_per_s"] is None else f"{p['goodput_req_per_s']:.2f}",
                  "-" if p["attainment"] is None else f"{p['attainment']:.0%}",
                  "-" if p["survival"] is None else f"{p['survival']:.0%}",
                  f"{_ms(p['ttft_p50_s'])}/{_ms(p['ttft_p99_s'])}", f"{_ms(p['tpot_p50_s'])}/{_ms(p['tpot_p99_s'])}",
                  _ms(p["itl_p99_s"]), str(p["preemptions"] or 0))
    console.print(t)
    knee = result["knee_rate_per_s"]
    at = result["points"][result["evidence_point"]] if result["evidence_point"] is not None else None
    console.print(f"[bold]knee[/]: {'none: the lowest rate misses the target' if knee is None else f'{knee:g} req/s (*)'}"
                  + (f"; constraint read at point {at['point']} ({at['rate_per_s']:g} req/s, attainment "
                     f"{at['attainment']:.0%})" if at and at["attainment"] is not None else ""))
    b = result["binding"]
    if b is None:
        console.print("[bold]binding constraint[/]: none of the known constraints shows in the per-step evidence")
    else:
        figs = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in b["figures"].items())
        console.print(f"[bold]binding constraint[/]: [red]{b['name']}[/] ({figs})")
        console.print(f"[bold]change[/]: {b['change']}")
        also = [c["name"] for c in result["constraints"] if c["binds"] and c["name"] != b["name"]]
        if also:
            console.print(f"also present: {', '.join(also)}")
    ow = result.get("outside_windows")
    if ow and ow["requests"]:
        where = ", ".join(f"{r['late_s']:+.3f} s " + ("from benchmark 0's start" if r["after_benchmark"] < 0 else
                                                        f"after benchmark {r['after_benchmark']}'s end")
                          for r in ow["rows"][:5])
        console.print(f"[yellow]{ow['requests']} request(s) of the run arrived outside every benchmark window[/] "
                      f"and are in no point ({where}{', ...' if ow['requests'] > 5 else ''})")
    console.print(f"wrote {paths['json']}, {paths['csv']}"
                  + (f", {paths['png']}" if paths.get("png") else " (no PNG: matplotlib is not installed; "
                     "`pip install matplotlib` for the plot)"))
