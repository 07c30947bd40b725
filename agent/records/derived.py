"""Derived tables: per-request rows and per-token gaps, computed once and kept incrementally.

The `requests` and `itl` views used to re-derive every request and every inter-token gap
from all raw `request_events` at every read (a window over millions of events, and one row
per output token). Now:

- `request_rows` holds one row per request (arrival-keyed, as `request_log` numbers them)
  as mergeable partial aggregates: min/max times, summed tokens, counts, flags;
- `token_gaps` holds one row per token event (tokens > 0) after a request's first: the
  gap since the previous one (`prev_ns`), the tokens it brought and whether the request
  was preempted inside it, on the engine's clock (a token event's ts_ns less its `cached_tokens`
  lead in us: vLLM's output stamps; HF's events have none). A gap bringing k tokens stands for k ITL samples of gap / k:
  it is never expanded into k rows (`tokens` is a weight);
- each gap also keeps its steps (the run's lowest rank): how many ended in it, the last one
  ended by its token, its neighbours' counts: what ITL attribution joins (agent/read/itl.py);
- `derived_state` says how far they go: every `request_events` (`steps`) row with
  `rowid <= wm` is in them, and there were `n` such rows when they were made.

The views `requests` and `itl` are the stored rows plus the delta: the events past the
watermark, folded into the stored rows of their requests (`STAGES` below). So every read
is exact whatever the state (a fresh store's delta is everything; a stale file's delta is
what its writer appended since the last refresh), and `refresh(con)` only moves work from
reads to one place: it writes the delta into the tables and moves the watermarks. The
writable connections refresh: the sidecar's read API before each read, `Store.close`,
the fixture loader and the benchmark; read-only readers only read. ITL attribution uses the
gaps' steps only when nothing was written since the refresh (`attribution_current`).

Incremental by key: the events of a request id (a runtime label that runtimes reuse,
numbered by arrival) continue in time order in the common case, so new events extend the
key's latest stored request (its arrival number, aggregates, last token and last
preemption). A key whose new events are not all later than everything stored for it (a
late event) is recomputed from all its raw events. New steps re-tie only the gaps at or
after their earliest start (`ATTRIBUTE`).

Deletions: rows deleted from `request_events` below the watermark and not folded in make a read
raise (the derived rows no longer describe the raw rows); a retention roll folds its deletion in
before its commit (`fold`, in its transaction), so readers never see that state. A writable connection's `refresh` folds in a
deletion of the oldest rows (what a retention roll does): the keys with an event before the
earliest one left are recomputed from what is left, the gaps whose steps may have gone are
re-tied; when the request rows then do not hold every raw event once (rows were deleted
elsewhere) it rebuilds them all.

`refresh` also folds the ten-second step and KV rollups (steprollup.py, kvrollup.py) in the same transaction.

Pure SQL over a connection the caller passes; imports nothing of ours outside this floor.
"""

from __future__ import annotations

from typing import Any

from . import kvrollup, steprollup
from .columns import Tables, table_ddl

# table -> its columns (name, DuckDB type, one-line doc) in insert order (records/columns.py)
TABLES: Tables = {
    "request_rows": [
        ("run_id", "VARCHAR", "sources.run_id"),
        ("request_id", "VARCHAR", "request_log.request_id: the runtime id, '#<n>' added for its n-th arrival"),
        ("runtime_request_id", "VARCHAR", "the runtime's id (a label runtimes reuse)"),
        ("arrival_no", "BIGINT", "which arrival of the runtime id this request is (1 = first)"),
        ("arrival_ns", "BIGINT", "first arrival event"),
        ("scheduled_ns", "BIGINT", "first scheduled event"),
        ("first_token_ns", "BIGINT", "first token event"),
        ("last_token_ns", "BIGINT", "last token event"),
        ("output_tokens", "HUGEINT", "tokens of its token events; NULL without any"),
        ("prompt_tokens", "INTEGER", "tokens of its arrival event"),
        ("cached_tokens", "INTEGER", "cached tokens of its first scheduled event"),
        ("scheduled_cached_sum", "HUGEINT", "cached tokens of all its scheduled events"),
        ("preemptions", "BIGINT", "preempted events"),
        ("aborted", "BOOLEAN", "an aborted event was seen"),
        ("finished", "BOOLEAN", "a finished event was seen"),
        ("last_gap_ns", "BIGINT", "engine time of the last token event with tokens > 0 (where the next gap starts)"),
        ("last_preempted_ns", "BIGINT", "last preempted event"),
        ("last_ts", "BIGINT", "its last event of any kind"),
        ("events", "BIGINT", "its events"),
        ("first_wall_ns", "BIGINT", "its first event, wall clock (Unix ns): rows deleted before it leave it whole"),
        ("queued_ns", "BIGINT", "first queued event (the engine's own queue entry, e.g. vLLM's QUEUED); NULL: none"),
        ("first_token_at_ns", "BIGINT", "engine time of its first token event (ts_ns - 1000 * cached_tokens)"),
        ("last_token_at_ns", "BIGINT", "engine time of its last token event"),
    ],
    "token_gaps": [
        ("run_id", "VARCHAR", "sources.run_id"),
        ("request_id", "VARCHAR", "request_rows.request_id"),
        ("ts_ns", "BIGINT", "the token event's engine time (ts_ns - 1000 * cached_tokens: the runtime's output "
                            "stamp where it gives one, vLLM's ITL clock; else its ts_ns)"),
        ("prev_ns", "BIGINT", "the request's previous token event with tokens > 0, engine time likewise"),
        ("tokens", "INTEGER", "tokens the event brought: the gap stands for this many ITL samples"),
        ("preempted", "BOOLEAN", "a preempted event of the request lies in (prev_ns, ts_ns]"),
        # its steps (the run's lowest rank): what ITL attribution needs that no threshold changes
        ("attributed", "BOOLEAN", "the columns below are those of the steps folded in (derived_state 'steps')"),
        ("steps_in_gap", "BIGINT", "steps that ended in (prev_ns, ts_ns]: the step number of the last step ended by "
         "ts_ns minus that of the last one ended by prev_ns (steps numbered by start); NULL: none ended by one"),
        ("step_ms", "DOUBLE", "the last step ended by ts_ns: its time, ms (GPU time when timed, else host time)"),
        ("prefill_tokens", "INTEGER", "the last step ended by ts_ns: its prefill tokens"),
        ("decode_tokens", "INTEGER", "the last step ended by ts_ns: its decode tokens"),
        ("next_steps", "BIGINT", "steps_in_gap of the request's next gap (it starts at ts_ns); NULL: none"),
        ("prev_steps", "BIGINT", "steps_in_gap of the request's previous gap (it ends at prev_ns); NULL: none"),
    ],
    "gap_rank": [
        ("run_id", "VARCHAR", "sources.run_id"),
        ("rank", "SMALLINT", "the lowest rank of the run's steps, whose steps the run's gaps are tied to"),
    ],
    "derived_state": [
        ("name", "VARCHAR PRIMARY KEY", "the raw table followed (request_events, steps)"),
        ("wm", "BIGINT", "every row with rowid <= wm is in the derived tables"),
        ("n", "BIGINT", "rows with rowid <= wm when they were made (fewer now: rows were deleted)"),
    ],
}

EVENT_ORDER = "CASE event WHEN 'arrival' THEN 1 WHEN 'scheduled' THEN 2 WHEN 'queued' THEN 2 ELSE 0 END"  # schema.REQUEST_EVENT_ORDER
_STATE = "(SELECT {col} FROM derived_state WHERE name = 'request_events')"
_MIN_NS = "-9223372036854775808"
_CODE = ("CASE e.event WHEN 'arrival' THEN 0 WHEN 'scheduled' THEN 1 WHEN 'token' THEN 2 WHEN 'finished' THEN 3 "
         "WHEN 'aborted' THEN 4 WHEN 'cancelled' THEN 4 WHEN 'preempted' THEN 5 WHEN 'queued' THEN 7 ELSE 6 END")
# (a cancel closes a request as an abort does; 'queued' belongs to the arrival it follows)

# The delta: stages over the raw events past the watermark ({new} filters `request_events r`; {upto} filters
# `request_events e`, the late keys' events, to the slice a fold stops at: `true` in the views), each one
# SELECT over the raw tables, the derived tables and the stages before it. The views inline them as CTEs;
# `refresh` materializes each once. The last ones:
#   merged - request rows to add (new requests, and stored ones extended: they replace `folded`),
#   folded - stored request rows the merged ones replace (the latest request of keys that continue),
#   redo   - stored request rows of keys recomputed from all their events (their gaps are redone too),
#   gaps   - token gap rows to add.
STAGES: list[tuple[str, str]] = [
    ("ev_new", """SELECT s.run_id, r.request_id AS rid, r.ts_ns, r.event, r.tokens, r.cached_tokens,
               s.wall_minus_mono_ns AS wall
        FROM request_events r JOIN sources s USING (source_id) WHERE {new}"""),
    # keys (run, runtime id) touched, numbered (key_id) so the windows below partition by an integer
    # (and the keys `forced` names: recomputed from all their events, see `refresh`)
    ("touched", """SELECT run_id, rid, min(first_new) AS first_new, min(first_other) AS first_other,
               row_number() OVER () AS key_id,
               CAST(sum(arrivals) AS BIGINT) AS arrivals, min(arrival_ts) AS arrival_ts, bool_or(forced) AS forced
        FROM (SELECT run_id, rid, min(ts_ns) AS first_new,
                     min(ts_ns) FILTER (WHERE event NOT IN ('finished', 'aborted', 'cancelled')) AS first_other,
                     count(*) FILTER (WHERE event = 'arrival') AS arrivals,
                     min(ts_ns) FILTER (WHERE event = 'arrival') AS arrival_ts, false AS forced
              FROM ev_new GROUP BY run_id, rid
              UNION ALL SELECT run_id, rid, NULL, NULL, 0, NULL, true FROM forced)
        GROUP BY run_id, rid"""),
    # per key touched: the latest stored arrival; in order when its new events all follow everything stored
    # (base_no: the key's arrivals stored; its first request may have none: the tail of a life whose arrival a
    # retention roll deleted, or a slice ended before it; request_log numbers the events before a key's first
    # arrival with it, so a new arrival continues that request). An end (finished, aborted, cancelled) at the
    # time of the stored last event is in order too, when nothing else new is and the stored request did not
    # arrive at that time: an end only sets flags and counts, whatever its place among events of its time, and a
    # runtime stamps a request's end with its last token's time (vLLM, the frontend hook), so a slice boundary
    # between the two is common; read as late, it refolded the key from all the raw rows (O(history) a slice:
    # the live fold fell minutes behind past ~70M events, benchmarks/gpu_rate.py)
    ("keys", """SELECT t.key_id, t.run_id, t.rid, t.arrivals, t.arrival_ts, coalesce(h.arrived, 0) AS base_no,
               NOT t.forced AND (h.last_ts IS NULL OR t.first_new > h.last_ts
                                 OR (t.first_new = h.last_ts AND coalesce(t.first_other > h.last_ts, true)
                                     AND coalesce(h.last_arrival < h.last_ts, true))) AS in_order
        FROM touched t LEFT JOIN (
            SELECT q.run_id, q.runtime_request_id AS rid, count(q.arrival_ns) AS arrived, max(q.last_ts) AS last_ts,
                   max(q.arrival_ns) AS last_arrival
            FROM request_rows q JOIN touched t ON q.run_id = t.run_id AND q.runtime_request_id = t.rid
            GROUP BY q.run_id, q.runtime_request_id) h ON h.run_id = t.run_id AND h.rid = t.rid"""),
    ("late", "SELECT key_id, run_id, rid FROM keys WHERE NOT in_order"),
    # events numbered by arrival as request_log numbers them: the new events of keys that continue in time
    # order (after the key's latest stored arrival), every event of the late keys. With at most one arrival
    # among a key's new events an event's number is the stored one, plus one from that arrival on (an
    # arrival sorts after a token, finish or preemption at its time, before a scheduling); otherwise a window
    # counts them. code: arrival 0, scheduled 1, token 2, finished 3, aborted 4, preempted 5
    ("named", f"""SELECT k.key_id,
               CASE WHEN k.arrivals = 1 AND (e.ts_ns > k.arrival_ts OR (e.ts_ns = k.arrival_ts AND e.event IN
                         ('arrival', 'scheduled', 'queued'))) THEN k.base_no + 1 ELSE greatest(1, k.base_no) END AS arrival_no,
               e.ts_ns, {_CODE} AS code, e.tokens, e.cached_tokens, e.wall
        FROM ev_new e JOIN keys k ON k.run_id = e.run_id AND k.rid = e.rid WHERE k.in_order AND k.arrivals <= 1
        UNION ALL
        SELECT key_id, greatest(1, base_no + count(*) FILTER (WHERE code = 0) OVER (
                   PARTITION BY key_id ORDER BY ts_ns, CASE code WHEN 0 THEN 1 WHEN 1 THEN 2 WHEN 7 THEN 2 ELSE 0 END
                   ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)),
               ts_ns, code, tokens, cached_tokens, wall
        FROM (SELECT k.key_id, k.base_no, e.ts_ns, {_CODE} AS code, e.tokens, e.cached_tokens, e.wall
              FROM ev_new e JOIN keys k ON k.run_id = e.run_id AND k.rid = e.rid WHERE k.in_order AND k.arrivals > 1
              UNION ALL
              SELECT k.key_id, 0, e.ts_ns, {_CODE}, e.tokens, e.cached_tokens, s.wall_minus_mono_ns
              FROM request_events e JOIN late k ON k.rid = e.request_id
              JOIN sources s ON s.source_id = e.source_id AND s.run_id = k.run_id WHERE {{upto}})"""),
    ("part", """SELECT k.run_id, CASE WHEN a.arrival_no = 1 THEN k.rid ELSE k.rid || '#' || a.arrival_no END AS request_id,
               k.rid AS runtime_request_id, a.* EXCLUDE (key_id)
        FROM (SELECT key_id, arrival_no,
                     min(ts_ns) FILTER (WHERE code = 0) AS arrival_ns,
                     min(ts_ns) FILTER (WHERE code = 1) AS scheduled_ns,
                     min(ts_ns) FILTER (WHERE code = 2) AS first_token_ns,
                     max(ts_ns) FILTER (WHERE code = 2) AS last_token_ns,
                     CAST(sum(tokens) FILTER (WHERE code = 2) AS HUGEINT) AS output_tokens,
                     max(tokens) FILTER (WHERE code = 0) AS prompt_tokens,
                     arg_min(cached_tokens, ts_ns) FILTER (WHERE code = 1) AS cached_tokens,
                     CAST(sum(cached_tokens) FILTER (WHERE code = 1) AS HUGEINT) AS scheduled_cached_sum,
                     count(*) FILTER (WHERE code = 5) AS preemptions,
                     bool_or(code = 4) AS aborted, bool_or(code = 3) AS finished,
                     max(ts_ns - 1000 * cached_tokens) FILTER (WHERE code = 2 AND tokens > 0) AS last_gap_ns,
                     max(ts_ns) FILTER (WHERE code = 5) AS last_preempted_ns,
                     max(ts_ns) AS last_ts, count(*) AS events, min(ts_ns + wall) AS first_wall_ns,
                     min(ts_ns) FILTER (WHERE code = 7) AS queued_ns,
                     min(ts_ns - 1000 * cached_tokens) FILTER (WHERE code = 2) AS first_token_at_ns,
                     max(ts_ns - 1000 * cached_tokens) FILTER (WHERE code = 2) AS last_token_at_ns
              FROM named GROUP BY key_id, arrival_no) a JOIN keys k USING (key_id)"""),
    ("folded", """SELECT q.*, k.key_id FROM request_rows q
        JOIN (SELECT DISTINCT run_id, request_id FROM part) p ON p.run_id = q.run_id AND p.request_id = q.request_id
        JOIN keys k ON k.run_id = q.run_id AND k.rid = q.runtime_request_id WHERE k.in_order"""),
    ("redo", """SELECT q.run_id, q.request_id FROM request_rows q
        JOIN late k ON k.run_id = q.run_id AND k.rid = q.runtime_request_id"""),
    ("merged", """SELECT run_id, request_id, any_value(runtime_request_id) AS runtime_request_id,
               any_value(arrival_no) AS arrival_no, min(arrival_ns) AS arrival_ns, min(scheduled_ns) AS scheduled_ns,
               min(first_token_ns) AS first_token_ns, max(last_token_ns) AS last_token_ns,
               CAST(sum(output_tokens) AS HUGEINT) AS output_tokens, max(prompt_tokens) AS prompt_tokens,
               arg_min(cached_tokens, scheduled_ns) AS cached_tokens,
               CAST(sum(scheduled_cached_sum) AS HUGEINT) AS scheduled_cached_sum,
               CAST(sum(preemptions) AS BIGINT) AS preemptions,
               bool_or(aborted) AS aborted, bool_or(finished) AS finished, max(last_gap_ns) AS last_gap_ns,
               max(last_preempted_ns) AS last_preempted_ns, max(last_ts) AS last_ts,
               CAST(sum(events) AS BIGINT) AS events, min(first_wall_ns) AS first_wall_ns,
               min(queued_ns) AS queued_ns, min(first_token_at_ns) AS first_token_at_ns,
               max(last_token_at_ns) AS last_token_at_ns
        FROM (SELECT * FROM part UNION ALL BY NAME SELECT * EXCLUDE (key_id) FROM folded)
        GROUP BY run_id, request_id"""),
    # per request: its new token events (tokens > 0) after the stored tail of the request it continues (its
    # last token): each one's gap since the one before. Requests with a preemption among them (or after the
    # stored last token) take the stream of tokens and preemptions: a preemption sorts before a token at its
    # time and only preemptions lie between two tokens, so a gap holds one when the row before its token is one
    ("gaps", f"""WITH
            tail AS (SELECT key_id, arrival_no, last_gap_ns, last_preempted_ns > coalesce(last_gap_ns, {_MIN_NS}) AS pre
                     FROM folded),
            pre AS (SELECT DISTINCT key_id, arrival_no FROM named WHERE code = 5
                    UNION SELECT key_id, arrival_no FROM tail WHERE pre),
            s AS (SELECT key_id, arrival_no, CASE WHEN code = 2 THEN ts_ns - 1000 * cached_tokens ELSE ts_ns END AS ts_ns,
                         code = 2 AS is_token, tokens FROM named
                  WHERE (code = 2 AND tokens > 0) OR code = 5
                  UNION ALL SELECT key_id, arrival_no, last_gap_ns, true, NULL FROM tail WHERE last_gap_ns IS NOT NULL
                  UNION ALL SELECT f.key_id, f.arrival_no, f.last_preempted_ns, false, NULL FROM folded f
                            JOIN tail t USING (key_id, arrival_no) WHERE t.pre),
            plain AS (SELECT key_id, arrival_no, ts_ns, tokens, false AS preempted,
                             lag(ts_ns) OVER (PARTITION BY key_id, arrival_no ORDER BY ts_ns) AS prev_ns
                      FROM s WHERE is_token AND NOT EXISTS (
                          SELECT 1 FROM pre p WHERE p.key_id = s.key_id AND p.arrival_no = s.arrival_no)),
            mixed AS (SELECT * FROM (
                        SELECT key_id, arrival_no, ts_ns, tokens, is_token, NOT lag(is_token) OVER w AS preempted,
                               last_value(CASE WHEN is_token THEN ts_ns END IGNORE NULLS) OVER (
                                   w ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_ns
                        FROM s WHERE EXISTS (
                            SELECT 1 FROM pre p WHERE p.key_id = s.key_id AND p.arrival_no = s.arrival_no)
                        WINDOW w AS (PARTITION BY key_id, arrival_no ORDER BY ts_ns, is_token))
                      WHERE is_token)
        SELECT k.run_id, CASE WHEN g.arrival_no = 1 THEN k.rid ELSE k.rid || '#' || g.arrival_no END AS request_id,
               g.ts_ns, g.prev_ns, g.tokens, g.preempted, false AS attributed, NULL::BIGINT AS steps_in_gap,
               NULL::DOUBLE AS step_ms, NULL::INTEGER AS prefill_tokens, NULL::INTEGER AS decode_tokens,
               NULL::BIGINT AS next_steps, NULL::BIGINT AS prev_steps
        FROM (SELECT key_id, arrival_no, ts_ns, prev_ns, tokens, preempted FROM plain
              UNION ALL SELECT key_id, arrival_no, ts_ns, prev_ns, tokens, preempted FROM mixed) g
        JOIN keys k USING (key_id)
        WHERE g.tokens IS NOT NULL AND g.prev_ns IS NOT NULL"""),
]
DELTA = ",\n    ".join(f"{name} AS ({sql})" for name, sql in STAGES)

# --- the steps of each gap (ITL attribution's join, agent/read/itl.py), kept with the gaps ---------------------
#
# A gap is tied to the steps of its run's lowest rank: the last step ended by its token (by end time,
# ts_ns + host_ms: an ASOF join) and the last step ended by the previous token; the difference of their
# numbers (steps numbered by start) is the steps that ended in the gap. A step that arrives later can
# change that only for gaps at or after its start (steps end after they start; those before it keep their
# matches and its number comes after theirs), so a refresh re-attributes the gaps from the earliest start of
# the steps new since the last one (all of a run's gaps when its lowest rank changed, or steps were deleted),
# the new gaps, and the neighbour counts (next_steps, prev_steps) of those and of the gap before each.

# Under vLLM's async scheduling (run label `async_scheduling` True) a step's host call can return before its GPU work
# ends, and its output is then handed out after the next step's host call: the last step ended by a token is its
# own or the one after it (the H100 matrix's runs: the one after; H200 runs of an older build, whose host call
# waited for the GPU: its own). There each step row carries the larger prefill and time of itself and the step
# before (`lag`): a gap is a prefill's when either step was one, the host's only when longer than both.
# ATTRIBUTION_RULE numbers this rule: a store whose gaps were tied by another has them all tied again once.

STEP_MS = "CASE WHEN isnan(t.gpu_ms) THEN t.host_ms ELSE t.gpu_ms END"
ATTRIBUTION_RULE = 2  # 1: every step's own shape; 2: with the step before's on runs scheduled asynchronously
ASYNC_RUNS = """SELECT run_id, bool_or(value = 'True') AS async FROM run_info WHERE key = 'async_scheduling'
                GROUP BY run_id"""

# over `todo` (run_id, request_id, ts_ns, prev_ns: the gaps to attribute). Only the steps from the start of
# the step last ended by the earliest prev_ns on are numbered (steps_in_gap is a difference of numbers)
ATTRIBUTE: list[tuple[str, str]] = [
    ("lr", """SELECT s.run_id, min(t.rank) AS rank FROM steps t JOIN sources s USING (source_id)
        WHERE s.run_id IN (SELECT DISTINCT run_id FROM todo) GROUP BY s.run_id"""),
    ("e0", """SELECT lr.run_id, lr.rank, max(t.ts_ns + CAST(t.host_ms * 1e6 AS BIGINT))
                 FILTER (WHERE t.ts_ns + CAST(t.host_ms * 1e6 AS BIGINT) <= m.min_prev) AS e0
        FROM lr JOIN (SELECT run_id, min(prev_ns) AS min_prev FROM todo GROUP BY run_id) m USING (run_id)
        JOIN sources s ON s.run_id = lr.run_id JOIN steps t ON t.source_id = s.source_id AND t.rank = lr.rank
        GROUP BY lr.run_id, lr.rank"""),
    ("lo", """SELECT e0.run_id, e0.rank, min(t.ts_ns) FILTER (
                 WHERE e0.e0 IS NULL OR t.ts_ns + CAST(t.host_ms * 1e6 AS BIGINT) >= e0.e0) AS lo
        FROM e0 JOIN sources s ON s.run_id = e0.run_id JOIN steps t ON t.source_id = s.source_id AND t.rank = e0.rank
        GROUP BY e0.run_id, e0.rank"""),
    # one step before `lo` too (it ends before e0, so no gap ties to it): the first step's previous one, for `lag`
    ("lo1", """SELECT lo.run_id, lo.rank, coalesce(max(t.ts_ns) FILTER (WHERE t.ts_ns < lo.lo), lo.lo) AS lo
        FROM lo JOIN sources s ON s.run_id = lo.run_id JOIN steps t ON t.source_id = s.source_id AND t.rank = lo.rank
        GROUP BY lo.run_id, lo.rank, lo.lo"""),
    ("ends", f"""SELECT lo.run_id, t.ts_ns + CAST(t.host_ms * 1e6 AS BIGINT) AS end_ns,
               CASE WHEN coalesce(ar.async, false) THEN greatest({STEP_MS}, lag({STEP_MS}) OVER w)
                    ELSE {STEP_MS} END AS step_ms,
               CASE WHEN coalesce(ar.async, false) THEN greatest(t.prefill_tokens, lag(t.prefill_tokens) OVER w)
                    ELSE t.prefill_tokens END AS prefill_tokens,
               t.decode_tokens,
               row_number() OVER w AS step_no
        FROM lo1 lo JOIN sources s ON s.run_id = lo.run_id
        JOIN steps t ON t.source_id = s.source_id AND t.rank = lo.rank AND t.ts_ns >= lo.lo
        LEFT JOIN ({ASYNC_RUNS}) ar ON ar.run_id = lo.run_id
        WINDOW w AS (PARTITION BY lo.run_id ORDER BY t.ts_ns, t.step_id)"""),
    ("att", """SELECT a.run_id, a.request_id, a.ts_ns, a.prev_ns, a.step_no - p.step_no AS steps_in_gap, a.step_ms,
               a.prefill_tokens, a.decode_tokens
        FROM (SELECT d.*, e.step_no, e.step_ms, e.prefill_tokens, e.decode_tokens
              FROM todo d ASOF LEFT JOIN ends e ON e.run_id = d.run_id AND d.ts_ns >= e.end_ns) a
        ASOF LEFT JOIN ends p ON p.run_id = a.run_id AND a.prev_ns >= p.end_ns"""),
]

# the stored rows still valid plus the delta's; `ok` raises when rows were deleted below the watermark
STORED_REQUESTS = """SELECT q.* FROM request_rows q
        WHERE NOT EXISTS (SELECT 1 FROM folded f WHERE f.run_id = q.run_id AND f.request_id = q.request_id)
          AND NOT EXISTS (SELECT 1 FROM redo d WHERE d.run_id = q.run_id AND d.request_id = q.request_id)"""
STORED_GAPS = """SELECT g.* FROM token_gaps g
        WHERE NOT EXISTS (SELECT 1 FROM redo d WHERE d.run_id = g.run_id AND d.request_id = g.request_id)"""

OK_CTE = """ok AS (SELECT CASE WHEN count(*) = {n} AND {state_wm} IS NOT DISTINCT FROM {wm} THEN true
                       ELSE error('phasescope: rows were deleted from request_events since the derived tables '
                                  || 'were made (request_rows, token_gaps); open the file read-write once '
                                  || '(phasescope agent, or Store(path).close()) to rebuild them') END AS ok
                  FROM request_events WHERE rowid <= {wm})"""

# per request, exactly as docs/definitions.md defines; seconds (the columns and order of the view it replaces)
REQUESTS_SELECT = """SELECT run_id, request_id, runtime_request_id, arrival_ns, scheduled_ns, first_token_ns,
           last_token_ns, coalesce(output_tokens, 0) AS output_tokens, prompt_tokens, cached_tokens,
           coalesce(scheduled_cached_sum, 0) - coalesce(cached_tokens, 0) AS readmit_cached_tokens,
           preemptions,
           CASE WHEN aborted THEN 'aborted' WHEN finished THEN 'finished' ELSE 'running' END AS status,
           (scheduled_ns - coalesce(queued_ns, arrival_ns)) / 1e9 AS queue_s,
           (first_token_ns - arrival_ns) / 1e9 AS ttft_s,
           (coalesce(first_token_at_ns, first_token_ns) - scheduled_ns) / 1e9 AS prefill_s,
           (coalesce(last_token_at_ns, last_token_ns) - coalesce(first_token_at_ns, first_token_ns)) / 1e9 AS decode_s,
           CASE WHEN coalesce(output_tokens, 0) > 1
                THEN (coalesce(last_token_at_ns, last_token_ns) - coalesce(first_token_at_ns, first_token_ns))
                     / 1e9 / (coalesce(output_tokens, 0) - 1) END AS tpot_s,
           (last_token_ns - arrival_ns) / 1e9 AS e2e_s,
           (queued_ns - arrival_ns) / 1e9 AS frontend_s"""

ITL_SELECT = """SELECT run_id, request_id, ts_ns, prev_ns, tokens, preempted,
           (ts_ns - prev_ns) / 1e9 / tokens AS itl_s, attributed, steps_in_gap, step_ms, prefill_tokens, decode_tokens,
           next_steps, prev_steps"""

VIEW_DOCS = {
    "requests": "one row per request: queue, TTFT, prefill, decode, TPOT, E2E in seconds; cached tokens of the "
                "first admission, re-admission reuse apart",
    "itl": "one row per token event after a request's first: the gap since the previous one (prev_ns) per token "
           "it brought (itl_s, seconds); it stands for `tokens` ITL samples (weight by tokens, never expand); "
           "with its steps when `attributed` (agent/read/itl.py)",
}


def _fill(text: str, wm: str, n: str, new: str) -> str:
    return (text.replace("{new}", new).replace("{upto}", "true").replace("{wm}", wm).replace("{n}", n)
            .replace("{state_wm}", _STATE.format(col="coalesce(max(wm), -1)")))


def views(state: tuple[int, int] | None = None, rowids: bool = True) -> dict[str, str]:
    """SQL of the views `requests` and `itl`.

    `state`: (wm, n) written in as constants (DuckDB then reads only the rows past the watermark and
    checks the count below it cheaply); None: read from `derived_state` (always right, each read scans
    the row ids). `rowids=False` for stores whose raw tables are views over files (Parquet exports):
    every raw event is delta, the derived tables stay empty."""
    if not rowids:
        wm, n, new = "-1", "0", "true"
        ok = "ok AS (SELECT true AS ok)"
    else:
        if state is None:
            wm, n = _STATE.format(col="coalesce(max(wm), -1)"), _STATE.format(col="coalesce(max(n), 0)")
        else:
            wm, n = str(int(state[0])), str(int(state[1]))
        new = f"r.rowid > {wm}"
        ok = OK_CTE
    head = "WITH " + ok + ", forced AS (SELECT NULL::VARCHAR AS run_id, NULL::VARCHAR AS rid WHERE false)," + DELTA
    return {
        "requests": _fill(f"""{head}
            {REQUESTS_SELECT}
            FROM ({STORED_REQUESTS} UNION ALL BY NAME SELECT * FROM merged), ok WHERE ok.ok""", wm, n, new),
        "itl": _fill(f"""{head}
            {ITL_SELECT}
            FROM ({STORED_GAPS} UNION ALL SELECT * FROM gaps), ok WHERE ok.ok""", wm, n, new),
    }


# columns added after files were written: (table, column, type); NULL in the rows made before (no such events then)
ADDED = (("request_rows", "queued_ns", "BIGINT"), ("request_rows", "first_token_at_ns", "BIGINT"),
         ("request_rows", "last_token_at_ns", "BIGINT"))


def ddl(rowids: bool = True) -> list[str]:
    """Statements creating the derived tables and their views (idempotent; the views read the state)."""
    out = table_ddl(TABLES, ADDED)
    for view, sql in views(None, rowids).items():
        out.append(f"CREATE OR REPLACE VIEW {view} AS {sql}")
    return out


def readable(con: Any) -> bool:
    """Make a store written before the derived tables existed readable as it is (a read-only connection
    may do it): temp, empty derived tables and temp views that derive everything from the raw events (exact,
    at today's cost). Returns True when it had to."""
    if con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'derived_state'").fetchone()[0]:
        return False
    for stmt in ddl(rowids=False):
        if stmt.startswith(("COMMENT", "ALTER")):
            continue
        con.execute(stmt.replace("CREATE TABLE IF NOT EXISTS", "CREATE TEMP TABLE IF NOT EXISTS")
                    .replace("CREATE OR REPLACE VIEW", "CREATE OR REPLACE TEMP VIEW"))
    return True


def state(con: Any, name: str = "request_events") -> tuple[int, int] | None:
    """(wm, n) of the derived tables for raw table `name` (request_events, steps), or None before the first
    refresh."""
    row = con.execute("SELECT wm, n FROM derived_state WHERE name = ?", [name]).fetchone()
    return (int(row[0]), int(row[1])) if row else None


def install(con: Any) -> None:
    """(Re)create the views with the current state written in (the fast form). Needs a writable connection."""
    st = state(con) or (-1, 0)
    for view, sql in views(st).items():
        con.execute(f"CREATE OR REPLACE VIEW {view} AS {sql}")


def attribution_current(con: Any) -> bool:
    """Whether every gap's stored steps are those of the steps and events in the store now (nothing folded in
    since, nothing deleted): then ITL attribution reads them instead of joining the gaps to the steps."""
    ev, st, gaps = state(con), state(con, "steps"), state(con, "token_gaps")
    if ev is None or st is None or gaps is None or gaps[0] != ATTRIBUTION_RULE:
        return False
    for table, (wm, n) in (("request_events", ev), ("steps", st)):
        below, above = rowid_counts(con, table, wm)
        if below != n or above:
            return False
    return True


def rowid_counts(con: Any, table: str, wm: int) -> tuple[int, int]:
    """(rows of `table` with rowid <= `wm`, rows past it). Two statements with the watermark written in: DuckDB
    counts row ids without reading the rows (10M steps: ~2 ms, where one statement with two FILTERs reads every
    row id, 0.1-0.9 s)."""
    below = con.execute(f"SELECT count(*) FROM {table} WHERE rowid <= {int(wm)}").fetchone()[0]
    above = con.execute(f"SELECT count(*) FROM {table} WHERE rowid > {int(wm)}").fetchone()[0]
    return int(below), int(above)


def stored(con: Any) -> dict[str, str] | None:
    """SQL of the views `requests` and `itl` over the stored rows alone (no delta to derive), when they hold every
    raw request event in the store now (nothing written since the last fold, nothing deleted): the same rows as
    the views, without planning and running their delta. None otherwise (read the views)."""
    st = state(con)
    if st is None or con.execute("SELECT count(*) FROM duckdb_views() WHERE view_name = 'request_events'").fetchone()[0]:
        return None
    wm, n = st
    below, above = rowid_counts(con, "request_events", wm)
    if below != n or above:
        return None
    return {"requests": f"({REQUESTS_SELECT} FROM request_rows)", "itl": f"({ITL_SELECT} FROM token_gaps)"}


def _temp(con: Any, stages: list[tuple[str, str]], new_filter: str = "", upto: str = "true") -> None:
    for name, sql in stages:  # each stage once, as a temp table the later stages read by its name
        con.execute(f"CREATE OR REPLACE TEMP TABLE {name} AS {sql.replace('{new}', new_filter).replace('{upto}', upto)}")


def _drop(con: Any, stages: list[tuple[str, str]]) -> None:
    for name, _ in reversed(stages):
        con.execute(f"DROP TABLE IF EXISTS temp.{name}")


_KEY = "g.run_id = a.run_id AND g.request_id = a.request_id AND g.ts_ns = a.ts_ns AND g.prev_ns = a.prev_ns"


def _attribute(con: Any, new_gaps: bool) -> None:
    """Tie to their steps the gaps that are new (`new_gaps`: some may be), and those whose steps may have changed
    since the last refresh (see ATTRIBUTE); then the neighbour counts of those and of the gap before each. In
    the caller's transaction.

    Every filter on `token_gaps` is a constant (a time from which on, a list of runs), so DuckDB skips its row groups by their zone maps: a fold's cost follows its slice, not the
    history (with joins against the whole table, a slice of 200k events took seconds at 20M stored gaps and the
    live fold fell minutes behind at 80k events/s: benchmarks/gpu_rate.py). The new gaps are those the fold just
    made (temp table `fold_new_gaps`); every older one is attributed once `derived_state` has a 'token_gaps' row
    whose wm is ATTRIBUTION_RULE (None before the first such fold, or another rule: all are done). Not a row-id watermark: rows appended in the fold's own
    transaction carry transaction-local row ids until it commits."""
    st = state(con, "steps")
    wm, n = st or (-1, 0)
    top = con.execute("SELECT coalesce(max(rowid), -1) FROM steps").fetchone()[0]
    below, above = rowid_counts(con, "steps", wm)
    total = below + above
    gst = state(con, "token_gaps")
    if gst is not None and gst[0] != ATTRIBUTION_RULE:  # tied by another rule: all again
        gst = None
    # each run's lowest rank now: a run whose lowest rank is not the one its gaps were tied to is done again
    con.execute("""CREATE OR REPLACE TEMP TABLE rank_now AS SELECT s.run_id, min(t.rank) AS rank
                   FROM steps t JOIN sources s USING (source_id) GROUP BY s.run_id""")
    moved = [r[0] for r in con.execute("SELECT r.run_id FROM rank_now r LEFT JOIN gap_rank o USING (run_id) "
                                       "WHERE o.rank IS DISTINCT FROM r.rank").fetchall()]
    if st is None or gst is None:
        parts = ["true"]
    else:
        parts = []
        if moved:
            parts.append("g.run_id IN (" + ", ".join(_lit(r) for r in moved) + ")")
    if below != n and st is not None:  # steps deleted, oldest first (retention): every deleted step started
        # before the earliest one left (m), so ended before m + the longest step; a gap whose previous token
        # came after a step left ended at or after that keeps both its steps and what lies between them
        con.execute("""CREATE OR REPLACE TEMP TABLE kept AS
            WITH m AS (SELECT r.run_id, r.rank, min(t.ts_ns) AS m FROM rank_now r JOIN sources s ON s.run_id = r.run_id
                       JOIN steps t ON t.source_id = s.source_id AND t.rank = r.rank GROUP BY r.run_id, r.rank),
                 longest AS (SELECT CAST(ceil(coalesce(max(host_ms), 0) * 1e6) AS BIGINT) + 1 AS ns FROM steps)
            SELECT m.run_id, min(t.ts_ns + CAST(t.host_ms * 1e6 AS BIGINT))
                       FILTER (WHERE t.ts_ns + CAST(t.host_ms * 1e6 AS BIGINT) >= m.m + longest.ns) AS upto
            FROM m, longest JOIN sources s ON s.run_id = m.run_id JOIN steps t ON t.source_id = s.source_id
                 AND t.rank = m.rank GROUP BY m.run_id""")
        parts.append("NOT EXISTS (SELECT 1 FROM kept k WHERE k.run_id = g.run_id AND g.prev_ns >= k.upto)")
    if above:  # new steps: the gaps from the earliest start of each run's new steps on
        for run, since in con.execute(f"""SELECT s.run_id, min(t.ts_ns) FROM steps t JOIN sources s USING (source_id)
                                           WHERE t.rowid > {wm} GROUP BY s.run_id""").fetchall():
            parts.append(f"g.run_id = {_lit(run)} AND g.ts_ns >= {int(since)}")
    elif below == n and st is not None and gst is not None and not new_gaps and not moved:
        con.execute("DROP TABLE temp.rank_now")
        return  # nothing new, nothing deleted: every gap keeps its steps
    selects = [f"SELECT run_id, request_id, ts_ns, prev_ns FROM token_gaps g WHERE {p}" for p in parts]
    if _has_temp(con, "fold_new_gaps"):
        selects.append("SELECT run_id, request_id, ts_ns, prev_ns FROM temp.fold_new_gaps")
    con.execute("CREATE OR REPLACE TEMP TABLE todo AS " + (" UNION ".join(selects) if selects else
                "SELECT run_id, request_id, ts_ns, prev_ns FROM token_gaps WHERE false"))
    lo, hi = con.execute("SELECT min(prev_ns), max(ts_ns) FROM todo").fetchone()
    if lo is not None:
        _temp(con, ATTRIBUTE)
        con.execute(f"""UPDATE token_gaps g SET attributed = true, steps_in_gap = a.steps_in_gap, step_ms = a.step_ms,
                           prefill_tokens = a.prefill_tokens, decode_tokens = a.decode_tokens
                        FROM (SELECT run_id, request_id, ts_ns, prev_ns, any_value(steps_in_gap) AS steps_in_gap,
                                     any_value(step_ms) AS step_ms, any_value(prefill_tokens) AS prefill_tokens,
                                     any_value(decode_tokens) AS decode_tokens
                              FROM att GROUP BY ALL) a WHERE {_KEY} AND g.ts_ns >= {int(lo)}""")
        # the neighbour counts: the gaps done and the gap before each (whose next gap may be new); a neighbour's
        # token is at or after the earliest previous token of the gaps it neighbours (the bounds below)
        con.execute(f"""CREATE OR REPLACE TEMP TABLE nb_a AS SELECT run_id, request_id, ts_ns, prev_ns FROM todo
                       UNION SELECT g.run_id, g.request_id, g.ts_ns, g.prev_ns FROM token_gaps g
                       JOIN todo t ON t.run_id = g.run_id AND t.request_id = g.request_id AND g.ts_ns = t.prev_ns
                       WHERE g.ts_ns >= {int(lo)}""")
        lo_a, lo_prev = con.execute("SELECT min(ts_ns), min(prev_ns) FROM nb_a").fetchone()
        con.execute(f"""CREATE OR REPLACE TEMP TABLE nb AS
            SELECT a.run_id, a.request_id, a.ts_ns, a.prev_ns, any_value(nx.steps_in_gap) AS next_steps,
                   any_value(pv.steps_in_gap) AS prev_steps
            FROM nb_a a LEFT JOIN (SELECT * FROM token_gaps WHERE ts_ns >= {int(lo_a)}) nx
                   ON nx.run_id = a.run_id AND nx.request_id = a.request_id AND nx.prev_ns = a.ts_ns
                   LEFT JOIN (SELECT * FROM token_gaps WHERE ts_ns >= {int(lo_prev)}) pv
                   ON pv.run_id = a.run_id AND pv.request_id = a.request_id AND pv.ts_ns = a.prev_ns
            GROUP BY ALL""")
        con.execute(f"UPDATE token_gaps g SET next_steps = a.next_steps, prev_steps = a.prev_steps FROM nb a "
                    f"WHERE {_KEY} AND g.ts_ns >= {int(lo_prev)}")
        _drop(con, ATTRIBUTE + [("nb", ""), ("nb_a", "")])
    con.execute("DELETE FROM gap_rank")
    con.execute("INSERT INTO gap_rank SELECT run_id, rank FROM rank_now")
    for t in ("todo", "kept", "rank_now"):
        con.execute(f"DROP TABLE IF EXISTS temp.{t}")
    con.execute("INSERT OR REPLACE INTO derived_state VALUES ('steps', ?, ?)", [top, total])
    # every stored gap is attributed now: the next fold need only look at the gaps it makes (`fold_new_gaps`)
    con.execute("INSERT OR REPLACE INTO derived_state VALUES ('token_gaps', ?, 0)", [ATTRIBUTION_RULE])


def _has_temp(con: Any, name: str) -> bool:
    return bool(con.execute("SELECT count(*) FROM duckdb_tables() WHERE temporary AND table_name = ?",
                            [name]).fetchone()[0])


def _lit(text: str) -> str:
    """`text` as a SQL string literal."""
    return "'" + str(text).replace("'", "''") + "'"


def _fold(con: Any, wm: int, top: int) -> None:
    """The delta of the events in (wm, top] (and of the keys in temp table `forced`, from their events up to top)
    into the derived tables."""
    _temp(con, STAGES, f"r.rowid > {wm} AND r.rowid <= {top}", f"e.rowid <= {top}")
    con.execute("DELETE FROM request_rows q USING (SELECT run_id, request_id FROM redo UNION ALL "
                "SELECT run_id, request_id FROM folded) d WHERE d.run_id = q.run_id AND d.request_id = q.request_id")
    if con.execute("SELECT count(*) FROM redo").fetchone()[0]:  # (a join that would read every stored gap)
        con.execute("DELETE FROM token_gaps g USING redo d WHERE d.run_id = g.run_id AND d.request_id = g.request_id")
    cols = ", ".join(c for c, _, _ in TABLES["request_rows"])
    con.execute(f"INSERT INTO request_rows ({cols}) SELECT {cols} FROM merged")
    cols = ", ".join(c for c, _, _ in TABLES["token_gaps"])
    # in the order the stages make them (by request): 11.2 bytes a token. In time order they took 2.1, but a rolled
    # run's reads then summed floats in another order (benchmarks/results/gpu_rate.md): not yet
    con.execute(f"INSERT INTO token_gaps ({cols}) SELECT {cols} FROM gaps")
    con.execute("INSERT INTO temp.fold_new_gaps SELECT run_id, request_id, ts_ns, prev_ns FROM gaps")
    _drop(con, STAGES)


def _complete(con: Any, top: int) -> bool:
    """Whether the request rows hold every raw event (of a known source) up to rowid `top` once."""
    held, raw = con.execute("SELECT (SELECT coalesce(sum(events), 0) FROM request_rows), "
                            "(SELECT count(*) FROM request_events r JOIN sources s USING (source_id) "
                            f"WHERE r.rowid <= {int(top)})").fetchone()
    return held == raw


def refresh(con: Any, max_rows: int | None = None) -> int:
    """Write the delta into the derived tables and move the watermarks, in one transaction; returns the raw
    request events folded in (0: nothing new). `max_rows`: fold at most this many new request events (the
    oldest; a slice: the memory and time of one fold are bounded; the views fold the rest in at each read, and
    the next refresh goes on from there); None: all of them. Rebuilds them from the raw rows when rows were deleted
    below a watermark. Needs a writable connection; concurrent refreshes of one database must be serialized by the
    caller (DuckDB reports a write-write conflict otherwise)."""
    con.execute("BEGIN")
    try:
        new = fold(con, max_rows)
        con.execute("COMMIT")
        return new
    except BaseException:
        try:
            con.execute("ROLLBACK")
        except Exception:  # noqa: BLE001 - an invalidated connection cannot roll back
            pass
        raise


def refresh_slices(con: Any, max_rows: int) -> int:
    """`refresh` a slice of `max_rows` events at a time until nothing is new; returns the events folded. Each
    slice is its own transaction: an interruption (a time limit) keeps the slices done."""
    done = 0
    while n := refresh(con, max_rows):
        done += n
    return done


def fold(con: Any, max_rows: int | None = None) -> int:
    """`refresh` in the caller's transaction: what a writer that deletes raw rows (a retention roll) runs before
    its commit, so no reader ever sees the rows gone and the derived tables not yet folded (their views would
    raise until the next refresh)."""
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 or None, got {max_rows!r}")
    st = state(con)
    wm, n = st or (-1, 0)
    top = con.execute("SELECT coalesce(max(rowid), -1) FROM request_events").fetchone()[0]
    below = rowid_counts(con, "request_events", wm)[0]  # (one statement with a FILTER reads every row id)
    if max_rows is not None and top > wm:  # the slice ends at the max_rows-th row id past the watermark
        top = con.execute(f"SELECT max(rowid) FROM (SELECT rowid FROM request_events WHERE rowid > {wm} "
                          f"ORDER BY rowid LIMIT {int(max_rows)})").fetchone()[0]
    total = below + con.execute(f"SELECT count(*) FROM request_events WHERE rowid > {wm} AND rowid <= {top}"
                                ).fetchone()[0]
    deleted = below != n
    forced = "SELECT NULL::VARCHAR AS run_id, NULL::VARCHAR AS rid WHERE false"
    if deleted:  # rows deleted, oldest first (a retention roll): every key that had an event before the
        # earliest one left is recomputed from what is left (its requests, its arrival numbers, its gaps)
        left = con.execute("SELECT min(r.ts_ns + s.wall_minus_mono_ns) FROM request_events r "
                           "JOIN sources s USING (source_id)").fetchone()[0]
        forced = ("SELECT DISTINCT run_id, runtime_request_id AS rid FROM request_rows"
                  + ("" if left is None else f" WHERE first_wall_ns < {int(left)}"))
    con.execute(f"CREATE OR REPLACE TEMP TABLE forced AS {forced}")
    con.execute("CREATE OR REPLACE TEMP TABLE fold_new_gaps "
                "(run_id VARCHAR, request_id VARCHAR, ts_ns BIGINT, prev_ns BIGINT)")
    new = total - below
    if new or deleted or st is None:
        _fold(con, wm, top)
        if deleted and not _complete(con, top):  # not oldest first after all: start over from what is left
            con.execute("DELETE FROM request_rows")
            con.execute("DELETE FROM token_gaps")
            con.execute("DELETE FROM temp.forced")
            _fold(con, -1, top)
        con.execute("INSERT OR REPLACE INTO derived_state VALUES ('request_events', ?, ?)", [top, total])
        for view, sql in views((top, total)).items():
            con.execute(f"CREATE OR REPLACE VIEW {view} AS {sql}")
    con.execute("DROP TABLE IF EXISTS temp.forced")
    _attribute(con, new_gaps=bool(new) or deleted or st is None)
    con.execute("DROP TABLE IF EXISTS temp.fold_new_gaps")
    steprollup.refresh(con)  # the ten-second step rollup, by its own watermark
    kvrollup.refresh(con)  # the ten-second KV rollup (counts from the step rollup's run starts)
    return new
