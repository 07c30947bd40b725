"""Named read queries over the store (aggregated in DuckDB; never whole tables).

Each takes a DuckDB connection and optional `run_id` and returns plain dicts.
Step time is the CUDA-event time when the step was timed, else the host time.
"""

from __future__ import annotations

from typing import Any

import duckdb

STEP_MS = "CASE WHEN isnan(gpu_ms) THEN host_ms ELSE gpu_ms END"


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


def phase_summary(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> list[dict[str, Any]]:
    """Per phase: step count, step-time percentiles (ms), tokens, and whether GPU-timed."""
    where, params = _run_filter(run_id)
    rows = con.execute(
        f"""SELECT phase, count(*) AS steps,
                   quantile_cont({STEP_MS}, 0.5) AS p50_ms,
                   quantile_cont({STEP_MS}, 0.95) AS p95_ms,
                   quantile_cont({STEP_MS}, 0.99) AS p99_ms,
                   sum(prefill_tokens) AS prefill_tokens,
                   sum(decode_tokens) AS decode_tokens,
                   count(*) FILTER (WHERE NOT isnan(gpu_ms)) AS gpu_timed
            FROM steps t JOIN sources s USING (source_id)
            WHERE true {where}
            GROUP BY phase ORDER BY phase""",
        params,
    ).fetchall()
    keys = ("phase", "steps", "p50_ms", "p95_ms", "p99_ms", "prefill_tokens", "decode_tokens", "gpu_timed")
    return [dict(zip(keys, r)) for r in rows]


def request_summary(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> dict[str, Any]:
    """Request counts and TTFT / TPOT / queue / E2E percentiles (seconds)."""
    where = "" if run_id is None else "WHERE run_id = ?"
    params = [] if run_id is None else [run_id]
    row = con.execute(
        f"""SELECT count(*),
                   count(*) FILTER (WHERE status = 'finished'),
                   quantile_cont(ttft_s, 0.5), quantile_cont(ttft_s, 0.95),
                   quantile_cont(tpot_s, 0.5), quantile_cont(tpot_s, 0.95),
                   quantile_cont(queue_s, 0.5), quantile_cont(queue_s, 0.95),
                   quantile_cont(e2e_s, 0.5), quantile_cont(e2e_s, 0.95),
                   sum(output_tokens), sum(prompt_tokens),
                   (max(last_token_ns) - min(arrival_ns)) / 1e9
            FROM requests {where}""",
        params,
    ).fetchone()
    keys = ("requests", "finished", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s",
            "queue_p50_s", "queue_p95_s", "e2e_p50_s", "e2e_p95_s", "output_tokens", "prompt_tokens", "span_s")
    out = dict(zip(keys, row))
    span = out.get("span_s") or 0
    out["output_tokens_per_s"] = (out["output_tokens"] or 0) / span if span > 0 else None
    return out


def probe_health(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> dict[str, Any]:
    """Latest counters of every source of the run, summed."""
    where, params = _run_filter(run_id)
    row = con.execute(
        f"""WITH last AS (
                SELECT h.*, row_number() OVER (PARTITION BY h.source_id ORDER BY h.ts_ns DESC) AS rn
                FROM probe_health h JOIN sources s USING (source_id) WHERE true {where})
            SELECT coalesce(sum(records_total), 0), coalesce(sum(dropped_total), 0),
                   coalesce(sum(errors_total), 0), coalesce(sum(gpu_unsampled_total), 0)
            FROM last WHERE rn = 1""",
        params,
    ).fetchone()
    return dict(zip(("records_total", "dropped_total", "errors_total", "gpu_unsampled_total"), row))


def kv_summary(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> list[dict[str, Any]]:
    """Per rank: paged-KV figures over the run's snapshots (means are per snapshot; churn per second)."""
    where, params = _run_filter(run_id)
    rows = con.execute(
        f"""SELECT k.rank, count(*) AS snapshots, any_value(page_size_tokens), max(total_pages),
                   avg(used_pages / total_pages), max(used_pages / total_pages),
                   avg(live_tokens / (total_pages * page_size_tokens)),
                   avg(CASE WHEN used_pages > 0 THEN 1 - live_tokens / (used_pages * page_size_tokens) END),
                   avg(CASE WHEN free_pages > 0 THEN 1 - largest_free_run / free_pages END),
                   (max(pages_allocated_total) - min(pages_allocated_total))
                       / nullif((max(k.ts_ns) - min(k.ts_ns)) / 1e9, 0),
                   max(kv_bytes), any_value(kv_dtype)
            FROM kv_snapshots k JOIN sources s USING (source_id)
            WHERE total_pages > 0 {where}
            GROUP BY k.rank ORDER BY k.rank""",
        params,
    ).fetchall()
    keys = ("rank", "snapshots", "page_size", "total_pages", "block_usage_mean", "block_usage_max",
            "token_usage_mean", "internal_fragmentation_mean", "external_fragmentation_mean",
            "pages_allocated_per_s", "kv_bytes_max", "kv_dtype")
    return [dict(zip(keys, r)) for r in rows]


def prefix_summary(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> dict[str, Any]:
    """Prefix-cache totals of the run (counters are per source, from 0) and the hit rate."""
    where, params = _run_filter(run_id)
    row = con.execute(
        f"""WITH last AS (
                SELECT p.source_id, max(queried_tokens_total) AS q, max(hit_tokens_total) AS h,
                       max(recomputed_tokens_total) AS r, max(evicted_blocks_total) AS e
                FROM prefix_counters p JOIN sources s USING (source_id) WHERE true {where}
                GROUP BY p.source_id)
            SELECT sum(q), sum(h), sum(r), sum(e) FROM last""",
        params,
    ).fetchone()
    queried, hit, recomputed, evicted = (int(v) if v is not None else None for v in row)
    preempted = con.execute(
        f"""SELECT count(*) FROM request_events r JOIN sources s USING (source_id)
            WHERE r.event = 'preempted' {where}""", params).fetchone()[0]
    return {"queried_tokens": queried, "hit_tokens": hit,
            "hit_rate": hit / queried if queried else None,
            "recomputed_tokens": recomputed, "evicted_blocks": evicted, "preemptions": preempted}


# --- named queries: the only reads the read API, the dashboard and `diagnose` may run ---

def step_timeline(con: duckdb.DuckDBPyConnection, run_id: str | None = None, bucket_s: float = 1.0,
                  since_s: float | None = None) -> list[dict[str, Any]]:
    """Per time bucket and phase: steps, median and p95 step time (ms), tokens; t_s from the run's start."""
    where, params = _run_filter(run_id)
    rows = con.execute(
        f"""WITH t AS (
                SELECT t.phase, {STEP_MS} AS ms, t.prefill_tokens, t.decode_tokens,
                       (t.ts_ns - min(t.ts_ns) OVER ()) / 1e9 AS t_s
                FROM steps t JOIN sources s USING (source_id) WHERE true {where})
            SELECT floor(t_s / ?) * ? AS t_s, phase, count(*), quantile_cont(ms, 0.5), quantile_cont(ms, 0.95),
                   sum(prefill_tokens), sum(decode_tokens)
            FROM t WHERE ? IS NULL OR t_s >= ?
            GROUP BY 1, 2 ORDER BY 1, 2""",
        params + [bucket_s, bucket_s, since_s, since_s],
    ).fetchall()
    keys = ("t_s", "phase", "steps", "p50_ms", "p95_ms", "prefill_tokens", "decode_tokens")
    return [dict(zip(keys, r)) for r in rows]


QUERIES: dict[str, Any] = {
    "runs": runs,
    "phase_summary": phase_summary,
    "request_summary": request_summary,
    "kv_summary": kv_summary,
    "prefix_summary": prefix_summary,
    "probe_health": probe_health,
    "step_timeline": step_timeline,
}


def run_named(con: duckdb.DuckDBPyConnection, name: str, params: dict[str, str | Any]) -> Any:
    """Run the named query `name`, converting string parameters by the function's annotations.

    Raises KeyError for an unknown query and ValueError for an unknown or malformed parameter.
    """
    import inspect

    fn = QUERIES[name]
    sig = inspect.signature(fn)
    kwargs: dict[str, Any] = {}
    for key, raw in params.items():
        p = sig.parameters.get(key)
        if p is None or key == "con":
            raise ValueError(f"query {name!r} takes no parameter {key!r}")
        ann = str(p.annotation)
        if isinstance(raw, str) and raw != "":
            if ann.startswith("float"):
                raw = float(raw)
            elif ann.startswith("int"):
                raw = int(raw)
        kwargs[key] = None if raw == "" else raw
    return fn(con, **kwargs)
