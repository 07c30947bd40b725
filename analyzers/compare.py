"""Experiments: two labelled runs side by side, and the variables that differ between them.

Change one variable per round (tuning-knowledge.md § Experiment discipline): `compare` warns when the
runs' labels differ in more than one key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import duckdb

from phasescope.agent.read.queries import latest_run

from .queries import PREEMPTIONS, one
from .runinfo import read_run_info

METRICS_SQL = """SELECT count(*) AS requests, count(*) FILTER (WHERE status = 'finished') AS finished,
           count(*) FILTER (WHERE status = 'aborted') AS aborted,
           quantile_cont(ttft_s, 0.5) AS ttft_p50_s, quantile_cont(ttft_s, 0.95) AS ttft_p95_s,
           quantile_cont(tpot_s, 0.5) AS tpot_p50_s, quantile_cont(tpot_s, 0.95) AS tpot_p95_s,
           sum(output_tokens) / nullif((max(last_token_ns) - min(arrival_ns)) / 1e9, 0) AS output_tokens_per_s
    FROM requests WHERE run_id = $run"""

# metric -> True when higher is better
METRICS = {"ttft_p50_s": False, "ttft_p95_s": False, "tpot_p50_s": False, "tpot_p95_s": False,
           "output_tokens_per_s": True, "survival_rate": True, "preemptions": False, "aborted": False,
           "oom_total": False}


@dataclass(frozen=True)
class RunRef:
    db: str
    run_id: str


def resolve(arg: str, db: str | None = None) -> RunRef:
    """`FILE` (its latest run), `FILE::RUN`, or a run id in `db`."""
    path, _, run = arg.partition("::")
    if os.path.exists(path):
        if not run:
            con = duckdb.connect(path, read_only=True)
            try:
                run = latest_run(con)
            finally:
                con.close()
            if run is None:
                raise ValueError(f"{path}: no runs")
        return RunRef(path, run)
    if db is None:
        raise ValueError(f"{arg!r} is not a file; give --db FILE to look it up as a run id")
    return RunRef(db, arg)


def run_metrics(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, Any]:
    """TTFT / TPOT percentiles (s), output throughput (tokens/s), survival, preemptions, OOMs."""
    m = one(con, METRICS_SQL, run_id)
    if not m["requests"]:
        known = con.execute("SELECT count(*) FROM sources WHERE run_id = ?", [run_id]).fetchone()[0]
        if not known:
            raise ValueError(f"no run {run_id!r}")
    m["survival_rate"] = m["finished"] / m["requests"] if m["requests"] else None
    m["preemptions"] = one(con, PREEMPTIONS, run_id)["preemptions"]
    labels = read_run_info(con, run_id)
    oom = labels.get("oom_total")
    m["oom_total"] = int(float(oom)) if oom is not None else None
    return m


def compare(a: RunRef, b: RunRef) -> dict[str, Any]:
    """Metrics of both runs, their relative change, the labels that differ and a warning if > 1 does."""
    out: dict[str, Any] = {}
    for key, ref in (("a", a), ("b", b)):
        con = duckdb.connect(ref.db, read_only=True)
        try:
            out[key] = {"db": ref.db, "run_id": ref.run_id, "metrics": run_metrics(con, ref.run_id),
                        "labels": read_run_info(con, ref.run_id)}
        finally:
            con.close()
    la, lb = out["a"]["labels"], out["b"]["labels"]
    out["differs"] = {k: (la.get(k), lb.get(k)) for k in sorted(set(la) | set(lb)) if la.get(k) != lb.get(k)}
    changes = {}
    for k in METRICS:
        x, y = out["a"]["metrics"].get(k), out["b"]["metrics"].get(k)
        changes[k] = (y - x) / x if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x else None
    out["change"] = changes
    n = len(out["differs"])
    out["warning"] = (f"{n} variables differ ({', '.join(out['differs'])}): the effect cannot be attributed to "
                      "one of them; change one variable per round" if n > 1 else
                      "the runs carry no differing labels: label runs with the config values you vary"
                      if n == 0 else None)
    return out
