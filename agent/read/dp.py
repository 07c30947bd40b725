"""Data-parallel engines: how evenly KV usage and the queue spread over them (issue 28).

A vLLM server with `--data-parallel-size N` runs N engines; the store holds vLLM's own per-engine gauges in
`server_metrics` (column `engine`): `vllm:kv_cache_usage_perc` (KV block usage, 0..1) and
`vllm:num_requests_waiting`. They come from phasescope's stat logger in vLLM's API server (sources of runtime
`vllm-frontend`, one sample per engine step) or from a /metrics scrape; when a run has both, the stat logger's
are read (one kind only: the two would count each moment twice).

Definitions (tests pin them):
- timeline: every sample time of the run's gauges (wall clock), over all engines, from the first time every engine
  has a sample to the last sample; between two consecutive times each engine holds its latest sample's values (a
  gauge holds until its next sample); each interval weighs its duration;
- per engine: the time-weighted mean KV usage and mean waiting requests, the highest usage it held, and the share
  of the time it was *busy*
  (usage >= `near_cap`, or a request waiting) and had *headroom* (usage < `near_cap` and none waiting);
- `kv_imbalance = max_e(mean usage) / mean_e(mean usage) - 1`, `waiting_imbalance` the same over mean waiting
  (0 when the mean is 0): the TP index's form (records/kvmath.py `kv_imbalance`); from 0 (even) to N - 1 (all
  on one engine);
- the hottest engine: the highest mean usage, then the highest mean waiting, then the lowest index;
- `stranded_share`: share of the timeline in which the hottest engine was busy while another engine had
  headroom (requests waited on one engine, or its KV was full, while capacity stood idle on another).

Engines that sent no sample. The stat logger samples an engine when it steps, so an engine that got no request
has no gauge row at all, and reading only the rows would make the worst skew (everything on one engine) read as
no skew. The run's `dp` label (the API server's `--data-parallel-size`: the vLLM adapter labels it from the API
server's config only, the engines' own config says 1) names the engines expected, 0..dp-1. One expected but
absent from the gauges is:
- *idle* when its own probe (the EngineCore source of rank engine x tp x pp) is in the run and it, with its
  workers, recorded no step, request event or KV snapshot: it never stepped, so it held 0 requests running or
  waiting and 0 KV in use all along. It counts as usage 0 and waiting 0 over the whole timeline (`idle_engines`);
- a *gap* otherwise, and then no figure is given (`gaps`: engine -> why): its probe recorded work the gauges
  lack, or it has no probe in the run (idle cannot be told from a probe that failed), or the gauges are a
  /metrics scrape (vLLM exports every engine's gauges there: a missing one is a lost series, not an idle engine).
"""

from __future__ import annotations

from typing import Any

import duckdb

from ..records.kvmath import kv_imbalance  # max / mean - 1, the TP index
from .base import run_labels as _labels  # the run's labels ({} without a run_info table)
from .thresholds import T

KV_GAUGE = "vllm:kv_cache_usage_perc"
WAITING_GAUGE = "vllm:num_requests_waiting"

# one row per engine and sample time, with both gauges (the stat logger and a scrape sample them together)
SAMPLES_SQL = f"""WITH g AS (
        SELECT m.engine, m.ts_ns + s.wall_minus_mono_ns AS t, m.name, m.value,
               s.runtime LIKE 'vllm-frontend%' AS logger
        FROM server_metrics m JOIN sources s USING (source_id)
        WHERE s.run_id = $run AND m.name IN ('{KV_GAUGE}', '{WAITING_GAUGE}')),
    k AS (SELECT coalesce(bool_or(logger), false) AS logger FROM g)
    SELECT engine, t, any_value(k.logger) AS logger, max(value) FILTER (WHERE name = '{KV_GAUGE}') AS usage,
           max(value) FILTER (WHERE name = '{WAITING_GAUGE}') AS waiting
    FROM g, k WHERE g.logger = k.logger GROUP BY engine, t
    HAVING usage IS NOT NULL AND waiting IS NOT NULL"""

SEEN_SQL = f"SELECT engine, bool_or(logger) FROM ({SAMPLES_SQL}) GROUP BY engine"

# the samples, plus one of usage 0 and waiting 0 per idle engine ($idle) at the first sample time: held from there
DP_SQL = f"""WITH real AS ({SAMPLES_SQL}),
    s AS (SELECT engine, t, logger, usage, waiting FROM real UNION ALL
          SELECT i.engine, (SELECT min(t) FROM real), (SELECT any_value(logger) FROM real), 0.0, 0.0
          FROM (SELECT unnest($idle::SMALLINT[]) AS engine) i WHERE EXISTS (SELECT 1 FROM real)),
    start AS (SELECT max(t0) AS t0 FROM (SELECT min(t) AS t0 FROM s GROUP BY engine)),
    ticks AS (SELECT DISTINCT s.t FROM s, start WHERE s.t >= start.t0),
    iv AS (SELECT t, lead(t) OVER (ORDER BY t) - t AS d FROM ticks),
    grid AS (SELECT iv.t, iv.d, e.engine FROM iv, (SELECT DISTINCT engine FROM s) e WHERE iv.d IS NOT NULL),
    st AS MATERIALIZED (
        SELECT grid.t, grid.d, grid.engine, s.usage, s.waiting,
               s.usage >= $near_cap OR s.waiting > 0 AS busy, s.usage < $near_cap AND s.waiting = 0 AS free
        FROM grid ASOF JOIN s ON grid.engine = s.engine AND grid.t >= s.t),
    eng AS (SELECT engine, sum(usage * d) / sum(d) AS usage_mean, sum(waiting * d) / sum(d) AS waiting_mean,
                   max(usage) AS usage_max, coalesce(sum(d) FILTER (WHERE busy), 0) / sum(d) AS busy_share,
                   coalesce(sum(d) FILTER (WHERE free), 0) / sum(d) AS headroom_share
            FROM st GROUP BY engine),
    hot AS (SELECT engine FROM eng ORDER BY usage_mean DESC, waiting_mean DESC, engine LIMIT 1),
    per_t AS (SELECT t, any_value(d) AS d, bool_or(busy AND engine = (SELECT engine FROM hot)) AS hot_busy,
                     bool_or(free AND engine != (SELECT engine FROM hot)) AS other_free
              FROM st GROUP BY t),
    tot AS (SELECT sum(d) AS span, sum(d) FILTER (WHERE hot_busy AND other_free) AS stranded FROM per_t)
    SELECT eng.*, (SELECT engine FROM hot) AS hot_engine, tot.span / 1e9 AS span_s,
           coalesce(tot.stranded, 0) / nullif(tot.span, 0) AS stranded_share,
           (SELECT count(*) FROM real) AS samples,
           (SELECT any_value(logger) FROM real) AS from_logger
    FROM eng, tot ORDER BY eng.engine"""


# per EngineCore or worker source of the run: its rank and how many steps, request events and KV snapshots it sent
WORK_SQL = """WITH src AS (SELECT source_id, runtime, rank FROM sources
                       WHERE run_id = $run AND runtime IN ('vllm-engine', 'vllm-worker')),
    w AS (SELECT source_id, count(*) AS n FROM steps WHERE source_id IN (SELECT source_id FROM src) GROUP BY 1
          UNION ALL SELECT source_id, count(*) FROM request_events WHERE source_id IN (SELECT source_id FROM src)
          GROUP BY 1
          UNION ALL SELECT source_id, count(*) FROM kv_snapshots WHERE source_id IN (SELECT source_id FROM src)
          GROUP BY 1)
    SELECT src.runtime, src.rank, coalesce(sum(w.n), 0) FROM src LEFT JOIN w USING (source_id) GROUP BY ALL"""


def _int(value: str | None) -> int | None:
    try:
        return int(float(value)) if value is not None else None
    except ValueError:
        return None


def silent_engines(con: duckdb.DuckDBPyConnection, run_id: str, seen: set[int],
                   from_logger: bool) -> tuple[int | None, list[int], dict[int, str]]:
    """(engines expected by the run's `dp` label or None, the idle ones, the gaps: engine -> why) among the
    expected engines absent from the gauges `seen` (module docstring)."""
    lab = _labels(con, run_id)
    expected = _int(lab.get("dp"))
    missing = sorted(set(range(expected or 0)) - seen)
    if not missing:
        return expected, [], {}
    if not from_logger:
        return expected, [], {e: "no series in the /metrics scrape, which holds every engine's gauges: a lost "
                                 "series, not an idle engine" for e in missing}
    width = max(1, _int(lab.get("tp")) or 1) * max(1, _int(lab.get("pp")) or 1)  # ranks per engine
    work = con.execute(WORK_SQL, {"run": run_id}).fetchall()
    idle, gaps = [], {}
    for e in missing:
        mine = [(rt, n) for rt, rank, n in work if e * width <= rank < (e + 1) * width]
        done = sum(n for _, n in mine)
        if done:
            gaps[e] = (f"its probe recorded {done} rows (steps, request events, KV snapshots), but the API server's "
                       "stat logger holds no sample of it: a gap in the gauges, not an idle engine")
        elif any(rt == "vllm-engine" for rt, _ in mine):
            idle.append(e)
        else:
            gaps[e] = ("no gauge sample and no probe of its own in the run: an idle engine cannot be told from a "
                       "probe that failed")
    return expected, idle, gaps


def dp_balance(con: duckdb.DuckDBPyConnection, run_id: str, near_cap: float = T["near_cap"]) -> dict[str, Any]:
    """How evenly the run's data-parallel engines were loaded: `engines` (those counted: with gauges, plus idle
    ones), per engine (`by_engine`: usage_mean, waiting_mean, usage_max, busy_share, headroom_share),
    `kv_imbalance`, `waiting_imbalance`, `hot_engine`, `stranded_share` (time fractions), `span_s` (s),
    `samples` (gauge rows read), `source` ("stat-logger" or "scrape"); `expected_engines` (the `dp` label, or
    None), `idle_engines` (sent no sample, never stepped: counted at 0), `gaps` (engine -> why it has no figure).
    Fewer than two engines, or any gap: None for the figures."""
    seen = dict(con.execute(SEEN_SQL, {"run": run_id}).fetchall())  # engine -> from the stat logger
    expected, idle, gaps = (silent_engines(con, run_id, set(seen), any(seen.values())) if seen
                            else (_int(_labels(con, run_id).get("dp")), [], {}))  # no gauges at all: no claim
    rows = con.execute(DP_SQL, {"run": run_id, "near_cap": near_cap, "idle": [] if gaps else idle})
    names = [d[0] for d in rows.description]
    eng = [dict(zip(names, r)) for r in rows.fetchall()]
    empty = {"engines": len(eng), "by_engine": {}, "kv_imbalance": None, "waiting_imbalance": None,
             "hot_engine": None, "stranded_share": None, "span_s": None, "samples": None, "source": None,
             "near_cap": near_cap, "expected_engines": expected, "idle_engines": idle if not gaps else [],
             "gaps": gaps}
    if len(eng) < 2 or gaps or not eng[0]["span_s"]:
        return empty
    keys = ("usage_mean", "waiting_mean", "usage_max", "busy_share", "headroom_share")
    return {**empty,
            "by_engine": {int(r["engine"]): {k: r[k] for k in keys} for r in eng},
            "kv_imbalance": kv_imbalance([r["usage_mean"] for r in eng]),
            "waiting_imbalance": kv_imbalance([r["waiting_mean"] for r in eng]),
            "hot_engine": int(eng[0]["hot_engine"]), "stranded_share": eng[0]["stranded_share"],
            "span_s": eng[0]["span_s"], "samples": eng[0]["samples"],
            "source": "stat-logger" if eng[0]["from_logger"] else "scrape"}
