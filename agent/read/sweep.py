"""A load sweep's points as the store holds them (issue 28): which sweeps exist, and each point's figures.

A sweep point is one run labelled `sweep_id`, `sweep_point` and `sweep_rate_per_s` (table run_info, written
by `phasescope sweep`). The figures per point (definitions in analyzers/sweep.py, which builds on this):
goodput = good requests / the point's duration (first arrival to last token), attainment = good / all,
survival = finished / all, latency percentiles in seconds. Read-only; the knee and the binding constraint
are the analyzers' (analyzers/sweep.py).
"""

from __future__ import annotations

from typing import Any

import duckdb

from .itl import attribution
from .base import _dicts, _one, request_summary

GOOD_SQL = """SELECT count(*) AS requests, count(*) FILTER (WHERE status = 'finished') AS finished,
           count(*) FILTER (WHERE status = 'finished' AND ttft_s <= $ttft AND coalesce(tpot_s, 0) <= $tpot
                            AND e2e_s <= $e2e) AS good,
           (max(last_token_ns) - min(arrival_ns)) / 1e9 AS duration_s,
           count(*) / nullif((max(arrival_ns) - min(arrival_ns)) / 1e9, 0) AS achieved_rate_per_s
    FROM requests WHERE run_id = $run"""

# one row per sweep point (run): its sweep, index and offered rate, from the run's labels
POINTS_SQL = """SELECT run_id, max(value) FILTER (WHERE key = 'sweep_id') AS sweep_id,
           max(TRY_CAST(value AS INTEGER)) FILTER (WHERE key = 'sweep_point') AS point,
           max(TRY_CAST(value AS DOUBLE)) FILTER (WHERE key = 'sweep_rate_per_s') AS rate_per_s
    FROM run_info WHERE key IN ('sweep_id', 'sweep_point', 'sweep_rate_per_s') GROUP BY run_id
    HAVING sweep_id IS NOT NULL AND rate_per_s IS NOT NULL"""

SWEEPS_SQL = f"""WITH p AS ({POINTS_SQL})
    SELECT p.sweep_id, count(*) AS points, min(p.rate_per_s) AS rate_min_per_s, max(p.rate_per_s) AS rate_max_per_s,
           any_value(s.runtime) AS runtime, any_value(s.model) AS model, min(s.connected_ns) AS started_ns
    FROM p LEFT JOIN (SELECT run_id, any_value(runtime) AS runtime, any_value(model) AS model,
                             min(connected_ns) AS connected_ns
                      FROM sources WHERE runtime != 'sidecar' GROUP BY run_id) s USING (run_id)
    GROUP BY p.sweep_id ORDER BY started_ns DESC NULLS LAST, p.sweep_id"""

PERCENTILES = ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "tpot_p50_s", "tpot_p95_s", "tpot_p99_s",
               "e2e_p50_s", "e2e_p99_s", "queue_p50_s", "preemptions")


def _has_run_info(con: duckdb.DuckDBPyConnection) -> bool:
    return bool(con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'run_info'").fetchone()[0])


def _big(v: float | None) -> float:
    return 1e18 if v is None else float(v)


def sweeps(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """The sweeps in the store, newest first: sweep_id, points, lowest / highest offered rate (requests/s),
    runtime, model, started_ns; [] when the store holds none."""
    return _dicts(con, SWEEPS_SQL, {}) if _has_run_info(con) else []


def point_metrics(con: duckdb.DuckDBPyConnection, run_id: str, ttft_s: float | None, tpot_s: float | None,
                  e2e_s: float | None = None) -> dict[str, Any]:
    """One point's figures: request counts, goodput (req/s), attainment, survival, TTFT/TPOT/E2E/queue and ITL
    percentiles (s), preemptions. SLOs in seconds; None: not an objective."""
    g = _one(con, GOOD_SQL, {"run": run_id, "ttft": _big(ttft_s), "tpot": _big(tpot_s), "e2e": _big(e2e_s)})
    r = request_summary(con, run_id)
    out = {k: g[k] for k in ("requests", "finished", "good", "duration_s", "achieved_rate_per_s")}
    n, dur = g["requests"] or 0, g["duration_s"] or 0
    out["goodput_req_per_s"] = g["good"] / dur if dur > 0 else None
    out["attainment"] = g["good"] / n if n else None
    out["survival"] = g["finished"] / n if n else None
    for k in PERCENTILES:
        out[k] = r.get(k)
    itl = attribution(con, run_id)  # a run without token gaps gives None: no figure
    for q in ("p50", "p99"):
        v = itl.get(f"itl_{q}_ms")
        out[f"itl_{q}_s"] = None if v is None else v / 1e3
    return out


def sweep_points(con: duckdb.DuckDBPyConnection, sweep_id: str, ttft_slo_s: float | None = None,
                 tpot_slo_s: float | None = None, e2e_slo_s: float | None = None) -> list[dict[str, Any]]:
    """Every point of one sweep by offered rate: point, rate_per_s, run_id and `point_metrics` at the SLOs."""
    if not _has_run_info(con):
        return []
    rows = _dicts(con, f"SELECT * FROM ({POINTS_SQL}) WHERE sweep_id = $sweep ORDER BY rate_per_s, point",
                  {"sweep": sweep_id})
    return [{"point": r["point"], "rate_per_s": r["rate_per_s"], "run_id": r["run_id"],
             **point_metrics(con, r["run_id"], ttft_slo_s, tpot_slo_s, e2e_slo_s)} for r in rows]
