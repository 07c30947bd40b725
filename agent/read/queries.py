"""Named read queries over the store (aggregated in DuckDB; never whole tables).

Each takes a DuckDB connection and optional `run_id` and returns plain dicts.
Step time is the CUDA-event time when the step was timed, else the host time.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import duckdb

from ..records.events import VLLM_OUTPUT_ITERATIONS
from . import kvreads, phases
from . import base, dp, sweep
from .base import (  # noqa: F401 (the named queries and helpers other modules and tests read from here)
    STEP_MS, _dicts, _one, _run_filter, latest_run, request_summary, run_labels, runs, sql_text,
)
from .itl import attribution
from .thresholds import T


def _approx(quantiles: str) -> bool:
    if quantiles not in ("exact", "approx"):
        raise ValueError(f"quantiles must be 'exact' or 'approx', not {quantiles!r}")
    return quantiles == "approx"


def phase_summary(con: duckdb.DuckDBPyConnection, run_id: str | None = None,
                  quantiles: str = "exact") -> list[dict[str, Any]]:
    """Per phase: step count, step-time percentiles (ms), tokens, and whether GPU-timed. `quantiles="approx"`:
    the percentiles from the per-second rollup where it can answer (agent/read/phases.py: within 0.55 %)."""
    if _approx(quantiles):
        out = phases.phase_summary(con, run_id)
        if out is not None:
            return out
    where, params = _run_filter(run_id)
    rows = con.execute(
        f"""SELECT phase, count(*) AS steps,
                   -- one sort for three quantiles: 3x faster than three calls on 10M rows
                   quantile_cont({STEP_MS}, [0.5, 0.95, 0.99]) AS q,
                   sum(prefill_tokens) AS prefill_tokens,
                   sum(decode_tokens) AS decode_tokens,
                   count(*) FILTER (WHERE NOT isnan(gpu_ms)) AS gpu_timed
            FROM steps t JOIN sources s USING (source_id)
            WHERE true {where}
            GROUP BY phase ORDER BY phase""",
        params,
    ).fetchall()
    keys = ("phase", "steps", "p50_ms", "p95_ms", "p99_ms", "prefill_tokens", "decode_tokens", "gpu_timed")
    return [dict(zip(keys, (r[0], r[1], *r[2], *r[3:]))) for r in rows]


def probe_health(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> dict[str, Any]:
    """Latest counters of every source of the run, summed."""
    where, params = _run_filter(run_id)
    row = con.execute(
        f"""WITH last AS (
                SELECT h.*, row_number() OVER (PARTITION BY h.source_id ORDER BY h.ts_ns DESC) AS rn
                FROM probe_health h JOIN sources s USING (source_id) WHERE true {where})
            SELECT coalesce(sum(records_total), 0), coalesce(sum(dropped_total), 0),
                   coalesce(sum(errors_total), 0), coalesce(sum(gpu_unsampled_total), 0),
                   coalesce(sum(gpu_timed_total), 0), min(gpu_sample_rate), coalesce(sum(captured_total), 0)
            FROM last WHERE rn = 1""",
        params,
    ).fetchone()
    return dict(zip(("records_total", "dropped_total", "errors_total", "gpu_unsampled_total", "gpu_timed_total",
                     "gpu_sample_rate_min", "captured_total"), row))


def kv_summary(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> list[dict[str, Any]]:
    """Per rank: paged-KV figures over the run's snapshots (means are per snapshot; churn per second).
    From the ten-second KV rollup where it answers (agent/read/kvreads.py: the same figures)."""
    out = kvreads.kv_summary(con, run_id)
    if out is not None:
        return out
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
    return [dict(zip(kvreads.KV_SUMMARY_KEYS, r)) for r in rows]


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
        f"""SELECT CAST(coalesce(sum(preemptions), 0) AS BIGINT) FROM {base._requests(con)} s WHERE true {where}""",
        params).fetchone()[0]
    return {"queried_tokens": queried, "hit_tokens": hit,
            "hit_rate": hit / queried if queried else None,
            "recomputed_tokens": recomputed, "evicted_blocks": evicted, "preemptions": preempted}


# --- named queries: the only reads the read API, the dashboard and `diagnose` may run ---

def _window(run_id: str | None, since_s: float | None, until_s: float | None,
            table: str = "t") -> tuple[str, str, dict[str, Any]]:
    """(t_s expression, WHERE clause, named params): seconds since the run's first step, on wall time.

    Timestamps of every source are converted to wall time (`wall_minus_mono_ns`), so
    ranks on different hosts share one axis.
    """
    params: dict[str, Any] = {}
    run = ""
    if run_id is not None:
        run, params["run_id"] = " AND s.run_id = $run_id", run_id
    # the least ts_ns of each source, then its wall offset: the same minimum as over every step joined to its
    # source, without a join per step
    start = ("(SELECT min(x.lo + y.wall_minus_mono_ns) FROM (SELECT source_id, min(ts_ns) AS lo FROM steps "
             "GROUP BY source_id) x JOIN sources y USING (source_id)"
             + (" WHERE y.run_id = $run_id)" if run_id is not None else ")"))
    # clamped at 0: a snapshot taken just before the run's first forward belongs to its first second
    t_expr = f"greatest((({table}.ts_ns + s.wall_minus_mono_ns) - {start}) / 1e9, 0)"
    where = f"WHERE true{run}"
    if since_s is not None:
        where += f" AND {t_expr} >= $since_s"
        params["since_s"] = since_s
    if until_s is not None:
        where += f" AND {t_expr} < $until_s"
        params["until_s"] = until_s
    return t_expr, where, params


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: Any, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    return [dict(zip(keys, r)) for r in con.execute(sql, params).fetchall()]


def step_timeline(con: duckdb.DuckDBPyConnection, run_id: str | None = None, bucket_s: float = 1.0,
                  since_s: float | None = None, until_s: float | None = None,
                  quantiles: str = "exact") -> list[dict[str, Any]]:
    """Per time bucket and phase: steps, median and p95 step time (ms), tokens; t_s from the run's start.
    `quantiles="approx"`: from the per-second rollup for whole-second buckets and windows (phases.py)."""
    if bucket_s <= 0:
        raise ValueError("bucket_s must be > 0")
    if _approx(quantiles):
        out = phases.step_timeline(con, run_id, bucket_s, since_s, until_s)
        if out is not None:
            return out
    t, where, params = _window(run_id, since_s, until_s)
    return _rows(con, f"""
        SELECT floor({t} / $bucket_s) * $bucket_s AS t_s, phase, count(*),
               quantile_cont({STEP_MS}, [0.5, 0.95])[1], quantile_cont({STEP_MS}, [0.5, 0.95])[2],
               sum(prefill_tokens), sum(decode_tokens)
        FROM steps t JOIN sources s USING (source_id) {where}
        GROUP BY 1, 2 ORDER BY 1, 2""", {**params, "bucket_s": bucket_s},
        ("t_s", "phase", "steps", "p50_ms", "p95_ms", "prefill_tokens", "decode_tokens"))


def step_sample(con: duckdb.DuckDBPyConnection, run_id: str | None = None, limit: int = 4000,
                since_s: float | None = None, until_s: float | None = None) -> list[dict[str, Any]]:
    """A uniform sample of individual steps (reservoir, `limit` rows) for the step timeline scatter."""
    t, where, params = _window(run_id, since_s, until_s)
    return _rows(con, f"""
        WITH w AS (SELECT {t} AS t_s, t.phase, {STEP_MS} AS ms, t.prefill_tokens, t.decode_tokens, t.num_seqs
                   FROM steps t JOIN sources s USING (source_id) {where})
        SELECT * FROM w USING SAMPLE reservoir({int(limit)} ROWS) REPEATABLE (7) ORDER BY t_s""", params, ("t_s", "phase", "ms", "prefill_tokens", "decode_tokens", "num_seqs"))


def interference(con: duckdb.DuckDBPyConnection, run_id: str | None = None,
                 long_prefill_tokens: int = int(T["long_prefill_tokens"]),
                 since_s: float | None = None, until_s: float | None = None,
                 quantiles: str = "exact") -> list[dict[str, Any]]:
    """Steps that carry decode tokens, by what they were packed with: pure decode, a short or a long prefill.
    `quantiles="approx"`: from the per-second rollup at the default threshold (phases.py)."""
    if _approx(quantiles):
        out = phases.interference(con, run_id, long_prefill_tokens, since_s, until_s)
        if out is not None:
            return out
    t, where, params = _window(run_id, since_s, until_s)
    return _rows(con, f"""
        SELECT CASE WHEN prefill_tokens = 0 THEN 'decode only'
                    WHEN prefill_tokens < $long THEN 'with short prefill'
                    ELSE 'with long prefill' END AS class,
               count(*), quantile_cont({STEP_MS}, [0.5, 0.95])[1], quantile_cont({STEP_MS}, [0.5, 0.95])[2],
               avg(prefill_tokens),
               sum(decode_tokens)
        FROM steps t JOIN sources s USING (source_id) {where} AND decode_tokens > 0
        GROUP BY 1 ORDER BY 1""", {**params, "long": long_prefill_tokens},
        ("class", "steps", "p50_ms", "p95_ms", "prefill_tokens_mean", "decode_tokens"))


LATENCY_METRICS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s", "queue": "queue_s"}


def latency_histogram(con: duckdb.DuckDBPyConnection, run_id: str | None = None, metric: str = "ttft",
                      bins: int = 30) -> list[dict[str, Any]]:
    """Log-spaced histogram of a per-request latency (ttft, tpot, e2e, queue) or of ITL (itl: one count per
    output token after a request's first, docs/definitions.md's ITL), seconds."""
    weight = "1"
    if metric == "itl":
        # one row per gap, standing for `tokens` samples of itl_s (the `itl` view): counted by weight, never
        # expanded, so a gap of 2^31 tokens costs what any gap costs
        src, col, weight = "itl", "itl_s", "tokens"
    elif metric in LATENCY_METRICS:
        src, col = "requests", LATENCY_METRICS[metric]
    else:
        raise ValueError(f"metric must be one of {sorted(LATENCY_METRICS) + ['itl']}")
    where = "" if run_id is None else " AND run_id = $run_id"
    named: dict[str, Any] = {"bins": bins} if run_id is None else {"bins": bins, "run_id": run_id}
    src = (base._stored(con) or {}).get(src, src)
    # two streaming passes (the range, then the bins), where one materialized the values: 25M ITL gaps held
    # ~400 MB and took seconds
    lo, span = con.execute(f"""SELECT ln(min({col})), greatest(ln(max({col})) - ln(min({col})), 1e-9)
        FROM {src} WHERE {col} > 0{where}""", {k: v for k, v in named.items() if k != "bins"}).fetchone()
    if lo is None:
        return []
    return _rows(con, f"""
        WITH k AS (SELECT greatest(least(floor((ln({col}) - $lo) / $span * $bins), $bins - 1), 0) AS i, {weight} AS w
                   FROM {src} WHERE {col} > 0{where})
        SELECT exp($lo + i * $span / $bins) AS lo_s, exp($lo + (i + 1) * $span / $bins) AS hi_s,
               CAST(sum(w) AS BIGINT) FROM k GROUP BY i ORDER BY i""",
                 {**named, "lo": lo, "span": span}, ("lo_s", "hi_s", "count"))


def slo_attainment(con: duckdb.DuckDBPyConnection, run_id: str | None = None, ttft_slo_s: float = T["ttft_slo_s"],
                   tpot_slo_s: float = T["tpot_slo_s"]) -> dict[str, Any]:
    """Share of finished requests meeting both SLOs, and goodput (such requests and their tokens per second)."""
    where = "" if run_id is None else " AND run_id = ?"
    params = [] if run_id is None else [run_id]
    row = con.execute(f"""
        SELECT count(*), count(*) FILTER (WHERE ttft_s <= ?),
               count(*) FILTER (WHERE coalesce(tpot_s, 0) <= ?),
               count(*) FILTER (WHERE ttft_s <= ? AND coalesce(tpot_s, 0) <= ?),
               sum(output_tokens) FILTER (WHERE ttft_s <= ? AND coalesce(tpot_s, 0) <= ?),
               (max(last_token_ns) - min(arrival_ns)) / 1e9
        FROM {base._requests(con)} WHERE status = 'finished'{where}""",
        [ttft_slo_s, tpot_slo_s, ttft_slo_s, tpot_slo_s, ttft_slo_s, tpot_slo_s] + params).fetchone()
    n, ttft_ok, tpot_ok, both, tokens, span = row
    span = span or 0
    return {"finished": n, "ttft_ok": ttft_ok, "tpot_ok": tpot_ok, "both_ok": both,
            "attainment": both / n if n else None,
            "goodput_req_per_s": both / span if span > 0 else None,
            "goodput_tokens_per_s": (tokens or 0) / span if span > 0 else None}


def _kv_buckets(con: duckdb.DuckDBPyConnection, run_id: str | None, bucket_s: float, since_s: float | None,
                until_s: float | None, rollup: Any, sql: str, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """`rollup`'s rows (agent/read/kvreads.py: the same figures from the ten-second KV rollup, for buckets and
    windows of whole cells) where it answers, else `sql`'s over the raw snapshots `k`: formatted with {t} (a
    snapshot's seconds since the run's first step) and {where} (the run and window), with $bucket_s."""
    out = rollup(con, run_id, bucket_s, since_s, until_s)
    if out is not None:
        return out
    t, where, params = _window(run_id, since_s, until_s, table="k")
    return _rows(con, sql.format(t=t, where=where), {**params, "bucket_s": bucket_s}, keys)


def kv_timeline(con: duckdb.DuckDBPyConnection, run_id: str | None = None, bucket_s: float = 1.0,
                since_s: float | None = None, until_s: float | None = None) -> list[dict[str, Any]]:
    """Per bucket and rank: mean block and token usage, internal/external fragmentation, pages allocated/freed per s.
    From the ten-second KV rollup for buckets and windows of whole cells (agent/read/kvreads.py: the same figures)."""
    return _kv_buckets(con, run_id, bucket_s, since_s, until_s, kvreads.kv_timeline, """
        SELECT floor({t} / $bucket_s) * $bucket_s AS t_s, k.rank,
               avg(used_pages / total_pages), avg(live_tokens / (total_pages * page_size_tokens)),
               avg(CASE WHEN used_pages > 0 THEN 1 - live_tokens / (used_pages * page_size_tokens) END),
               avg(CASE WHEN free_pages > 0 THEN 1 - least(largest_free_run, free_pages) / free_pages END),
               (max(pages_allocated_total) - min(pages_allocated_total)) / $bucket_s,
               (max(pages_freed_total) - min(pages_freed_total)) / $bucket_s,
               avg(kv_bytes), max(cached_pages / total_pages)
        FROM kv_snapshots k JOIN sources s USING (source_id) {where} AND total_pages > 0
        GROUP BY 1, 2 ORDER BY 1, 2""", kvreads.KV_TIMELINE_KEYS)


def page_size_whatif(con: duckdb.DuckDBPyConnection, run_id: str | None = None,
                     sizes: str = "8,16,32,64,128,256") -> list[dict[str, Any]]:
    """Predicted internal fragmentation at other page sizes for this run's final sequence lengths."""
    try:
        pages = sorted({int(x) for x in sizes.split(",") if x.strip()})
    except ValueError as exc:
        raise ValueError("sizes must be comma-separated integers") from exc
    if not pages or min(pages) <= 0:
        raise ValueError("page sizes must be > 0")
    where = "" if run_id is None else " AND run_id = ?"
    params = [] if run_id is None else [run_id]
    return _rows(con, f"""
        WITH n AS (SELECT prompt_tokens + output_tokens AS n FROM {base._requests(con)}
                   WHERE prompt_tokens IS NOT NULL{where}),
             p AS (SELECT unnest(?::INTEGER[]) AS page_size)
        SELECT page_size, 1 - sum(n) / sum(ceil(n / page_size) * page_size), sum(ceil(n / page_size))
        FROM n, p GROUP BY page_size ORDER BY page_size""", params + [pages],
        ("page_size", "internal_fragmentation", "pages"))


def prefix_timeline(con: duckdb.DuckDBPyConnection, run_id: str | None = None, bucket_s: float = 1.0,
                    since_s: float | None = None, until_s: float | None = None) -> list[dict[str, Any]]:
    """Per bucket: queried and hit tokens, hit rate (Δhit/Δqueried), recomputed tokens, evicted pages.

    Counters are monotonic per source from 0, so a bucket's delta is its maximum minus the
    previous bucket's maximum: one GROUP BY over the raw rows, a window over the buckets only.
    """
    t, where, params = _window(run_id, since_s, until_s, table="p")
    return _rows(con, f"""
        WITH b AS (
            SELECT p.source_id, floor({t} / $bucket_s) * $bucket_s AS t_s,
                   max(queried_tokens_total) AS q, max(hit_tokens_total) AS h,
                   max(recomputed_tokens_total) AS r, max(evicted_blocks_total) AS e
            FROM prefix_counters p JOIN sources s USING (source_id) {where} GROUP BY 1, 2),
        d AS (
            SELECT t_s, q - lag(q, 1, 0) OVER w AS dq, h - lag(h, 1, 0) OVER w AS dh,
                   r - lag(r, 1, 0) OVER w AS dr, e - lag(e, 1, 0) OVER w AS de
            FROM b WINDOW w AS (PARTITION BY source_id ORDER BY t_s))
        SELECT t_s, sum(dq), sum(dh), sum(dh) / nullif(sum(dq), 0), sum(dr), sum(de)
        FROM d GROUP BY 1 ORDER BY 1""", {**params, "bucket_s": bucket_s},
        ("t_s", "queried_tokens", "hit_tokens", "hit_rate", "recomputed_tokens", "evicted_blocks"))


def rank_kv(con: duckdb.DuckDBPyConnection, run_id: str | None = None, bucket_s: float = 1.0,
            since_s: float | None = None, until_s: float | None = None) -> list[dict[str, Any]]:
    """Per bucket and rank: mean KV bytes, and per bucket the imbalance max_r/mean_r - 1 (heatmap data).
    From the ten-second KV rollup for buckets and windows of whole cells (agent/read/kvreads.py: the same figures)."""
    return _kv_buckets(con, run_id, bucket_s, since_s, until_s, kvreads.rank_kv, """
        WITH r AS (SELECT floor({t} / $bucket_s) * $bucket_s AS t_s, k.rank, avg(kv_bytes) AS kv
                   FROM kv_snapshots k JOIN sources s USING (source_id) {where} GROUP BY 1, 2)
        """ + kvreads.RANK_IMBALANCE, kvreads.RANK_KV_KEYS)


def rank_steps(con: duckdb.DuckDBPyConnection, run_id: str | None = None,
               max_rows: int = 1_000_000) -> list[dict[str, Any]]:
    """Per rank over steps seen on 2+ ranks: median step time, how often it was the slowest, mean skew
    (max/median - 1). Above `max_rows` steps, every k-th step id (all ranks of each
    sampled step kept) bounds the cost; shares and medians are estimates then."""
    where, params = _run_filter(run_id)
    n = con.execute(*_per_source_steps(run_id)).fetchone()[0]
    k = max(1, -(-n // max_rows))
    steps = f"""SELECT t.step_id, t.rank, {STEP_MS} AS ms FROM steps t JOIN sources s USING (source_id)
                   WHERE t.step_id % {k} = 0 {where}"""
    keys = ("rank", "p50_ms", "slowest_share", "skew_mean")
    # two ranks a step (TP 2, no rank twice): a step's median is lo + (hi - lo) * 0.5, DuckDB's own interpolation
    # (the product by 0.5 is exact, so a fused multiply-add gives the same), every row is in a step of 2+ ranks
    # (a rank's median is over all its rows: no join back), and each step counts once for each of its two ranks
    world = con.execute(f"SELECT max(world_size) FROM sources s WHERE true {where}", params).fetchone()[0]
    rows = [] if world != 2 else con.execute(f"""
        WITH t AS ({steps}),
             g AS MATERIALIZED (SELECT count(*) AS n, min(rank) AS r0, max(rank) AS r1, max(ms) AS mx,
                                       min(ms) + (max(ms) - min(ms)) * 0.5 AS med, arg_max(rank, ms) AS slow
                                FROM t GROUP BY step_id),
             ok AS (SELECT coalesce(bool_and(n = 2 AND r0 < r1), false) AS two FROM g),
             per AS (SELECT r, count(*) FILTER (WHERE slow = r) AS slowest, sum(mx / nullif(med, 0) - 1) AS skew_sum,
                            count(mx / nullif(med, 0) - 1) AS skew_n
                     FROM (SELECT r0 AS r, slow, mx, med FROM g UNION ALL SELECT r1, slow, mx, med FROM g) GROUP BY r),
             m AS (SELECT rank, median(ms) AS p50, count(*) AS n FROM t GROUP BY rank)
        SELECT m.rank, m.p50, per.slowest / m.n, per.skew_sum / nullif(per.skew_n, 0), ok.two
        FROM m JOIN per ON per.r = m.rank, ok ORDER BY m.rank""", params).fetchall()
    if rows and all(r[-1] for r in rows):
        return [dict(zip(keys, r[:-1])) for r in rows]
    return _rows(con, f"""
        WITH t AS ({steps}),
             g AS (SELECT step_id, max(ms) AS mx, median(ms) AS med, arg_max(rank, ms) AS slow
                   FROM t GROUP BY step_id HAVING count(*) > 1)
        SELECT t.rank, median(t.ms), count(*) FILTER (WHERE g.slow = t.rank) / count(*),
               avg(g.mx / nullif(g.med, 0) - 1)
        FROM t JOIN g USING (step_id) GROUP BY t.rank ORDER BY t.rank""", params, keys)


def gpu_timeline(con: duckdb.DuckDBPyConnection, run_id: str | None = None,
                 bucket_s: float = 1.0) -> list[dict[str, Any]]:
    """Per bucket and GPU: utilisation, memory used/total, power (samples within the run's wall-clock span)."""
    run = "" if run_id is None else " AND s.run_id = ?"
    params = [] if run_id is None else [run_id]
    return _rows(con, f"""
        WITH span AS (SELECT min(t.ts_ns + s.wall_minus_mono_ns) AS lo, max(t.ts_ns + s.wall_minus_mono_ns) AS hi
                      FROM steps t JOIN sources s USING (source_id) WHERE true{run}),
             g AS (SELECT (g.ts_ns + s.wall_minus_mono_ns) AS w, g.* FROM gpu_samples g JOIN sources s USING (source_id))
        SELECT floor((w - span.lo) / 1e9 / ?) * ? AS t_s, gpu_index, avg(util_pct), max(mem_used_bytes),
               max(mem_total_bytes), avg(power_w), max(xid_errors_total)
        FROM g, span WHERE w BETWEEN span.lo - 5e9 AND span.hi + 5e9
        GROUP BY 1, 2 ORDER BY 1, 2""", params + [bucket_s, bucket_s],
        ("t_s", "gpu_index", "util_pct", "mem_used_bytes", "mem_total_bytes", "power_w", "xid_errors_total"))


def _span_cte(run_id: str | None) -> tuple[str, list[Any]]:
    """A CTE `span(lo, hi)`: the run's first and last step on wall time, ns."""
    run = "" if run_id is None else " AND s.run_id = ?"
    return (f"""span AS (SELECT min(t.ts_ns + s.wall_minus_mono_ns) AS lo, max(t.ts_ns + s.wall_minus_mono_ns) AS hi
                      FROM steps t JOIN sources s USING (source_id) WHERE true{run})""",
            [] if run_id is None else [run_id])


# a run's server processes: the pids its probes' Hello named (process_samples.run_id), or a --pid
# process (run_id '') whose pid a source of the run has
RUN_PROCESS = """(p.run_id = $run OR (p.run_id = '' AND p.pid IN (SELECT pid FROM sources WHERE run_id = $run)))"""


def process_timeline(con: duckdb.DuckDBPyConnection, run_id: str | None = None,
                     bucket_s: float = 1.0) -> list[dict[str, Any]]:
    """Per bucket and server process (within the run's span): its CPU in cores (user+system), the busiest
    thread's cores and run-queue wait ratio, RSS and open fds at most, involuntary context switches per s."""
    if bucket_s <= 0:
        raise ValueError("bucket_s must be > 0")
    span, params = _span_cte(run_id)
    who = "" if run_id is None else " AND " + RUN_PROCESS.replace("$run", "?")
    return _rows(con, f"""
        WITH {span},
             p AS (SELECT (p.ts_ns + s.wall_minus_mono_ns) AS w, p.* FROM process_samples p JOIN sources s USING (source_id)
                   WHERE true{who}),
             d AS (SELECT *, (cpu_user_s_total + cpu_system_s_total
                              - lag(cpu_user_s_total + cpu_system_s_total) OVER (PARTITION BY pid ORDER BY w))
                             / ((w - lag(w) OVER (PARTITION BY pid ORDER BY w)) / 1e9) AS cores,
                             (ctx_involuntary_total - lag(ctx_involuntary_total) OVER (PARTITION BY pid ORDER BY w))
                             / ((w - lag(w) OVER (PARTITION BY pid ORDER BY w)) / 1e9) AS invol_per_s
                   FROM p)
        SELECT floor((w - span.lo) / 1e9 / ?) * ? AS t_s, pid, avg(cores),
               avg(busiest_thread_cores) FILTER (WHERE NOT isnan(busiest_thread_cores)),
               avg(busiest_thread_wait_ratio) FILTER (WHERE NOT isnan(busiest_thread_wait_ratio)),
               max(rss_bytes), max(open_fds), avg(invol_per_s), max(threads)
        FROM d, span WHERE w BETWEEN span.lo - 5e9 AND span.hi + 5e9
        GROUP BY 1, 2 ORDER BY 1, 2""", params + ([run_id, run_id] if run_id is not None else []) + [bucket_s, bucket_s],
        ("t_s", "pid", "cpu_cores", "busiest_thread_cores", "busiest_thread_wait_ratio", "rss_bytes", "open_fds",
         "involuntary_ctx_per_s", "threads"))


def host_timeline(con: duckdb.DuckDBPyConnection, run_id: str | None = None,
                  bucket_s: float = 1.0) -> list[dict[str, Any]]:
    """Per bucket (within the run's span): host CPU busy %, load per CPU, memory available (min), swap in/out
    bytes per s, CPU pressure %, and the share of cgroup CFS periods throttled."""
    if bucket_s <= 0:
        raise ValueError("bucket_s must be > 0")
    span, params = _span_cte(run_id)
    return _rows(con, f"""
        WITH {span},
             h AS (SELECT (h.ts_ns + s.wall_minus_mono_ns) AS w, h.* FROM host_samples h JOIN sources s USING (source_id)),
             d AS (SELECT *, (w - lag(w) OVER (ORDER BY w)) / 1e9 AS dt,
                          swap_in_bytes_total - lag(swap_in_bytes_total) OVER (ORDER BY w) AS d_in,
                          swap_out_bytes_total - lag(swap_out_bytes_total) OVER (ORDER BY w) AS d_out,
                          cgroup_periods_total - lag(cgroup_periods_total) OVER (ORDER BY w) AS d_periods,
                          cgroup_throttled_periods_total - lag(cgroup_throttled_periods_total) OVER (ORDER BY w) AS d_thr
                   FROM h)
        SELECT floor((w - span.lo) / 1e9 / ?) * ? AS t_s, avg(cpu_util_pct) FILTER (WHERE NOT isnan(cpu_util_pct)),
               avg(load1 / nullif(cpu_count, 0)),
               min(mem_available_bytes), max(mem_total_bytes), sum(d_in) / nullif(sum(dt), 0),
               sum(d_out) / nullif(sum(dt), 0), avg(cpu_pressure_some_pct) FILTER (WHERE NOT isnan(cpu_pressure_some_pct)),
               sum(d_thr) FILTER (WHERE cgroup_periods_total >= 0) / nullif(sum(d_periods) FILTER (WHERE cgroup_periods_total >= 0), 0),
               any_value(cgroup_cpu_quota_cores) FILTER (WHERE NOT isnan(cgroup_cpu_quota_cores))
        FROM d, span WHERE w BETWEEN span.lo - 5e9 AND span.hi + 5e9
        GROUP BY 1 ORDER BY 1""", params + [bucket_s, bucket_s],
        ("t_s", "cpu_util_pct", "load_per_cpu", "mem_available_bytes", "mem_total_bytes", "swap_in_bytes_per_s",
         "swap_out_bytes_per_s", "cpu_pressure_pct", "throttled_ratio", "cpu_quota_cores"))


def run_span(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> dict[str, Any]:
    """Steps of the run and the seconds between its first and last step (the time-range filter's span)."""
    n, lo, hi = con.execute(*_per_source_steps(run_id)).fetchone()
    return {"steps": n, "span_s": (hi - lo) / 1e9 if n else 0.0}


def _per_source_steps(run_id: str | None) -> tuple[str, list[Any]]:
    """SQL (and params) of one row: the run's steps, its first and last step on wall time (ns). Per source
    first, then over the run's sources: the same count and extremes as over every step joined to its source
    (the wall offset is one per source), without a join per step (every page's sidebar reads it)."""
    where, params = _run_filter(run_id)
    return (f"""SELECT CAST(coalesce(sum(x.n), 0) AS BIGINT), min(x.lo + s.wall_minus_mono_ns),
                       max(x.hi + s.wall_minus_mono_ns)
                FROM (SELECT source_id, count(*) AS n, min(ts_ns) AS lo, max(ts_ns) AS hi FROM steps
                      GROUP BY source_id) x JOIN sources s USING (source_id) WHERE true {where}""", params)


def memory_budget(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> dict[str, Any]:
    """Device memory split of a run, bytes: KV budget (all pages), KV held at peak, GPU used/total at peak,
    and weights when the run was labelled with `weights_bytes` (table run_info, if present)."""
    where, params = _run_filter(run_id)
    kv = con.execute(
        f"""SELECT max(total_pages * kv_bytes / nullif(used_pages, 0)), max(kv_bytes)
            FROM kv_snapshots k JOIN sources s USING (source_id) WHERE true {where}""", params).fetchone()
    gpu = gpu_timeline(con, run_id, bucket_s=3600.0)
    weights = None
    has_info = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'run_info'").fetchone()[0]
    if has_info and run_id is not None:
        row = con.execute("SELECT value FROM run_info WHERE run_id = ? AND key = 'weights_bytes'", [run_id]).fetchone()
        weights = float(row[0]) if row else None
    return {"kv_budget_bytes": kv[0], "kv_peak_bytes": kv[1], "weights_bytes": weights,
            "gpu_used_bytes": max((g["mem_used_bytes"] for g in gpu), default=None),
            "gpu_total_bytes": max((g["mem_total_bytes"] for g in gpu), default=None)}


def verifications(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict[str, Any]]:
    """`phasescope verify`'s results for the run's findings, newest first: finding_id, verdict, created_ns, and
    `result` (prediction, each arm's measured values and run ids, effect with its 95% interval, error); [] when
    none was verified."""
    if not con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'verifications'").fetchone()[0]:
        return []
    rows = con.execute("SELECT finding_id, verify_id, created_ns, verdict, result FROM verifications "
                       "WHERE run_id = ? ORDER BY created_ns DESC", [run_id]).fetchall()
    return [{"finding_id": f, "verify_id": v, "created_ns": t, "verdict": w, "result": json.loads(r)}
            for f, v, t, w, r in rows]


def run_compare(con: duckdb.DuckDBPyConnection, run_a: str, run_b: str) -> list[dict[str, Any]]:
    """Request summary and preemption counts of two runs, side by side."""
    out = []
    for run in (run_a, run_b):
        r = request_summary(con, run)
        r["run_id"] = run
        out.append(r)
    return out


# --- issue 27 item 6: forward passes vs the iterations vLLM counts ---


def vllm_iterations(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> dict[str, Any]:
    """`forward_passes`: step records of each engine's first rank (every forward, chunk-only prefills included);
    `output_iterations`: engine iterations that produced output, summed over engines (vLLM's
    `vllm:iteration_tokens_total` count, which skips a step whose prefill chunk ends no prompt); their difference
    `no_output_steps`. `output_iterations` is None for a run without the vLLM adapter's counter."""
    run_id = run_id or latest_run(con)
    (it,) = con.execute("""SELECT sum(v) FROM (SELECT max(m.value) AS v FROM server_metrics m JOIN sources s
                           USING (source_id) WHERE s.run_id = ? AND m.name = ? GROUP BY m.engine)""",
                        [run_id, VLLM_OUTPUT_ITERATIONS]).fetchone()
    (fw,) = con.execute("""SELECT count(*) FROM steps st JOIN sources s USING (source_id) WHERE s.run_id = $run
                           AND st.rank IN (SELECT DISTINCT p.rank FROM prefix_counters p JOIN sources s2
                                           USING (source_id) WHERE s2.run_id = $run)""", {"run": run_id}).fetchone()
    it = int(it) if it is not None else None
    return {"forward_passes": int(fw), "output_iterations": it,
            "no_output_steps": int(fw) - it if it is not None else None}


# --- issue 13: why prefix lookups miss, KV residency (analyzers/prefix_miss.py, analyzers/residency.py) ---

MISS_CAUSES = ("no-shared-prefix", "sub-page", "evicted", "in-flight", "readmission", "cache-disabled")

# per lookup: s' = max(shared, hit), r = max(min(floor(s'/P)*P, cacheable), hit); no-shared-prefix L - s',
# sub-page s' - r, evicted min(e, r - hit), in-flight the rest of r - hit (sum: L - hit exactly)
MISS_CAUSES_SQL = """WITH l AS (
        SELECT l.*, greatest(l.shared_tokens, l.hit_tokens) AS s2
        FROM prefix_lookups l JOIN sources s USING (source_id) WHERE s.run_id = $run),
    c AS (SELECT *, greatest(least(s2 // page_size_tokens * page_size_tokens, cacheable_tokens), hit_tokens) AS r
          FROM l)
    SELECT count(*) FILTER (WHERE kind = 'first') AS lookups,
           count(*) FILTER (WHERE kind = 'readmit') AS readmissions,
           count(*) FILTER (WHERE kind = 'disabled') AS disabled_lookups,
           coalesce(sum(prompt_tokens) FILTER (WHERE kind = 'first'), 0) AS queried_tokens,
           coalesce(sum(hit_tokens) FILTER (WHERE kind = 'first'), 0) AS hit_tokens,
           coalesce(sum(prompt_tokens - hit_tokens) FILTER (WHERE kind = 'first'), 0) AS missed_tokens,
           coalesce(sum(prompt_tokens - s2) FILTER (WHERE kind = 'first'), 0) AS "no-shared-prefix",
           coalesce(sum(s2 - r) FILTER (WHERE kind = 'first'), 0) AS "sub-page",
           coalesce(sum(least(evicted_tokens, r - hit_tokens)) FILTER (WHERE kind = 'first'), 0) AS evicted,
           coalesce(sum(r - hit_tokens - least(evicted_tokens, r - hit_tokens)) FILTER (WHERE kind = 'first'), 0)
               AS "in-flight",
           coalesce(sum(greatest(0, least(prompt_tokens, cacheable_tokens) - hit_tokens))
                    FILTER (WHERE kind = 'readmit'), 0) AS readmission,
           coalesce(sum(prompt_tokens) FILTER (WHERE kind = 'disabled'), 0) AS "cache-disabled",
           count(*) FILTER (WHERE kind = 'first' AND s2 > r) AS sub_page_lookups,
           count(*) FILTER (WHERE kind = 'first' AND s2 > 0 AND s2 < page_size_tokens) AS below_one_page_lookups,
           quantile_cont(s2, 0.5) FILTER (WHERE kind = 'first' AND s2 > r) AS sub_page_shared_tokens_p50,
           quantile_cont(evict_gap_ms, 0.5) FILTER (WHERE kind = 'first' AND evicted_tokens > 0) AS evict_gap_ms_p50,
           quantile_cont(evict_gap_ms, 0.9) FILTER (WHERE kind = 'first' AND evicted_tokens > 0) AS evict_gap_ms_p90,
           max(evict_gap_ms) FILTER (WHERE kind = 'first' AND evicted_tokens > 0) AS evict_gap_ms_max,
           max(page_size_tokens) AS page_size_tokens,
           max(table_pages) AS table_pages, max(table_dropped_total) AS table_dropped_pages
    FROM c"""

# what a page of p tokens would have hit among the sub-page misses (the same rule, P -> p), for every p of $pages
SMALLER_PAGES_SQL = """WITH l AS (
        SELECT l.*, greatest(l.shared_tokens, l.hit_tokens) AS s2
        FROM prefix_lookups l JOIN sources s USING (source_id) WHERE s.run_id = $run AND l.kind = 'first')
    SELECT pp.p, coalesce(sum(greatest(0, least(s2 // pp.p * pp.p, (prompt_tokens - 1) // pp.p * pp.p)
                                        - greatest(least(s2 // page_size_tokens * page_size_tokens, cacheable_tokens),
                                                   hit_tokens))), 0) AS saved_tokens
    FROM l, (SELECT unnest($pages::BIGINT[]) AS p) pp GROUP BY pp.p"""

RESIDENCY_SQL = """SELECT count(*) AS page_events, max(sample_every) AS sample_every, max(dropped_total) AS dropped_events,
           count(*) FILTER (WHERE event = 'evicted') AS evictions,
           count(*) FILTER (WHERE event = 'reused') AS reuses,
           count(*) FILTER (WHERE event = 'freed') AS frees,
           quantile_cont(age_ms, 0.5) FILTER (WHERE event IN ('evicted', 'freed')) AS lifetime_ms_p50,
           quantile_cont(age_ms, 0.9) FILTER (WHERE event IN ('evicted', 'freed')) AS lifetime_ms_p90,
           quantile_cont(idle_ms, 0.5) FILTER (WHERE event = 'evicted' AND NOT isnan(idle_ms)) AS idle_before_evict_ms_p50,
           quantile_cont(idle_ms, 0.9) FILTER (WHERE event = 'evicted' AND NOT isnan(idle_ms)) AS idle_before_evict_ms_p90,
           quantile_cont(idle_ms, 0.5) FILTER (WHERE event = 'reused') AS reuse_gap_ms_p50,
           quantile_cont(idle_ms, 0.9) FILTER (WHERE event = 'reused') AS reuse_gap_ms_p90,
           max(idle_ms) FILTER (WHERE event = 'reused') AS reuse_gap_ms_max
    FROM page_events e JOIN sources s USING (source_id) WHERE s.run_id = $run"""

EVICTED_REUSE_SQL = """SELECT l.ts_ns, l.evict_gap_ms, l.evicted_tokens, l.page_size_tokens
    FROM prefix_lookups l JOIN sources s USING (source_id)
    WHERE s.run_id = $run AND l.kind = 'first' AND l.evicted_tokens > 0 AND NOT isnan(l.evict_gap_ms)
    ORDER BY l.ts_ns"""

CAPACITY_SQL = """SELECT max(k.total_pages) AS total_pages, max(k.page_size_tokens) AS page_size_tokens,
           (SELECT sum(prompt_tokens) FROM prefix_lookups l JOIN sources s2 USING (source_id)
            WHERE s2.run_id = $run AND l.kind = 'first') AS queried_tokens
    FROM kv_snapshots k JOIN sources s USING (source_id) WHERE s.run_id = $run"""


def split_lookup(kind: str, page: int, prompt: int, cacheable: int, hit: int, shared: int,
                 evicted: int) -> dict[str, int]:
    """One lookup's missed tokens per cause, exactly as MISS_CAUSES_SQL splits them (the live exporters' form)."""
    if kind == "readmit":  # recomputation: the positions the preemption dropped (cacheable) the cache did not give back
        return {"readmission": max(0, min(prompt, cacheable) - hit)}
    if kind == "disabled":
        return {"cache-disabled": prompt}
    s2 = max(shared, hit)
    r = max(min(s2 // max(page, 1) * page, cacheable), hit)
    ev = min(evicted, r - hit)
    return {"no-shared-prefix": prompt - s2, "sub-page": s2 - r, "evicted": ev, "in-flight": r - hit - ev}


def prefix_miss_causes(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> dict[str, Any]:
    """Missed prompt tokens of a run per cause (keys: MISS_CAUSES) and the figures around them, from the
    `prefix_lookups` the adapter wrote; `lookups` 0 when it wrote none. Tokens of first admissions, except
    `readmission` (re-admissions after preemption) and `cache-disabled` (prompts admitted with it off)."""
    run_id = run_id or latest_run(con)
    cur = con.execute(MISS_CAUSES_SQL, {"run": run_id})
    return dict(zip([d[0] for d in cur.description], cur.fetchone()))


def smaller_page_saving(con: duckdb.DuckDBPyConnection, run_id: str, page: int) -> int:
    """Prompt tokens pages of `page` tokens would have served from the cache on top of today's hits
    (sub-page misses only; the same pages assumed cached)."""
    return smaller_page_savings(con, run_id, [page])[int(page)]


def smaller_page_savings(con: duckdb.DuckDBPyConnection, run_id: str, pages: list[int]) -> dict[int, int]:
    """`smaller_page_saving` of every page size in `pages`, in one pass over the lookups."""
    pages = sorted({int(p) for p in pages})
    got = dict(con.execute(SMALLER_PAGES_SQL, {"run": run_id, "pages": pages}).fetchall())
    return {p: int(got.get(p) or 0) for p in pages}


def extra_pages_needed(intervals: list[tuple[int, int, int]]) -> int:
    """Most pages held at once by intervals (start_ns, end_ns, pages), ends inclusive."""
    points = sorted([(a, 0, n) for a, _, n in intervals] + [(b, 1, -n) for _, b, n in intervals])
    best = cur = 0
    for _, _, n in points:
        cur += n
        best = max(best, cur)
    return best


def kv_residency(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> dict[str, Any]:
    """Sampled page lifetime / idle-before-eviction / reuse-gap percentiles (ms), and the lookups that missed
    pages evicted before their reuse: their tokens, pages, eviction-to-reuse gaps (ms) and the extra pages
    a cache would have needed to keep them, max_t sum(pages_i : ts_i - gap_i <= t <= ts_i)."""
    run_id = run_id or latest_run(con)
    cur = con.execute(RESIDENCY_SQL, {"run": run_id})
    out = dict(zip([d[0] for d in cur.description], cur.fetchone()))
    rows = con.execute(EVICTED_REUSE_SQL, {"run": run_id}).fetchall()
    intervals = [(ts - int(gap * 1e6), ts, tokens // max(page, 1)) for ts, gap, tokens, page in rows]
    gaps = sorted(r[1] for r in rows)
    cur = con.execute(CAPACITY_SQL, {"run": run_id})
    cap = dict(zip([d[0] for d in cur.description], cur.fetchone()))
    out.update({
        "evicted_reuse_lookups": len(rows),
        "evicted_reuse_tokens": sum(r[2] for r in rows),
        "evicted_reuse_pages": sum(n for _, _, n in intervals),
        "evict_to_reuse_gap_ms_min": gaps[0] if gaps else None,
        "evict_to_reuse_gap_ms_max": gaps[-1] if gaps else None,
        "extra_pages_needed": extra_pages_needed(intervals),
        "total_pages": cap["total_pages"], "page_size_tokens": cap["page_size_tokens"],
        "queried_tokens": cap["queried_tokens"] or 0,
    })
    return out


# --- ITL tail attribution: which step made each inter-token gap long (agent/read/itl.py) ---

def itl_attribution(con: duckdb.DuckDBPyConnection, run_id: str | None = None,
                    long_prefill_tokens: int = int(T["long_prefill_tokens"]),
                    host_stall_ratio: float = T["host_stall_ratio"], tpot_slo_s: float = T["tpot_slo_s"],
                    quantile: float = 0.99) -> dict[str, Any]:
    """The ITL tail of a run (default: the latest) and its causes, ms: p50 / p99 ITL; per cause the tail
    samples (>= p99) and their share of the tail's excess over the median; TPOT-SLO violations and how many
    each cause explains alone (`itl.attribution`)."""
    return attribution(con, run_id, long_prefill_tokens, host_stall_ratio, tpot_slo_s, quantile)


# --- load sweeps: the runs `phasescope sweep` labelled (agent/read/sweep.py) ---

def sweeps(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """The sweeps in the store, newest first: sweep_id, points, lowest / highest offered rate (requests/s),
    runtime, model, started_ns (`sweep.sweeps`)."""
    return sweep.sweeps(con)


def sweep_points(con: duckdb.DuckDBPyConnection, sweep_id: str, ttft_slo_s: float | None = None,
                 tpot_slo_s: float | None = None, e2e_slo_s: float | None = None) -> list[dict[str, Any]]:
    """One sweep's points by offered rate: run_id, requests, good/finished, goodput (req/s), SLO attainment,
    survival, TTFT/TPOT/ITL/E2E percentiles (s) at the SLOs given in seconds (none: no SLO) (`sweep.sweep_points`)."""
    return sweep.sweep_points(con, sweep_id, ttft_slo_s, tpot_slo_s, e2e_slo_s)


# --- data-parallel engines: KV usage and queue spread (agent/read/dp.py) ---

def dp_balance(con: duckdb.DuckDBPyConnection, run_id: str | None = None,
               near_cap: float = T["near_cap"]) -> dict[str, Any]:
    """How evenly a run's (default: the latest) data-parallel engines were loaded, from vLLM's per-engine gauges:
    per engine time-weighted mean KV usage and waiting requests; kv_imbalance and waiting_imbalance (max/mean - 1);
    the hottest engine; stranded_share, the share of the time it was at `near_cap` or queueing while another
    engine had headroom (`dp.dp_balance`)."""
    run_id = run_id or latest_run(con)
    return dp.dp_balance(con, run_id, near_cap) if run_id else {"engines": 0}


QUERIES: dict[str, Any] = {
    "runs": runs,
    "phase_summary": phase_summary,
    "request_summary": request_summary,
    "kv_summary": kv_summary,
    "prefix_summary": prefix_summary,
    "probe_health": probe_health,
    "step_timeline": step_timeline,
    "step_sample": step_sample,
    "interference": interference,
    "itl_attribution": itl_attribution,
    "latency_histogram": latency_histogram,
    "slo_attainment": slo_attainment,
    "kv_timeline": kv_timeline,
    "page_size_whatif": page_size_whatif,
    "prefix_timeline": prefix_timeline,
    "rank_kv": rank_kv,
    "rank_steps": rank_steps,
    "gpu_timeline": gpu_timeline,
    "process_timeline": process_timeline,
    "host_timeline": host_timeline,
    "run_compare": run_compare,
    "memory_budget": memory_budget,
    "run_span": run_span,
    "run_labels": run_labels,
    "prefix_miss_causes": prefix_miss_causes,
    "kv_residency": kv_residency,
    "verifications": verifications,
    "sweeps": sweeps,
    "sweep_points": sweep_points,
    "dp_balance": dp_balance,
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
            raw = parse_number(key, raw, ann)
        value = None if raw == "" else raw
        _check_param(key, value)
        kwargs[key] = value
    for key, p in sig.parameters.items():
        if key != "con" and p.default is inspect.Parameter.empty and kwargs.get(key) is None:
            raise ValueError(f"query {name!r} needs parameter {key!r}")
    return fn(con, **kwargs)


# what a numeric parameter may look like: plain decimal (no whitespace, underscores, hex, inf or nan, which
# Python's float() and int() would take)
_INT = re.compile(r"[+-]?[0-9]{1,18}")
_FLOAT = re.compile(r"[+-]?(?:[0-9]{1,40}(?:\.[0-9]{0,40})?|\.[0-9]{1,40})(?:[eE][+-]?[0-9]{1,3})?")


def parse_number(key: str, raw: str, annotation: str) -> Any:
    """`raw` as the int or float `annotation` ("int", "float | None", ...) names, else `raw` unchanged.
    Raises ValueError (one line) for anything but a plain decimal literal."""
    if annotation.startswith("float"):
        if _FLOAT.fullmatch(raw):
            return float(raw)
        raise ValueError(f"{key} must be a decimal number, not {raw[:40]!r}")
    if annotation.startswith("int"):
        if _INT.fullmatch(raw):
            return int(raw)
        raise ValueError(f"{key} must be a decimal integer, not {raw[:40]!r}")
    return raw


# bounds of every numeric parameter (inclusive); strings are bounded in length
PARAM_BOUNDS: dict[str, tuple[float, float]] = {
    "bins": (1, 1000), "bucket_s": (1e-3, 86400.0 * 366), "limit": (1, 1_000_000), "host_stall_ratio": (0, 1e6),
    "quantile": (0.5, 1.0),
    "long_prefill_tokens": (0, 10_000_000), "max_rows": (1, 100_000_000),
    "since_s": (-1e12, 1e12), "until_s": (-1e12, 1e12), "tpot_slo_s": (1e-6, 3600.0), "ttft_slo_s": (1e-6, 3600.0),
    "e2e_slo_s": (1e-6, 86400.0), "near_cap": (1e-6, 1.0),
}
MAX_PARAM_CHARS = 200


def _check_param(key: str, value: Any) -> None:
    """Raise ValueError (one line) for a value no query should get."""
    if value is None:
        return
    if isinstance(value, str):
        if len(value) > MAX_PARAM_CHARS:
            raise ValueError(f"{key} is longer than {MAX_PARAM_CHARS} characters")
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{key} must be finite")
    lo, hi = PARAM_BOUNDS.get(key, (-math.inf, math.inf))
    if not lo <= value <= hi:
        raise ValueError(f"{key} must be within [{lo:g}, {hi:g}], not {value}")
