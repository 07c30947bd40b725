"""The SQL the analyzers share (aggregated in DuckDB) and the helpers that run it, on top of the read
layer's named queries (`agent.read.queries`, the one `queries` module).

Each returns plain numbers together with the SQL text that produced them, so a
finding can cite its query. Step time is the CUDA-event time when the step was
timed, else the host time (`agent.read.queries.STEP_MS`); on a run scheduled asynchronously, the time between
the step's output and the previous one (`RUN_STEPS_ASYNC`, `agent.read.base.ASYNC_STEP_MS`).
"""

from __future__ import annotations

import re
from typing import Any

import duckdb

from phasescope.agent.read.base import ASYNC_STEP_MS, STEPS_WINDOW, async_scheduling
from phasescope.agent.read.queries import STEP_MS

from .runinfo import read_run_info

# steps of one run on its lowest rank (rank-level rules read every rank themselves)
# (the lowest rank: over the steps whose source is one of the run's, a filter on source_id, not a join per step
# nor a group per source: 10M steps ~0.1 s, where the per-source minima took ~0.3 s)
RUN_STEPS = f"""SELECT t.*, {STEP_MS} AS ms FROM steps t JOIN sources s USING (source_id)
    WHERE s.run_id = $run AND t.rank = (SELECT min(t2.rank) FROM steps t2
                                        WHERE t2.source_id IN (SELECT source_id FROM sources WHERE run_id = $run))"""
# the same steps of a run scheduled asynchronously (vLLM --async-scheduling): an untimed step's time is the time
# between its output and the previous one (agent.read.base.ASYNC_STEP_MS); `one` and `rows` read this for such runs
RUN_STEPS_ASYNC = RUN_STEPS.replace(f"{STEP_MS} AS ms", f"{ASYNC_STEP_MS} AS ms") + STEPS_WINDOW
RUN_KV = """SELECT k.* FROM kv_snapshots k JOIN sources s USING (source_id) WHERE s.run_id = $run"""
RUN_REQUESTS = "SELECT * FROM requests WHERE run_id = $run"


class _Rows:
    """A finished result: what a cursor gives (description, fetchone, fetchall), from memory."""

    def __init__(self, description: Any, rows: list[tuple]) -> None:
        self.description, self._rows, self._at = description, rows, 0

    def fetchone(self) -> tuple | None:
        if self._at >= len(self._rows):
            return None
        self._at += 1
        return self._rows[self._at - 1]

    def fetchall(self) -> list[tuple]:
        out, self._at = self._rows[self._at:], len(self._rows)
        return out


# `FROM requests` / `JOIN itl` (the derived views, not a name that goes on: requests_x, request_rows)
_VIEW_READ = re.compile(r"\b(FROM|JOIN)(\s+)(requests|itl)\b(?!\s*\()", re.IGNORECASE)


class OnceConnection:
    """A connection for one `diagnose`: a read it has answered already (the same SQL text and parameters) is
    answered again from memory, not run again. Several rules read the same figures (KV usage, sequence lengths,
    preemptions, prefix totals, the world size); one diagnose reads one snapshot, so the answer is the same.
    Statements that write, and reads of temp tables (which a rule may have replaced), always run.

    `views`: SQL that gives the rows of the views `requests` and `itl` (records/derived.py's `stored`: the stored
    rows, when nothing is left to derive); a read of them reads that instead, the same rows without planning and
    running the views' delta (10M steps: survival_rate 0.8 -> 0.3 s). The rules' cited SQL names the views."""

    def __init__(self, con: Any, views: dict[str, str] | None = None) -> None:
        self._con = con
        self._seen: dict[tuple[str, str], tuple[Any, list[tuple]]] = {}
        self._views = views or {}

    def _rewrite(self, sql: str) -> str:
        if not self._views:
            return sql
        return _VIEW_READ.sub(lambda m: m.group(1) + m.group(2) + self._views.get(m.group(3).lower(), m.group(3)),
                              sql)

    def execute(self, sql: str, params: Any = None) -> Any:
        head = sql.lstrip()[:6].upper().startswith(("SELECT", "WITH"))
        read = head and "_ps_" not in sql
        if head:
            sql = self._rewrite(sql)
        if not read or "temp." in sql.lower():
            return self._con.execute(sql) if params is None else self._con.execute(sql, params)
        key = (sql, repr(params))
        if key not in self._seen:
            cur = self._con.execute(sql) if params is None else self._con.execute(sql, params)
            self._seen[key] = (cur.description, cur.fetchall())
        return _Rows(*self._seen[key])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._con, name)


def for_run(con: duckdb.DuckDBPyConnection, sql: str, run_id: str) -> str:
    """`sql` with its RUN_STEPS read as RUN_STEPS_ASYNC where the run scheduled asynchronously."""
    if RUN_STEPS in sql and async_scheduling(con, run_id):
        return sql.replace(RUN_STEPS, RUN_STEPS_ASYNC)
    return sql


def one(con: duckdb.DuckDBPyConnection, sql: str, run_id: str, **params: Any) -> dict[str, Any]:
    """Run `sql` (which may use $run and the named params) and return its single row as a dict."""
    cur = con.execute(for_run(con, sql, run_id), {"run": run_id, **params})
    names = [d[0] for d in cur.description]
    row = cur.fetchone()
    return dict(zip(names, row)) if row else {n: None for n in names}


def rows(con: duckdb.DuckDBPyConnection, sql: str, run_id: str, **params: Any) -> list[dict[str, Any]]:
    cur = con.execute(for_run(con, sql, run_id), {"run": run_id, **params})
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


PREFILL_COST = f"""WITH st AS ({RUN_STEPS})
    SELECT quantile_cont(ms / prefill_tokens, 0.5) AS ms_per_prefill_token, count(*) AS steps
    FROM st WHERE prefill_tokens >= $min_tokens"""


def prefill_cost(con: duckdb.DuckDBPyConnection, run_id: str, min_tokens: int = 32) -> dict[str, Any]:
    """Median step time per prefill token (ms; the step's fixed cost included, an upper bound) over steps
    that prefill at least `min_tokens` tokens. Robust to the odd slow step, unlike a regression."""
    out = one(con, PREFILL_COST, run_id, min_tokens=min_tokens)
    out["query"] = PREFILL_COST.replace("$min_tokens", str(min_tokens))
    return out


PAGE_SIZE = f"SELECT any_value(page_size_tokens) AS page_size FROM ({RUN_KV}) WHERE total_pages > 0"


def page_size(con: duckdb.DuckDBPyConnection, run_id: str) -> int | None:
    return one(con, PAGE_SIZE, run_id)["page_size"]


# from the request rows: each preempted event belongs to exactly one request
PREEMPTIONS = """SELECT CAST(coalesce(sum(preemptions), 0) AS BIGINT) AS preemptions,
           count(*) FILTER (WHERE preemptions > 0) AS preempted_requests
    FROM requests WHERE run_id = $run"""

PREFIX_TOTALS = """WITH last AS (
        SELECT p.source_id, max(queried_tokens_total) AS q, max(hit_tokens_total) AS h,
               max(recomputed_tokens_total) AS r, max(evicted_blocks_total) AS e
        FROM prefix_counters p JOIN sources s USING (source_id) WHERE s.run_id = $run GROUP BY p.source_id)
    SELECT sum(q) AS queried_tokens, sum(h) AS hit_tokens, sum(r) AS recomputed_tokens, sum(e) AS evicted_blocks
    FROM last"""


# the probe's own share of the engine's time (its self-measurement, agent/probe/cost.py): per process the last
# health record's cost_share of every probe in it (a vLLM EngineCore at TP=1 holds the engine's and the worker's),
# summed; the busiest process's. The frontend (vLLM's API server, another process) and the sidecar are not the engine
PROBE_SHARE_SQL = """WITH last AS (
        SELECT s.pid, arg_max(h.cost_share, h.ts_ns) AS share
        FROM probe_health h JOIN sources s USING (source_id)
        WHERE s.run_id = $run AND s.runtime NOT IN ('vllm-frontend', 'sidecar') GROUP BY h.source_id, s.pid)
    SELECT max(share) AS probe_cost_share FROM (SELECT pid, sum(share) AS share FROM last GROUP BY pid)"""


STEP_SOURCE_SQL = f"""WITH st AS ({RUN_STEPS})
    SELECT count(*) AS steps, count(*) FILTER (WHERE NOT isnan(gpu_ms)) AS gpu_timed FROM st"""


def step_source(con: duckdb.DuckDBPyConnection, run_id: str) -> str:
    """Where the run's step times (`STEP_MS`) come from, in words: CUDA events, the engine's host time per step,
    or both (GPU time where a step was event-timed, host time for the others)."""
    r = one(con, STEP_SOURCE_SQL, run_id)
    n, g = r["steps"] or 0, r["gpu_timed"] or 0
    other = ("the time between its output and the previous one (async scheduling: a step's host call returns "
             "before its GPU work ends)" if async_scheduling(con, run_id) else "the engine's host time")
    if g == 0:
        return f"{other} per step ({n} steps)"
    if g == n:
        return f"GPU time from CUDA events ({n} steps)"
    return f"GPU time for the {g} CUDA-event-timed steps, {other} for the other {n - g}"


# The probe times its own hooks (agent/probe/cost.py); what it adds to a server end to end is more: on vLLM 0.24 on an
# H100, armed against the same engine paused, 1.5-3.3 % of decode throughput at batch 1-256 while this share read
# under 0.5 % (benchmarks/results/vllm_gpu_ab.md, run 7). A finding says which it states.
PROBE_SHARE_TEXT = (" The probe's own share of the engine's time, as it times its hooks: {share:.1%} (a lower bound"
                    " of what it adds: see docs/measured.md).")


def probe_share_sentence(share: float | None) -> str:
    """The sentence a timing finding ends with (PROBE_SHARE_TEXT), "" without a self-measurement."""
    return "" if share is None else PROBE_SHARE_TEXT.format(share=share)


def probe_share(con: duckdb.DuckDBPyConnection, run_id: str) -> float | None:
    """The probe's own share of the engine's step time (0.012: 1.2%), None where it has no health record."""
    try:
        v = one(con, PROBE_SHARE_SQL, run_id)["probe_cost_share"]
    except duckdb.Error:  # a store of a build without cost_share
        return None
    return None if v is None else float(v)


def world_size(con: duckdb.DuckDBPyConnection, run_id: str) -> int:
    """Ranks of the run, all engines together (a vLLM server's world is TP x PP x DP)."""
    r = con.execute("SELECT max(world_size) FROM sources WHERE run_id = ?", [run_id]).fetchone()[0]
    return int(r or 1)


def model_parallel_size(con: duckdb.DuckDBPyConnection, run_id: str, with_pp: bool = True) -> int:
    """Ranks that split one model replica (TP x PP): the run's `tp` and `pp` labels where the runtime states them
    (vLLM), else the world size (one replica). Data-parallel engines are replicas: ranks of two engines are never
    compared as TP ranks, and weights and KV are split over TP x PP only. `with_pp=False`: TP alone."""
    lab = read_run_info(con, run_id)
    try:
        if "tp" in lab:
            return max(1, int(lab["tp"])) * (max(1, int(lab.get("pp") or 1)) if with_pp else 1)
    except ValueError:
        pass  # a label that is not a number: the world size, as for a runtime that states none
    return world_size(con, run_id)
