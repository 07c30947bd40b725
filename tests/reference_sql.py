"""Today's SQL (before issue 30): the reference the new reads must equal.

One change since, by definition: a token's time is the engine's output stamp (issue 27: a token event's ts_ns less
its `cached_tokens` lead in us), in the `itl` view, the ITL histogram and the ITL tail's gaps alike. The fixtures
recorded before a frontend stamped leads (all but healthy-vllm-h100) have leads of 0, where both clocks agree; the
H100 run's 276,624 token events all carry one (up to 6.5 ms), and the receive-time text then differed (ITL p50
4.2355 against 4.2295 ms).

Each string is the query it was, verbatim, over the views it had: `reference_views(con)` puts today's
`request_log`, `requests` and `itl` on a connection as temp views, which hide the store's own
(temp objects come first in DuckDB's search path), so these strings run unchanged. Two are not verbatim:
ITL_TPOT_SQL and SMALLER_PAGE_SQL were the product's text too, so they are the same definitions written
apart from it (a slip in the product's query cannot hide in both).
"""

from __future__ import annotations

import duckdb

REF_ORDER = "CASE r.event WHEN 'arrival' THEN 1 WHEN 'scheduled' THEN 2 WHEN 'queued' THEN 2 ELSE 0 END"  # issue 27

VIEWS = {
    "request_log": f"""
        WITH e AS (
            SELECT r.source_id, s.run_id, r.rank, r.request_id AS runtime_request_id, r.event, r.ts_ns,
                   r.tokens, r.cached_tokens,
                   greatest(1, count(*) FILTER (WHERE r.event = 'arrival') OVER (
                       PARTITION BY s.run_id, r.request_id ORDER BY r.ts_ns, {REF_ORDER}
                       ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)) AS arrival_no
            FROM request_events r JOIN sources s USING (source_id)
        )
        SELECT source_id, run_id, rank,
               CASE WHEN arrival_no = 1 THEN runtime_request_id
                    ELSE runtime_request_id || '#' || arrival_no END AS request_id,
               runtime_request_id, arrival_no, event, ts_ns, tokens, cached_tokens
        FROM e""",
    "requests": """
        WITH agg AS (
            SELECT run_id, request_id, any_value(runtime_request_id) AS runtime_request_id,
                min(ts_ns) FILTER (WHERE event = 'arrival') AS arrival_ns,
                min(ts_ns) FILTER (WHERE event = 'scheduled') AS scheduled_ns,
                min(ts_ns) FILTER (WHERE event = 'token') AS first_token_ns,
                max(ts_ns) FILTER (WHERE event = 'token') AS last_token_ns,
                coalesce(sum(tokens) FILTER (WHERE event = 'token'), 0) AS output_tokens,
                max(tokens) FILTER (WHERE event = 'arrival') AS prompt_tokens,
                arg_min(cached_tokens, ts_ns) FILTER (WHERE event = 'scheduled') AS cached_tokens,
                coalesce(sum(cached_tokens) FILTER (WHERE event = 'scheduled'), 0)
                    - coalesce(arg_min(cached_tokens, ts_ns) FILTER (WHERE event = 'scheduled'), 0)
                    AS readmit_cached_tokens,
                count(*) FILTER (WHERE event = 'preempted') AS preemptions,
                CASE WHEN bool_or(event IN ('aborted', 'cancelled')) THEN 'aborted'
                     WHEN bool_or(event = 'finished') THEN 'finished'
                     ELSE 'running' END AS status,
                min(ts_ns) FILTER (WHERE event = 'queued') AS queued_ns,
                min(ts_ns - 1000 * cached_tokens) FILTER (WHERE event = 'token') AS first_at,
                max(ts_ns - 1000 * cached_tokens) FILTER (WHERE event = 'token') AS last_at
            FROM request_log GROUP BY run_id, request_id
        )
        SELECT * EXCLUDE (queued_ns, first_at, last_at),
            (scheduled_ns - coalesce(queued_ns, arrival_ns)) / 1e9 AS queue_s,
            (first_token_ns - arrival_ns) / 1e9 AS ttft_s,
            (first_at - scheduled_ns) / 1e9 AS prefill_s,
            (last_at - first_at) / 1e9 AS decode_s,
            CASE WHEN output_tokens > 1
                 THEN (last_at - first_at) / 1e9 / (output_tokens - 1) END AS tpot_s,
            (last_token_ns - arrival_ns) / 1e9 AS e2e_s,
            (queued_ns - arrival_ns) / 1e9 AS frontend_s
        FROM agg""",
    # one row per output token after the first token event: a chunk of k tokens
    # arriving `gap` after the previous one gives k samples of gap / k; on the engine's clock
    # (issue 27: a token event's ts_ns less its cached_tokens lead in us)
    "itl": """
        WITH t AS (
            SELECT run_id, request_id, ts_ns - 1000 * cached_tokens AS ts_ns, tokens,
                   lag(ts_ns - 1000 * cached_tokens) OVER (PARTITION BY run_id, request_id ORDER BY ts_ns) AS prev_ns
            FROM request_log
            WHERE event = 'token' AND tokens > 0
        )
        SELECT run_id, request_id, ts_ns, (ts_ns - prev_ns) / 1e9 / tokens AS itl_s
        FROM t, range(tokens) AS k(i)
        WHERE prev_ns IS NOT NULL""",
}


def reference_views(con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
    """`con` with today's views in front of the store's (temp views, this connection only)."""
    for name, sql in VIEWS.items():
        con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS {sql}")
    return con


# --- agent/read/queries.py: the ITL tail attribution --------------------------------------------------------

STEP_MS = "CASE WHEN isnan(gpu_ms) THEN host_ms ELSE gpu_ms END"

LOWEST_RANK_STEPS = f"""SELECT t.*, {STEP_MS} AS ms FROM steps t JOIN sources s USING (source_id)
    WHERE s.run_id = $run AND t.rank = (SELECT min(t2.rank) FROM steps t2 JOIN sources s2 USING (source_id)
                                        WHERE s2.run_id = $run)"""

# one row per token event after a request's first: the gap, its steps and its cause
ITL_GAPS = f"""st AS ({LOWEST_RANK_STEPS}),
    -- async scheduling (vLLM): a step's output may be handed out after the next step's host call: at each end the
    -- larger prefill and time of its step and the one before
    asy AS (SELECT coalesce(bool_or(value = 'True'), false) AS on_ FROM run_info
            WHERE run_id = $run AND key = 'async_scheduling'),
    ends AS (SELECT ts_ns + CAST(host_ms * 1e6 AS BIGINT) AS end_ns,
                    CASE WHEN (SELECT on_ FROM asy) THEN greatest(ms, lag(ms) OVER o) ELSE ms END AS step_ms,
                    CASE WHEN (SELECT on_ FROM asy) THEN greatest(prefill_tokens, lag(prefill_tokens) OVER o)
                         ELSE prefill_tokens END AS prefill_tokens, decode_tokens,
                    row_number() OVER o AS step_no FROM st WINDOW o AS (ORDER BY ts_ns, step_id)),
    tok AS (SELECT request_id, ts_ns - 1000 * cached_tokens AS ts_ns, tokens FROM request_log
            WHERE run_id = $run AND event = 'token' AND tokens > 0),
    ts AS (SELECT t.*, e.step_no, e.step_ms, e.prefill_tokens, e.decode_tokens
           FROM tok t ASOF LEFT JOIN ends e ON t.ts_ns >= e.end_ns),
    g0 AS (SELECT *, lag(ts_ns) OVER w AS prev_ns, step_no - lag(step_no) OVER w AS steps_in_gap
           FROM ts WINDOW w AS (PARTITION BY request_id ORDER BY ts_ns)),
    -- a token stamped after the next step already ended (vLLM's frontend stamps tokens as it receives them)
    -- gives a gap of one step too many and then one of none: that pair is its steps' doing, not queueing
    g AS (SELECT *, lead(steps_in_gap) OVER w AS next_steps, lag(steps_in_gap) OVER w AS prev_steps
          FROM g0 WINDOW w AS (PARTITION BY request_id ORDER BY ts_ns)),
    pre AS (SELECT request_id, ts_ns FROM request_log WHERE run_id = $run AND event = 'preempted'),
    gaps AS (
        SELECT g.request_id, g.ts_ns, g.tokens, g.steps_in_gap, g.step_ms, g.prefill_tokens, g.decode_tokens,
               (g.ts_ns - g.prev_ns) / 1e6 AS gap_ms, (g.ts_ns - g.prev_ns) / 1e6 / g.tokens AS itl_ms,
               CASE WHEN EXISTS (SELECT 1 FROM pre p WHERE p.request_id = g.request_id
                                 AND p.ts_ns > g.prev_ns AND p.ts_ns <= g.ts_ns) THEN 'preemption'
                    WHEN g.steps_in_gap IS NULL OR (g.steps_in_gap < 1 AND coalesce(g.prev_steps, 0) < 2)
                        THEN 'unattributed'
                    WHEN g.steps_in_gap > g.tokens AND NOT (g.steps_in_gap = g.tokens + 1 AND g.next_steps = 0)
                        THEN 'queueing'
                    WHEN g.prefill_tokens >= $long THEN 'prefill'
                    WHEN (g.ts_ns - g.prev_ns) / 1e6 >= $host_ratio * g.step_ms THEN 'host'
                    ELSE 'other' END AS cause
        FROM g WHERE g.prev_ns IS NOT NULL),
    samples AS (SELECT gaps.* FROM gaps, range(gaps.tokens)),
    q AS (SELECT count(*) AS n, quantile_cont(itl_ms, 0.5) AS p50, quantile_cont(itl_ms, $quantile) AS p99
          FROM samples)"""

ITL_SUMMARY_SQL = f"""WITH {ITL_GAPS}
    SELECT q.n AS itl_samples, q.p50 AS itl_p50_ms, q.p99 AS itl_p99_ms,
           (SELECT count(*) FROM gaps) AS gaps,
           (SELECT count(*) FROM samples, q WHERE itl_ms >= q.p99) AS tail_samples,
           (SELECT sum(itl_ms - q.p50) FROM samples, q WHERE itl_ms >= q.p99) AS tail_excess_ms
    FROM q"""

ITL_TAIL_SQL = f"""WITH {ITL_GAPS}
    SELECT cause, count(*) AS samples, sum(itl_ms - q.p50) AS excess_ms, max(prefill_tokens) AS max_prefill_tokens
    FROM samples, q WHERE itl_ms >= q.p99 GROUP BY cause ORDER BY cause"""

# per request over the TPOT SLO: its TPOT with one cause's excess removed (its gaps brought to the median).
# Written apart from agent/read/itl.py's query (which joins the per-cause excess to the requests once): here
# one correlated sum per request and cause, so a slip in either formulation shows as a difference.
ITL_TPOT_SQL = f"""WITH {ITL_GAPS},
    slow AS (SELECT request_id, tpot_s, output_tokens FROM requests WHERE run_id = $run AND tpot_s > $slo_s),
    c AS (SELECT unnest($causes) AS cause)
    SELECT c.cause, (SELECT count(*) FROM slow) AS violations,
           (SELECT count(*) FROM slow o
            WHERE o.tpot_s - (SELECT coalesce(sum(greatest(x.gap_ms - q.p50 * x.tokens, 0)), 0)
                              FROM gaps x WHERE x.request_id = o.request_id AND x.cause = c.cause)
                             / 1e3 / (o.output_tokens - 1) <= $slo_s) AS explained
    FROM c, q WHERE EXISTS (SELECT 1 FROM slow) ORDER BY c.cause"""




# --- analyzers/itl.py: the chunk-size what-if, one budget per run of it -----------------------------------

PREDICT_SQL = f"""WITH {ITL_GAPS},
    s AS (SELECT *, greatest($budget - decode_tokens, 1) AS c,
                 cause NOT IN ('preemption', 'queueing', 'unattributed') AND prefill_tokens > $budget - decode_tokens
                     AS split
          FROM samples),
    -- what a gap holds besides its step (sampling, scheduling) when nothing else happens: pure decode gaps
    o AS (SELECT coalesce(quantile_cont(gap_ms - step_ms, 0.5)
                          FILTER (WHERE steps_in_gap = 1 AND prefill_tokens = 0 AND cause = 'other'), 0) AS ovh
          FROM gaps),
    pred AS (
        SELECT itl_ms FROM s WHERE NOT split
        UNION ALL
        SELECT (CASE WHEN j = 0 THEN gap_ms - step_ms ELSE (SELECT ovh FROM o) END
                + $base_ms + ($slope + (step_ms - $base_ms - $slope * prefill_tokens) / prefill_tokens)
                * least(c, prefill_tokens - j * c)) / tokens
        FROM s, range(CAST(ceil(prefill_tokens / c) AS BIGINT)) AS r(j) WHERE split)
    SELECT quantile_cont(itl_ms, $quantile) AS itl_p99_ms, count(*) AS itl_samples FROM pred"""

# --- the rest that changed ------------------------------------------------------------------------------

PREEMPTIONS = """SELECT count(*) AS preemptions, count(DISTINCT request_id) AS preempted_requests
    FROM request_log WHERE run_id = $run AND event = 'preempted'"""

PREFIX_PREEMPTED = """SELECT count(*) FROM request_events r JOIN sources s USING (source_id)
            WHERE r.event = 'preempted' AND s.run_id = ?"""

LENGTHS_SQL = """SELECT prompt_tokens + k AS tokens
    FROM requests, range(greatest(output_tokens, 1)::BIGINT) AS r(k) WHERE run_id = $run AND prompt_tokens > 0"""

# the tokens pages of $p would have served on top of today's hits, per first admission: the whole $p-pages of
# the shared prefix short of the prompt's last token (always computed), less what pages of P serve (whole P-pages
# of the shared prefix, as far as cacheable) or hit. Written apart from agent/read/queries.py's SMALLER_PAGES_SQL
# (which floors each bound with `//`): here the bound is taken first and floored by its remainder.
SMALLER_PAGE_SQL = """WITH l AS (
        SELECT greatest(x.shared_tokens, x.hit_tokens) AS shared, x.prompt_tokens, x.page_size_tokens AS big,
               x.cacheable_tokens, x.hit_tokens
        FROM prefix_lookups x JOIN sources s USING (source_id) WHERE s.run_id = $run AND x.kind = 'first'),
    m AS (SELECT least(shared, prompt_tokens - 1) AS reach,
                 greatest(least(shared - shared % big, cacheable_tokens), hit_tokens) AS served
          FROM l),
    w AS (SELECT reach - reach % $p AS small, served FROM m)
    SELECT coalesce(sum(small - served) FILTER (WHERE small > served), 0) AS saved_tokens FROM w"""


def latency_histogram_sql(metric: str) -> str:
    """Today's latency_histogram SQL for one run ($run_id, $bins); the ITL one sampled requests above 1M
    token events (never in the fixtures: k = 1)."""
    if metric == "itl":
        src = """(SELECT s.run_id, (s.ts_ns - 1000 * s.cached_tokens - lag(s.ts_ns - 1000 * s.cached_tokens) OVER w)
                          / 1e9 / s.tokens AS itl_s
                   FROM request_log s, range(s.tokens) AS k(i)
                   WHERE s.event = 'token' AND s.tokens > 0 AND hash(s.runtime_request_id) % 1 = 0 AND s.run_id = $run_id
                   WINDOW w AS (PARTITION BY s.run_id, s.request_id ORDER BY s.ts_ns))"""
        col = "itl_s"
    else:
        src, col = "requests", {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s", "queue": "queue_s"}[metric]
    return f"""
        WITH v AS (SELECT {col} AS x FROM {src} WHERE {col} > 0 AND run_id = $run_id),
             b AS (SELECT ln(min(x)) AS lo, greatest(ln(max(x)) - ln(min(x)), 1e-9) AS span FROM v),
             k AS (SELECT least(floor((ln(x) - lo) / span * $bins), $bins - 1) AS i FROM v, b)
        SELECT exp(lo + i * span / $bins) AS lo_s, exp(lo + (i + 1) * span / $bins) AS hi_s, count(*)
        FROM k, b GROUP BY i, lo, span ORDER BY i"""
