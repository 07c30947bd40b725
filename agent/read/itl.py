"""ITL tail attribution: which step made each inter-token gap long, over the store's `itl` gap rows.

Each row of the `itl` view is a token event after a request's first: the gap since its previous token
event, standing for `tokens` ITL samples of gap / tokens (docs/definitions.md's ITL). It is tied to the steps of
the run's lowest rank that ended at or before it and at or before the previous token (ASOF joins; a
token is handed out after the step that computed it ends), and gets one cause (analyzers/itl.py says
which). Nothing here expands a gap into its samples: quantiles weight the gaps by their tokens and are
exactly DuckDB's `quantile_cont` over the samples (position (n - 1) * q, linear interpolation between
the order statistics on either side), tail counts and sums weight them the same way.

The gaps are computed once per call into a temp table of the connection (`_ps_itl_gaps`: temp tables
are per connection and allowed on read-only ones) and the summary, tail, TPOT and chunk-size what-if
queries read that. When the store's gap rows carry their steps for everything it holds (the derived
tables were refreshed since the last write: `derived.attribution_current`) they are read as they are;
otherwise the gaps are joined to the steps here (`ITL_GAPS`): the same rows either way. On a run scheduled
asynchronously (vLLM's `async_scheduling`) a step's output may be handed out after the next step's host call: the
last step ended by a token is its own or the one after it, so each end carries the larger prefill and time of its
step and the one before (`ITL_GAPS_ASYNC`; records/derived.py keeps the same rule, ATTRIBUTION_RULE 2).
"""

from __future__ import annotations

import math
from typing import Any

import duckdb

from ..records import derived
from . import wquantile
from .base import STEP_MS, _dicts, _one, async_scheduling, latest_run, sql_text
from .thresholds import T

# steps of one run on its lowest rank, with `ms` the step time (GPU time when timed, else host time)
LOWEST_RANK_STEPS = f"""SELECT t.*, {STEP_MS} AS ms FROM steps t JOIN sources s USING (source_id)
    WHERE s.run_id = $run AND t.rank = (SELECT min(t2.rank) FROM steps t2 JOIN sources s2 USING (source_id)
                                        WHERE s2.run_id = $run)"""

ITL_CAUSES = ("prefill", "preemption", "queueing", "host", "other", "unattributed")

# a gap's cause, the first that holds (analyzers/itl.py): over its row `g` and its neighbours' step counts
CAUSE = """CASE WHEN g.preempted THEN 'preemption'
                    WHEN g.steps_in_gap IS NULL OR (g.steps_in_gap < 1 AND coalesce({prev_steps}, 0) < 2)
                        THEN 'unattributed'
                    WHEN g.steps_in_gap > g.tokens AND NOT (g.steps_in_gap = g.tokens + 1 AND {next_steps} = 0)
                        THEN 'queueing'
                    WHEN g.prefill_tokens >= $long THEN 'prefill'
                    WHEN (g.ts_ns - g.prev_ns) / 1e6 >= $host_ratio * g.step_ms THEN 'host'
                    ELSE 'other' END"""

# one row per gap (a token event after a request's first): its steps and its cause. `gaps` has the columns
# request_id, ts_ns, tokens, steps_in_gap, step_ms, prefill_tokens, decode_tokens, gap_ms, itl_ms, cause
ITL_GAPS = f"""st AS ({LOWEST_RANK_STEPS}),
    ends AS (SELECT ts_ns + CAST(host_ms * 1e6 AS BIGINT) AS end_ns, ms AS step_ms, prefill_tokens, decode_tokens,
                    row_number() OVER (ORDER BY ts_ns, step_id) AS step_no FROM st),
    tg AS (SELECT request_id, ts_ns, prev_ns, CAST(tokens AS BIGINT) AS tokens, preempted FROM itl WHERE run_id = $run),
    tm AS (SELECT t.*, e.step_no, e.step_ms, e.prefill_tokens, e.decode_tokens
           FROM tg t ASOF LEFT JOIN ends e ON t.ts_ns >= e.end_ns),
    g0 AS MATERIALIZED (SELECT a.*, a.step_no - p.step_no AS steps_in_gap
                        FROM tm a ASOF LEFT JOIN ends p ON a.prev_ns >= p.end_ns),
    -- a token stamped after the next step already ended (vLLM's frontend stamps tokens as it receives them)
    -- gives a gap of one step too many and then one of none: that pair is its steps' doing, not queueing.
    -- The next gap of a request starts where this one ends, the previous one ends where it starts.
    nx AS (SELECT c.request_id, c.ts_ns, any_value(n.steps_in_gap) AS next_steps
           FROM g0 c JOIN g0 n ON n.request_id = c.request_id AND n.prev_ns = c.ts_ns
           WHERE c.steps_in_gap = c.tokens + 1 GROUP BY c.request_id, c.ts_ns),
    pv AS (SELECT c.request_id, c.ts_ns, any_value(p.steps_in_gap) AS prev_steps
           FROM g0 c JOIN g0 p ON p.request_id = c.request_id AND p.ts_ns = c.prev_ns
           WHERE c.steps_in_gap < 1 GROUP BY c.request_id, c.ts_ns),
    gaps AS (
        SELECT g.request_id, g.ts_ns, g.tokens, g.steps_in_gap, g.step_ms, g.prefill_tokens, g.decode_tokens,
               (g.ts_ns - g.prev_ns) / 1e6 AS gap_ms, (g.ts_ns - g.prev_ns) / 1e6 / g.tokens AS itl_ms,
               {CAUSE.format(prev_steps="pv.prev_steps", next_steps="nx.next_steps")} AS cause
        FROM g0 g LEFT JOIN nx USING (request_id, ts_ns) LEFT JOIN pv USING (request_id, ts_ns))"""


# a run scheduled asynchronously (vLLM): a step's output may be handed out after the next step's host call, so
# each end carries the larger prefill and time of its step and the one before (records/derived.py, ATTRIBUTION_RULE 2)
ITL_GAPS_ASYNC = ITL_GAPS.replace(
    "ends AS (SELECT ts_ns + CAST(host_ms * 1e6 AS BIGINT) AS end_ns, ms AS step_ms, prefill_tokens, decode_tokens,",
    "ends AS (SELECT ts_ns + CAST(host_ms * 1e6 AS BIGINT) AS end_ns,"
    " greatest(ms, lag(ms) OVER (ORDER BY ts_ns, step_id)) AS step_ms,"
    " greatest(prefill_tokens, lag(prefill_tokens) OVER (ORDER BY ts_ns, step_id)) AS prefill_tokens, decode_tokens,")
assert ITL_GAPS_ASYNC != ITL_GAPS


def weighted_quantiles(value: str, weight: str, source: str, qs: dict[str, str]) -> str:
    """SQL of one row: `n` (the weights' sum) and, per name in `qs`, DuckDB's quantile_cont(value, q) over the
    multiset where each row of `source` counts `weight` times (integer weights): position h = (n - 1) * q, the
    order statistics at floor(h) and ceil(h), lo (1 - d) + hi d with d = h - floor(h) (DuckDB's formula; its own
    build may fuse the multiply-add, so the last bit can differ). One sort of `source`."""
    cols = []
    for name, q in qs.items():
        lo = f"min(v) FILTER (WHERE cw > floor((n - 1) * {q}))"
        hi = f"min(v) FILTER (WHERE cw > ceil((n - 1) * {q}))"
        d = f"((any_value(n) - 1) * {q} - floor((any_value(n) - 1) * {q}))"
        cols.append(f"{lo} * (1.0 - {d}) + {hi} * {d} AS {name}")
    return f"""SELECT coalesce(any_value(n), 0) AS n, {', '.join(cols)}
        FROM (SELECT {value} AS v, sum({weight}) OVER (ORDER BY {value} ROWS UNBOUNDED PRECEDING) AS cw,
                     sum({weight}) OVER () AS n
              FROM {source} WHERE {weight} > 0)"""


# over `gaps`: the samples, their median and tail quantile, as one SQL statement: the query shown with a finding
# (`attribution` computes the same figures by selection, wquantile.py)
Q_SQL = f"q AS ({weighted_quantiles('itl_ms', 'tokens', 'gaps', {'p50': '0.5', 'p99': '$quantile'})})"
# over `gaps`: the samples, their median and tail quantile, and the gaps (one row); then the tail (>= the p99) with
# those as parameters, per cause: its samples, their excess over the median, the largest prefill of their steps (the
# summary's tail sums are these summed over the causes: two passes, where one per sum was five)
ITL_Q_SQL = """WITH {q} SELECT q.n AS itl_samples, q.p50 AS itl_p50_ms, q.p99 AS itl_p99_ms,
        (SELECT count(*) FROM gaps) AS gaps FROM q"""
ITL_TAIL_SQL = """SELECT cause, sum(tokens) AS samples, sum((itl_ms - $p50) * tokens) AS excess_ms,
           max(prefill_tokens) AS max_prefill_tokens
    FROM gaps WHERE itl_ms >= $p99 GROUP BY cause ORDER BY cause"""


def _summary(q: dict[str, Any], tail: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """ITL_Q_SQL's row with the tail's samples and excess (ms) from ITL_TAIL_SQL's rows by cause: the causes' sums
    summed (floats added in another order than one sum over the tail: equal to ~1e-15 relative; None, as SQL's
    sum, with no tail)."""
    excess = [r["excess_ms"] for r in tail.values() if r["excess_ms"] is not None]
    return {**q, "tail_samples": sum(r["samples"] or 0 for r in tail.values()),
            "tail_excess_ms": sum(excess) if excess else None}


# per request over the TPOT SLO: its TPOT with one cause's excess removed (its gaps brought to the median)
ITL_TPOT_SQL = """WITH r AS (SELECT request_id, tpot_s, output_tokens FROM requests WHERE run_id = $run AND tpot_s > $slo_s),
    per AS (SELECT gaps.request_id, cause, sum(greatest(gap_ms - $p50 * tokens, 0)) AS excess_ms
            FROM gaps JOIN r USING (request_id) GROUP BY ALL)
    SELECT c.cause, count(DISTINCT r.request_id) AS violations,
           count(DISTINCT r.request_id) FILTER (
               WHERE r.tpot_s - coalesce(per.excess_ms, 0) / 1e3 / (r.output_tokens - 1) <= $slo_s) AS explained
    FROM r CROSS JOIN (SELECT unnest($causes) AS cause) c
    LEFT JOIN per ON per.request_id = r.request_id AND per.cause = c.cause
    GROUP BY c.cause ORDER BY c.cause"""

# the same rows from the steps kept with the gaps (agent/records/derived.py), when they are current
STORED_GAPS = f"""SELECT g.request_id, g.ts_ns, CAST(g.tokens AS BIGINT) AS tokens, g.steps_in_gap, g.step_ms,
           g.prefill_tokens, g.decode_tokens, (g.ts_ns - g.prev_ns) / 1e6 AS gap_ms,
           (g.ts_ns - g.prev_ns) / 1e6 / g.tokens AS itl_ms,
           {CAUSE.format(prev_steps="g.prev_steps", next_steps="g.next_steps").replace("g.tokens + 1", "CAST(g.tokens AS BIGINT) + 1")} AS cause
    FROM token_gaps g WHERE g.run_id = $run"""

GAPS_TABLE = "_ps_itl_gaps"


class ItlGaps:
    """The run's gap rows with their causes, computed once into a temp table of `con` (dropped on exit)."""

    def __init__(self, con: duckdb.DuckDBPyConnection, run_id: str, long_prefill_tokens: int,
                 host_stall_ratio: float) -> None:
        self.con, self.run_id = con, run_id
        self.params = {"long": int(long_prefill_tokens), "host_ratio": float(host_stall_ratio)}

    def __enter__(self) -> "ItlGaps":
        if derived.attribution_current(self.con):  # the gap rows carry their steps: read them where they are
            self.kind = "VIEW"
            sql = STORED_GAPS.replace("$run", _literal(self.run_id)).replace("$long", _literal(self.params["long"])) \
                .replace("$host_ratio", _literal(self.params["host_ratio"]))
            self.con.execute(f"CREATE OR REPLACE TEMP VIEW {GAPS_TABLE} AS {sql}")
        else:  # join them to the steps, once
            self.kind = "TABLE"
            gaps = ITL_GAPS_ASYNC if async_scheduling(self.con, self.run_id) else ITL_GAPS
            self.con.execute(f"CREATE OR REPLACE TEMP TABLE {GAPS_TABLE} AS WITH {gaps} SELECT * FROM gaps",
                             {"run": self.run_id, **self.params})
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.con.execute(f"DROP {self.kind} IF EXISTS temp.{GAPS_TABLE}")
        except duckdb.Error:  # an interrupted or closed connection: its temp tables go with it
            pass


def _literal(v: Any) -> str:
    """`v` (str, int, float) as an SQL literal."""
    if isinstance(v, str):
        return "'" + v.replace("'", "''") + "'"
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"not a finite number: {v}")
    return repr(v)


def _over_gaps(body: str) -> str:
    """`body` (a statement reading `gaps`, maybe starting WITH) run over the temp table."""
    head = f"WITH gaps AS (SELECT * FROM {GAPS_TABLE})"
    return head + ", " + body[5:] if body.lstrip().startswith("WITH ") else head + " " + body


def _quantiles(con: duckdb.DuckDBPyConnection, quantile: float) -> dict[str, Any]:
    """ITL_Q_SQL's row over the gaps' temp table, its quantiles by selection (wquantile.py: two streaming passes,
    where a sort of every sample held them all: 25M gaps took seconds and GBs)."""
    n, (p50, p99) = wquantile.quantiles(con, GAPS_TABLE, "itl_ms", "tokens", (0.5, quantile))
    gaps = _one(con, _over_gaps("SELECT count(*) AS gaps FROM gaps"), {})["gaps"]
    return {"itl_samples": n, "itl_p50_ms": p50, "itl_p99_ms": p99, "gaps": gaps}


def attribution(con: duckdb.DuckDBPyConnection, run_id: str | None = None,
                long_prefill_tokens: int = int(T["long_prefill_tokens"]),
                host_stall_ratio: float = T["host_stall_ratio"], tpot_slo_s: float = T["tpot_slo_s"],
                quantile: float = 0.99, min_spike_ratio: float | None = None) -> dict[str, Any]:
    """The ITL tail of a run (default: the latest) and its causes, ms: p50 / p99 ITL; per cause (`ITL_CAUSES`)
    the tail samples (>= p99) and their share of the tail's excess over the median; TPOT-SLO violations and
    how many each cause explains alone.

    `min_spike_ratio`: for a caller that reads the causes only when the p99 is at least that many times the p50
    (analyzers/itl.py): below it (or with no samples) the row holds the quantiles alone (itl_samples, itl_p50_ms,
    itl_p99_ms, gaps) and the tail and TPOT passes are not run."""
    if run_id is None:
        run_id = latest_run(con)
    params = {"long": long_prefill_tokens, "host_ratio": host_stall_ratio, "quantile": quantile}
    with ItlGaps(con, run_id, long_prefill_tokens, host_stall_ratio):
        q = _quantiles(con, quantile)
        p = {"p50": q["itl_p50_ms"], "p99": q["itl_p99_ms"]}
        if min_spike_ratio is not None and (not p["p50"] or p["p99"] / p["p50"] < min_spike_ratio):
            return q
        tail = {r["cause"]: r for r in _dicts(con, _over_gaps(ITL_TAIL_SQL), p)}
        e = _summary(q, tail)
        viol = {r["cause"]: r for r in _dicts(con, _over_gaps(ITL_TPOT_SQL),
                                             {"run": run_id, "p50": p["p50"], "slo_s": tpot_slo_s,
                                              "causes": list(ITL_CAUSES)})}
    total = e["tail_excess_ms"] or 0.0
    for c in ITL_CAUSES:
        r = tail.get(c, {})
        e[f"tail_{c}_samples"] = r.get("samples", 0)
        e[f"tail_{c}_share"] = (r.get("excess_ms") or 0.0) / total if total > 0 else 0.0
    e["tail_max_prefill_tokens"] = max((r["max_prefill_tokens"] or 0 for r in tail.values()), default=0)
    e["tpot_violations"] = max((r["violations"] for r in viol.values()), default=0)
    for c in ITL_CAUSES:
        e[f"tpot_violations_explained_{c}"] = viol.get(c, {}).get("explained", 0)
    e["causes"] = [{"cause": c, "tail_samples": e[f"tail_{c}_samples"], "tail_share": e[f"tail_{c}_share"],
                    "tpot_violations_explained": e[f"tpot_violations_explained_{c}"]} for c in ITL_CAUSES]
    e["query"] = sql_text("WITH " + ITL_GAPS + ",\n" + ITL_Q_SQL.format(q=Q_SQL)[5:] + ";\n"
                          + ITL_TAIL_SQL.replace("$p50", "<itl_p50_ms>").replace("$p99", "<itl_p99_ms>") + ";\n"
                          + ITL_TPOT_SQL.replace("$p50", "<itl_p50_ms>"),
                          {**params, "slo_s": tpot_slo_s, "causes": str(list(ITL_CAUSES))})
    return e


# --- what a per-step token budget would have done to the p99 ITL (analyzers/itl.py's model) ---

_ELIGIBLE = "cause NOT IN ('preemption', 'queueing', 'unattributed')"

# per budget b (a gap is split when eligible and prefill_tokens > b - decode_tokens, into ceil(p / c) chunks
# of c = max(b - decode_tokens, 1) tokens): the samples' count. Gaps split at no budget count their tokens.
LADDER_N_SQL = f"""WITH b AS (SELECT unnest($budgets::BIGINT[]) AS budget),
    x AS (SELECT b.budget, g.tokens, g.prefill_tokens, g.decode_tokens, greatest(b.budget - g.decode_tokens, 1) AS c
          FROM gaps g, b WHERE {_ELIGIBLE} AND g.prefill_tokens + g.decode_tokens > $bmin)
    SELECT b.budget, (SELECT coalesce(sum(tokens), 0) FROM gaps)
               - coalesce(sum(x.tokens) FILTER (WHERE x.prefill_tokens > x.budget - x.decode_tokens), 0)
               + coalesce(sum(x.tokens * CAST(ceil(x.prefill_tokens / x.c) AS BIGINT))
                          FILTER (WHERE x.prefill_tokens > x.budget - x.decode_tokens), 0) AS n
    FROM b LEFT JOIN x USING (budget) GROUP BY b.budget"""

# the top of every budget's samples: the $top largest samples of the gaps no budget splits, and every value
# the others give (unsplit: its ITL; split: its first chunk, its middle chunks (all alike), its last chunk,
# each of them `tokens` samples). A chunk's gap is what the gap held besides its step (the first chunk) or a
# pure decode gap's (`ovh`, the others), plus the pure decode step, plus the step's ms per prefill token
# (the fit's slope plus the step's residual off the fit, spread over its tokens) times the chunk's tokens.
LADDER_TOP_SQL = f"""WITH b AS (SELECT unnest($budgets::BIGINT[]) AS budget),
    o AS (SELECT coalesce(quantile_cont(gap_ms - step_ms, 0.5)
                          FILTER (WHERE steps_in_gap = 1 AND prefill_tokens = 0 AND cause = 'other'), 0) AS ovh
          FROM gaps),
    base AS (SELECT itl_ms AS v, tokens AS w FROM gaps
             WHERE NOT ({_ELIGIBLE} AND prefill_tokens + decode_tokens > $bmin) AND tokens > 0
             ORDER BY itl_ms DESC LIMIT $top),
    x AS (SELECT b.budget, g.*, greatest(b.budget - g.decode_tokens, 1) AS c,
                 CAST(ceil(g.prefill_tokens / greatest(b.budget - g.decode_tokens, 1)) AS BIGINT) AS k,
                 g.prefill_tokens > b.budget - g.decode_tokens AS split,
                 $slope + (g.step_ms - $base_ms - $slope * g.prefill_tokens) / g.prefill_tokens AS per_token
          FROM gaps g, b WHERE {_ELIGIBLE} AND g.prefill_tokens + g.decode_tokens > $bmin AND g.tokens > 0),
    v AS (SELECT b.budget, base.v, base.w FROM base, b
          UNION ALL SELECT budget, itl_ms, tokens FROM x WHERE NOT split
          UNION ALL SELECT budget, (gap_ms - step_ms + $base_ms + per_token * least(c, prefill_tokens)) / tokens, tokens
                    FROM x WHERE split AND k >= 1
          UNION ALL SELECT budget, ((SELECT ovh FROM o) + $base_ms + per_token * c) / tokens, tokens * (k - 2)
                    FROM x WHERE split AND k > 2
          UNION ALL SELECT budget, ((SELECT ovh FROM o) + $base_ms + per_token * (prefill_tokens - (k - 1) * c)) / tokens,
                           tokens FROM x WHERE split AND k >= 2),
    r AS (SELECT budget, v, sum(w) OVER (PARTITION BY budget ORDER BY v DESC ROWS UNBOUNDED PRECEDING) AS from_top
          FROM v WHERE w > 0),
    want AS (SELECT unnest($budgets::BIGINT[]) AS budget, unnest($r_lo::HUGEINT[]) AS r_lo,
                    unnest($r_hi::HUGEINT[]) AS r_hi)
    SELECT want.budget, max(r.v) FILTER (WHERE r.from_top >= want.r_lo) AS v_lo,
           max(r.v) FILTER (WHERE r.from_top >= want.r_hi) AS v_hi
    FROM want JOIN r USING (budget) GROUP BY want.budget"""


def p99_by_budget(con: duckdb.DuckDBPyConnection, run_id: str, budgets: list[int], ms_per_prefill_token: float,
                  pure_decode_ms: float, *, long_prefill_tokens: int = int(T["long_prefill_tokens"]),
                  host_stall_ratio: float = T["host_stall_ratio"], quantile: float = 0.99) -> dict[int, float | None]:
    """The p99 (`quantile`) ITL, ms, had every step held at most b tokens, for each b of `budgets`, from one
    computation of the gaps (analyzers/itl.py's model). Exact: the same quantile of the same samples as
    expanding every gap into its samples and every split gap into its chunks, without expanding either: the
    quantile is among the top samples, and those are the largest of the gaps no budget splits (taken once)
    and what the split ones give."""
    budgets = sorted({int(b) for b in budgets})
    if not budgets:
        return {}
    p = {"budgets": budgets, "bmin": budgets[0]}
    with ItlGaps(con, run_id, long_prefill_tokens, host_stall_ratio):
        n = {r["budget"]: int(r["n"]) for r in _dicts(con, _over_gaps(LADDER_N_SQL), p)}
        pos = {}
        for b in budgets:
            if n[b] > 0:
                h = (n[b] - 1) * quantile
                pos[b] = (n[b] - math.floor(h), n[b] - math.ceil(h), h - math.floor(h))  # ranks from the top
        if not pos:
            return {b: None for b in budgets}
        top = max(r_lo for r_lo, _, _ in pos.values())
        rows = _dicts(con, _over_gaps(LADDER_TOP_SQL), {
            **p, "budgets": list(pos), "top": top, "slope": float(ms_per_prefill_token),
            "base_ms": float(pure_decode_ms), "r_lo": [pos[b][0] for b in pos], "r_hi": [pos[b][1] for b in pos]})
    out: dict[int, float | None] = {b: None for b in budgets}
    for r in rows:
        lo, hi, d = r["v_lo"], r["v_hi"], pos[r["budget"]][2]
        out[r["budget"]] = lo if lo is None or hi is None or d == 0 else lo * (1.0 - d) + hi * d
    return out
