"""The read layer's base: the SQL helpers and the run and request basics every other read module builds on
(queries.py, dp.py, itl.py, sweep.py import from here; this imports none of them, so imports run one way)."""

from __future__ import annotations

from typing import Any

import duckdb

from ..records import derived

STEP_MS = "CASE WHEN isnan(gpu_ms) THEN host_ms ELSE gpu_ms END"

# With vLLM's async scheduling a step's host call returns before its GPU work ends: its output is handed out after
# the next step's host call, and the time between two outputs is the next step's period (start to start). An untimed
# step's time is then that period (never below its host time; its host time where no later step says): over the
# H100 matrix's CUDA-timed steps (tests/data/gpu) GPU time / this is 0.74-1.20 (median per run), GPU time / host
# time 1.0-5.2. Needs `WINDOW steps_w` (STEPS_WINDOW) over the steps of one source in start order.
ASYNC_STEP_MS = ("CASE WHEN NOT isnan(gpu_ms) THEN gpu_ms ELSE greatest(host_ms, coalesce("
                 "(lead(t.ts_ns, 2) OVER steps_w - lead(t.ts_ns, 1) OVER steps_w) / 1e6, host_ms)) END")
STEPS_WINDOW = " WINDOW steps_w AS (PARTITION BY t.source_id ORDER BY t.ts_ns, t.step_id)"
ASYNC_RUN_SQL = f"SELECT coalesce(any_value(async), false) FROM ({derived.ASYNC_RUNS}) WHERE run_id = ?"


def async_scheduling(con: duckdb.DuckDBPyConnection, run_id: str) -> bool:
    """Whether the run's engine scheduled asynchronously (vLLM's `async_scheduling` run label is True): its steps'
    times are then ASYNC_STEP_MS."""
    try:
        return bool(con.execute(ASYNC_RUN_SQL, [run_id]).fetchone()[0])
    except duckdb.Error:  # a store without run_info
        return False


def _run_filter(run_id: str | None, alias: str = "s") -> tuple[str, list[Any]]:
    if run_id is None:
        return "", []
    return f" AND {alias}.run_id = ?", [run_id]


def runs(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """Runs in the store, newest first."""
    rows = con.execute(
        """SELECT run_id, any_value(model), any_value(runtime), count(*) AS sources,
                  max(world_size), min(connected_ns)
           FROM sources WHERE runtime != 'sidecar' GROUP BY run_id ORDER BY min(connected_ns) DESC"""
    ).fetchall()
    keys = ("run_id", "model", "runtime", "sources", "world_size", "connected_ns")
    return [dict(zip(keys, r)) for r in rows]


def latest_run(con: duckdb.DuckDBPyConnection) -> str | None:
    r = runs(con)
    return r[0]["run_id"] if r else None


def request_summary(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> dict[str, Any]:
    """Request counts and TTFT / TPOT / queue / E2E percentiles (seconds)."""
    where = "" if run_id is None else "WHERE run_id = ?"
    params = [] if run_id is None else [run_id]
    row = con.execute(
        f"""SELECT count(*),
                   count(*) FILTER (WHERE status = 'finished'),
                   quantile_cont(ttft_s, [0.5, 0.95, 0.99]), quantile_cont(tpot_s, [0.5, 0.95, 0.99]),
                   quantile_cont(queue_s, [0.5, 0.95]), quantile_cont(e2e_s, [0.5, 0.95, 0.99]),
                   sum(output_tokens), sum(prompt_tokens),
                   (max(last_token_ns) - min(arrival_ns)) / 1e9,
                   count(*) FILTER (WHERE status = 'aborted'), sum(preemptions)
            FROM {_requests(con)} {where}""",
        params,
    ).fetchone()
    n, fin, ttft, tpot, queue, e2e, out_tok, in_tok, span, aborted, pre = row
    ttft, tpot, queue, e2e = (q or [None] * 3 for q in (ttft, tpot, queue, e2e))
    row = (n, fin, ttft[0], ttft[1], tpot[0], tpot[1], queue[0], queue[1], e2e[0], e2e[1], out_tok, in_tok, span,
           ttft[2], tpot[2], e2e[2], aborted, pre)
    keys = ("requests", "finished", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s",
            "queue_p50_s", "queue_p95_s", "e2e_p50_s", "e2e_p95_s", "output_tokens", "prompt_tokens", "span_s",
            "ttft_p99_s", "tpot_p99_s", "e2e_p99_s", "aborted", "preemptions")
    out = dict(zip(keys, row))
    span = out.get("span_s") or 0
    out["output_tokens_per_s"] = (out["output_tokens"] or 0) / span if span > 0 else None
    return out


def _stored(con: duckdb.DuckDBPyConnection) -> dict[str, str] | None:
    """The `requests` and `itl` views' rows read from the stored tables when nothing is left to derive
    (derived.stored: the same rows)."""
    try:
        return derived.stored(con)
    except duckdb.Error:  # a store without the derived tables (an older build's, or Parquet exports)
        return None


def _requests(con: duckdb.DuckDBPyConnection) -> str:
    """What to read the `requests` view's rows from: the stored rows when nothing is left to derive, else the view."""
    return (_stored(con) or {}).get("requests", "requests")


def run_labels(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, str]:
    """The run's labels (table run_info): config key/values, model geometry, GPU; {} when the file has none."""
    if not con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'run_info'").fetchone()[0]:
        return {}
    return dict(con.execute("SELECT key, value FROM run_info WHERE run_id = ? ORDER BY key", [run_id]).fetchall())


def _one(con: duckdb.DuckDBPyConnection, sql: str, params: dict[str, Any]) -> dict[str, Any]:
    cur = con.execute(sql, params)
    names = [d[0] for d in cur.description]
    row = cur.fetchone()
    return dict(zip(names, row)) if row else {n: None for n in names}


def _dicts(con: duckdb.DuckDBPyConnection, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    cur = con.execute(sql, params)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


def sql_text(text: str, params: dict[str, Any]) -> str:
    """`text` with its $parameters written in (longest names first), for a finding to cite."""
    for k, v in sorted(params.items(), key=lambda kv: -len(kv[0])):
        text = text.replace("$" + k, str(v))
    return text
