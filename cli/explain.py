"""`phasescope explain REPORT --db FILE`: the knee of a load sweep a load generator already ran, and why (issue 28).

Reads a finished guidellm report (its JSON: `guidellm run --output kind=json,path=...`), maps each benchmark
(one load point) to the store's rows by its time window (Unix seconds in the report; the store converts its
monotonic stamps with `sources.wall_minus_mono_ns`), copies each window into a run of its own labelled
`sweep_id`, `sweep_point`, `sweep_rate_per_s`, `sweep_knob` and `window_of` (agent/sidecar/windows.py; the
source run stays whole), then reports the points, the knee and the binding constraint exactly as `sweep`
does (cli/sweep.py `measure`). Writes into FILE, so FILE must be one no agent holds (stop the agent first).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from typing import Any

from .errors import CliError, UsageError
from .options import add_command


def read_guidellm(path: str) -> list[dict[str, Any]]:
    """The load points of a guidellm report (0.8 JSON): per benchmark its strategy, offered rate (requests/s;
    for a strategy without one, the rate it achieved: successful requests / duration), start and end (Unix ns)
    and request counts. Raises ValueError on a file that is not such a report."""
    try:
        with open(path, encoding="utf-8") as f:
            rep = json.load(f)
        benches = rep["benchmarks"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a guidellm JSON report ({exc!r})") from None
    out = []
    for i, b in enumerate(benches):
        try:
            strat = b["config"]["strategy"]
            t0, t1 = float(b["start_time"]), float(b["end_time"])
            reqs = b.get("requests") or {}
            ok = len(reqs.get("successful") or [])
            err = len(reqs.get("errored") or []) + len(reqs.get("incomplete") or [])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: benchmark {i} lacks {exc!r}") from None
        rate = strat.get("rate")
        if not rate:  # synchronous / throughput / concurrent: what it achieved
            rate = ok / (t1 - t0) if t1 > t0 else None
        if isinstance(rate, list):
            rate = rate[0]
        out.append({"benchmark": i, "strategy": strat.get("type_"), "rate_per_s": None if rate is None else float(rate),
                    "streams": strat.get("streams"), "start_ns": int(t0 * 1e9), "end_ns": int(t1 * 1e9),
                    "successful": ok, "not_successful": err})
    if not out:
        raise ValueError(f"{path}: the report holds no benchmark")
    return out


def source_run(con: Any, points: list[dict[str, Any]]) -> str:
    """The recorded run whose request arrivals fall most often in the points' windows (window copies and the
    sidecar's own run excluded). Raises ValueError when no request of any run falls in them."""
    where = " OR ".join(f"(r.ts_ns + s.wall_minus_mono_ns BETWEEN {int(p['start_ns'])} AND {int(p['end_ns'])})"
                        for p in points)
    row = con.execute(f"""SELECT s.run_id, count(*) AS n FROM request_events r JOIN sources s USING (source_id)
        WHERE r.event = 'arrival' AND s.runtime != 'sidecar' AND ({where})
          AND s.run_id NOT IN (SELECT run_id FROM run_info WHERE key = 'window_of')
        GROUP BY s.run_id ORDER BY n DESC, s.run_id LIMIT 1""").fetchone()
    if row is None:
        raise ValueError("no recorded request falls in the report's time windows: is it the store of that run?")
    return row[0]


def outside_windows(con: Any, run_id: str, points: list[dict[str, Any]], most: int = 20) -> dict[str, Any]:
    """The requests of `run_id` whose arrival falls in no benchmark window (a point holds none of them; said, not
    dropped): their count, and for up to `most` of them the benchmark they follow (-1: before the first) and how
    long after its end they arrived (s; before the first: a negative figure, seconds before its start). A load
    generator's window is its own clock's span: guidellm 0.8.1 at 8-16 req/s ended a benchmark before the server
    saw its last request arrive (CI run of d4d037d: 59 of 60)."""
    spans = sorted((int(p["start_ns"]), int(p["end_ns"]), i) for i, p in enumerate(points))
    rows = con.execute("""SELECT r.request_id, min(r.ts_ns + s.wall_minus_mono_ns) AS t FROM request_events r
        JOIN sources s USING (source_id) WHERE s.run_id = ? AND r.event = 'arrival' GROUP BY r.request_id
        ORDER BY t, r.request_id""", [run_id]).fetchall()
    out = []
    for rid, t in rows:
        if any(a <= t < b for a, b, _ in spans):  # split_run's [start, end)
            continue
        before = [(b, i) for a, b, i in spans if b <= t]
        if before:
            b, i = max(before)
            out.append({"request_id": rid, "after_benchmark": i, "late_s": (t - b) / 1e9})
        else:
            out.append({"request_id": rid, "after_benchmark": -1, "late_s": (t - spans[0][0]) / 1e9})
    return {"requests": len(out), "rows": out[:most]}


def explain_report(db: str, report: str, slo: Any, target: float = 0.9, run_id: str | None = None,
                   sweep_id: str | None = None, labels: dict[str, Any] | None = None) -> dict[str, Any]:
    """Split the run the report's benchmarks hit (`run_id`, or the one `source_run` finds) into one run per
    benchmark, then `measure` them. `sweep_id` defaults to a hash of the report and the run; when that sweep's
    runs exist already they are read as they are (explaining one report twice copies nothing twice)."""
    import duckdb

    from phasescope.agent.sidecar.windows import split_run, window_runs

    from .sweep import measure

    points = read_guidellm(report)
    if any(p["rate_per_s"] is None for p in points):
        raise ValueError(f"{report}: a benchmark has no rate and no duration")
    con = duckdb.connect(db)
    try:
        run_id = run_id or source_run(con, points)
        if sweep_id is None:
            with open(report, "rb") as f:
                sweep_id = "gl-" + hashlib.sha256(f.read() + run_id.encode()).hexdigest()[:10]
        have = {r: lab for r, lab in window_runs(con).items() if lab.get("sweep_id") == sweep_id}
        runs = sorted(have, key=lambda r: int(have[r]["sweep_point"]))
        if not runs:
            runs = split_run(con, run_id, [
                (p["start_ns"], p["end_ns"], f"{run_id}@{sweep_id}.{i}",
                 {"sweep_id": sweep_id, "sweep_point": i, "sweep_rate_per_s": p["rate_per_s"],
                  "sweep_knob": p["strategy"], "sweep_report": report, **(labels or {})})
                for i, p in enumerate(points)])
        result = measure(db, [(p["rate_per_s"], r) for p, r in zip(points, runs)], slo, target, sweep_id,
                         runtime="server", con=con, source_run=run_id, report=report,
                         benchmarks=points, outside_windows=outside_windows(con, run_id, points))
    finally:
        con.close()
    return result


def cmd_explain(args: argparse.Namespace) -> int:
    """explain a load sweep a load generator already ran (its report) from the store

    Import a finished guidellm JSON report, map each benchmark to the store's rows by its time window (one
    labelled run per load point, copied; the recorded run stays whole), and report the points, the SLO knee
    and the constraint that binds there, as `phasescope sweep` does. --db must be a file no agent holds."""
    from rich.console import Console

    from phasescope.analyzers.sweep import Slo

    from .sweep import print_summary, write_outputs

    import os

    import duckdb

    if not 0 < args.target <= 1:
        raise UsageError(f"--target must be in (0, 1], got {args.target}")
    if not os.path.isfile(args.db):
        raise CliError(f"no such file {args.db!r}; give the DuckDB file that recorded the server")
    try:
        slo = Slo(ttft_s=args.ttft_slo, tpot_s=args.tpot_slo, e2e_s=args.e2e_slo)
        result = explain_report(args.db, args.report, slo, args.target, run_id=args.run)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    except duckdb.IOException as exc:  # an agent holds it
        raise CliError(f"cannot open {args.db}: {str(exc).splitlines()[0]} (stop the agent first)") from None
    paths = write_outputs(result, args.out)
    print_summary(result, paths, Console())
    return 0


def add_commands(sub: Any) -> None:
    """Register `explain` on an argparse subparsers object."""
    s = add_command(sub, cmd_explain)
    s.add_argument("report", help="a finished guidellm JSON report (guidellm run --output kind=json,path=FILE)")
    s.add_argument("--db", required=True, help="DuckDB file that recorded the server during the report's run")
    s.add_argument("--run", default=None, help="the recorded run (default: the one whose requests fill the windows)")
    s.add_argument("--ttft-slo", type=float, default=2.5, help="TTFT SLO, s (default: %(default)s)")
    s.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT SLO, s (default: %(default)s)")
    s.add_argument("--e2e-slo", type=float, default=None, help="end-to-end SLO, s (default: none)")
    s.add_argument("--target", type=float, default=0.9, help="SLO attainment the knee keeps (default: %(default)s)")
    s.add_argument("--out", default=".", help="folder for the JSON, CSV and PNG (default: %(default)s)")
