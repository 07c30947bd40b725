"""`phasescope explain REPORT --db FILE`: the knee of a load sweep a load generator already ran, and why (issue 28).

Reads a finished load generator's report (cli/reports.py: guidellm's JSON report, vLLM `bench serve` results,
or AIPerf's artifacts), maps each benchmark (one load point) to the store's rows by its time window (Unix time;
the store converts its monotonic stamps with `sources.wall_minus_mono_ns`; a vLLM result's window is refined to
its client's span when that ran on the store's host, `refine_windows`), copies each window into a run of its own
labelled `sweep_id`, `sweep_point`, `sweep_rate_per_s`, `sweep_knob`, `sweep_report_kind` and `window_of`
(agent/sidecar/windows.py; the source run stays whole), then reports the points, the knee and the binding
constraint exactly as `sweep` does (cli/sweep_result.py `measure`). Writes into FILE, so FILE must be one no agent
holds (stop the agent first).
"""

from __future__ import annotations

import argparse
import hashlib
import os
from typing import Any

from .errors import CliError, UsageError
from .options import add_command
from .reports import KINDS, KINDS_TEXT, read_guidellm, read_report  # noqa: F401 (read_guidellm: its old home)
from .sweep_result import measure

SAME_CLOCK_SLACK_S = 2.0  # a client span further than this outside its `date` window is another host's clock


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


def refine_windows(con: Any, run_id: str, points: list[dict[str, Any]]) -> None:
    """Where a point carries its client's span ("client_mono_ns", vLLM --save-detailed: CLOCK_MONOTONIC ns of
    the machine that ran the load), and that span, read through `run_id`'s `wall_minus_mono_ns`, lies within its
    `date` window (widened by SAME_CLOCK_SLACK_S), the client ran on the store's host: the window becomes that
    span, to the nanosecond ("window": "client-clock"). Otherwise the `date` window stays, and the point says
    why under "window_note". Changes `points` in place."""
    spans = [r[0] for r in con.execute("""SELECT DISTINCT wall_minus_mono_ns FROM sources
        WHERE run_id = ? AND runtime != 'sidecar'""", [run_id]).fetchall()]
    for p in points:
        mono = p.get("client_mono_ns")
        if not mono:
            continue
        if not spans:
            p["window_note"] = f"run {run_id} has no source with a clock offset"
            continue
        off = sorted(spans)[len(spans) // 2]  # the run's processes share one host clock: their offsets agree to ms
        a, b = mono[0] + off, mono[1] + off
        slack = int(SAME_CLOCK_SLACK_S * 1e9)
        if p["start_ns"] - slack <= a and b <= p["end_ns"] + slack:
            p["date_window_ns"] = [p["start_ns"], p["end_ns"]]
            p["start_ns"], p["end_ns"], p["window"] = a, b + 1, "client-clock"
        else:
            p["window_note"] = (f"the client's span is {(a - p['start_ns']) / 1e9:+.1f} s from its date window: "
                                "another host's clock; the date window is used")


def check_windows(report: str, points: list[dict[str, Any]]) -> None:
    """ValueError when two points' windows overlap (a request in both could not be told apart)."""
    order = sorted(points, key=lambda p: p["start_ns"])
    for p, q in zip(order, order[1:]):
        if q["start_ns"] < p["end_ns"]:
            raise ValueError(f"{report}: the windows of benchmarks {p['benchmark']} and {q['benchmark']} overlap by "
                             f"{(p['end_ns'] - q['start_ns']) / 1e9:.3f} s ({p['window']}, {q['window']} windows); "
                             "explain cannot tell their requests apart")


def explain_report(db: str, report: str, slo: Any, target: float = 0.9, run_id: str | None = None,
                   sweep_id: str | None = None, labels: dict[str, Any] | None = None,
                   kind: str | None = None) -> dict[str, Any]:
    """Split the run the report's benchmarks hit (`run_id`, or the one `source_run` finds) into one run per
    benchmark, then `measure` them. `kind`: the report's (reports.KINDS), None: told by its content. `sweep_id`
    defaults to a hash of the report and the run; when that sweep's runs exist already they are read as they are
    (explaining one report twice copies nothing twice)."""
    import duckdb

    from phasescope.agent.sidecar.windows import split_run, window_runs


    kind, points = read_report(report, kind)
    if any(p["rate_per_s"] is None for p in points):
        raise ValueError(f"{report}: a benchmark has no rate and no duration")
    con = duckdb.connect(db)
    try:
        run_id = run_id or source_run(con, points)
        refine_windows(con, run_id, points)
        check_windows(report, points)
        if sweep_id is None:
            sweep_id = {"guidellm": "gl-", "vllm": "vl-", "aiperf": "ap-"}[kind] + _digest(report, run_id)
        have = {r: lab for r, lab in window_runs(con).items() if lab.get("sweep_id") == sweep_id}
        runs = sorted(have, key=lambda r: int(have[r]["sweep_point"]))
        if not runs:
            runs = split_run(con, run_id, [
                (p["start_ns"], p["end_ns"], f"{run_id}@{sweep_id}.{i}",
                 {"sweep_id": sweep_id, "sweep_point": i, "sweep_rate_per_s": p["rate_per_s"],
                  "sweep_knob": p["strategy"], "sweep_report": report, "sweep_report_kind": kind, **(labels or {})})
                for i, p in enumerate(points)])
        result = measure(db, [(p["rate_per_s"], r) for p, r in zip(points, runs)], slo, target, sweep_id,
                         runtime="server", con=con, source_run=run_id, report=report, report_kind=kind,
                         benchmarks=points, outside_windows=outside_windows(con, run_id, points))
    finally:
        con.close()
    return result


def _digest(report: str, run_id: str) -> str:
    """10 hex digits of sha256 over the report's bytes (a folder: its files', in path order) and `run_id`."""
    h = hashlib.sha256()
    for path in sorted(os.path.join(r, n) for r, _d, ns in os.walk(report) for n in ns) \
            if os.path.isdir(report) else [report]:
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(run_id.encode())
    return h.hexdigest()[:10]


def cmd_explain(args: argparse.Namespace) -> int:
    """explain a load sweep a load generator already ran (its report) from the store

    Import a finished guidellm JSON report, vLLM `bench serve` results (a --save-result/--append-result file,
    or a `vllm bench sweep serve` folder) or AIPerf's artifacts (its --artifact-dir), map each benchmark to the
    store's rows by its time window (one labelled run per load point, copied; the recorded run stays whole),
    and report the points, the SLO knee and the constraint that binds there, as `phasescope sweep` does. A vLLM
    result's window is its `date` (local time, to the second) less its `duration`, widened by a second each
    side, unless --save-detailed's per-request start times are on the store's host clock. An AIPerf run's window
    is its records' span (profile_export.jsonl). --db must be a file no agent holds."""
    from rich.console import Console

    from phasescope.analyzers.sweep import Slo

    from .sweep_result import print_summary, write_outputs

    import duckdb

    if not 0 < args.target <= 1:
        raise UsageError(f"--target must be in (0, 1], got {args.target}")
    if not os.path.isfile(args.db):
        raise CliError(f"no such file {args.db!r}; give the DuckDB file that recorded the server")
    try:
        slo = Slo(ttft_s=args.ttft_slo, tpot_s=args.tpot_slo, e2e_s=args.e2e_slo)
        result = explain_report(args.db, args.report, slo, args.target, run_id=args.run, kind=args.format)
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
    s.add_argument("report", help="a finished guidellm JSON report (guidellm run --output kind=json,path=FILE), "
                   "or vLLM `bench serve` results: a --save-result or --append-result file (--save-detailed gives "
                   "exact windows when it ran on this host), a `vllm bench sweep serve` experiment folder, or "
                   "AIPerf's --artifact-dir folder (or one run's profile_export_aiperf.json)")
    s.add_argument("--format", choices=KINDS, default=None,
                   help="the report's kind (default: told from its content)")
    s.add_argument("--db", required=True, help="DuckDB file that recorded the server during the report's run")
    s.add_argument("--run", default=None, help="the recorded run (default: the one whose requests fill the windows)")
    s.add_argument("--ttft-slo", type=float, default=2.5, help="TTFT SLO, s (default: %(default)s)")
    s.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT SLO, s (default: %(default)s)")
    s.add_argument("--e2e-slo", type=float, default=None, help="end-to-end SLO, s (default: none)")
    s.add_argument("--target", type=float, default=0.9, help="SLO attainment the knee keeps (default: %(default)s)")
    s.add_argument("--out", default=".", help="folder for the JSON, CSV and PNG (default: %(default)s)")
