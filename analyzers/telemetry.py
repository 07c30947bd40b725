"""Silent degradation: telemetry that stops being true while the server keeps serving.

Each reason is one finding (id `telemetry-<reason>`) and one series of the live gauge
`phasescope_telemetry_degraded{reason}` (exporters/telemetry_watch.py), so an alert fires
before someone trusts a dashboard built on missing data:

- `kv-snapshots-stopped`: the run had KV snapshots, then steps went on for
  `telemetry_stale_s` seconds (and at least `min_stale_steps` steps) without one;
- `prefix-counters-stuck`: prefix counters had arrived, but their queried tokens stopped growing while
  new requests went on being admitted (first scheduled) for `telemetry_stale_s` seconds (and at least
  `min_stale_steps // 4` of them). Admissions, not prefill steps: a re-prefill after a preemption and
  the later chunks of a chunked prompt are no lookup, and on a starved host they alone can run past
  `telemetry_stale_s` after the last admission (a false alarm measured on a loaded 2-core CI machine);
- `gpu-timing-stopped`: a source that had CUDA-event-timed steps had none for `telemetry_stale_s`
  seconds of steps (the sampler's rate fell to zero, or the poller is stuck);
- `clock-skew`: a probe's wall clock at connect differs from the sidecar's by more than
  `max_clock_skew_s` (every timestamp it sent is that far off);
- `adapter-partial`: the runtime adapter reported parts of the runtime it does not understand
  (run label `adapter_missing`): those figures are absent, not zero;
- `store-fold-failed`: while the run was recorded, the sidecar's live fold of the derived tables failed or fell
  `alarm_lag_s` behind (its `sidecar_health` rows, agent/sidecar/folding.py): every figure is still exact (the
  views fold what is missing at each read), but reads of the run are slower and may run past the read memory.

Dropped records are `probe-dropping` (reliability.py). All times are wall-clock seconds:
monotonic `ts_ns` of each source plus its `wall_minus_mono_ns`, so sources of different
processes compare.
"""

from __future__ import annotations

from phasescope.agent.read.thresholds import T

from .findings import Finding, ref
from .sql import one

_WALL = "(x.ts_ns + s.wall_minus_mono_ns) / 1e9"

KV_STOPPED_SQL = f"""WITH kv AS (SELECT max({_WALL}) AS last_kv_s, count(*) AS snapshots
                        FROM kv_snapshots x JOIN sources s USING (source_id) WHERE s.run_id = $run),
        st AS (SELECT {_WALL} AS t FROM steps x JOIN sources s USING (source_id) WHERE s.run_id = $run)
    SELECT kv.snapshots, kv.last_kv_s, (SELECT max(t) FROM st) AS last_step_s,
           (SELECT count(*) FROM st WHERE t > kv.last_kv_s) AS steps_after
    FROM kv"""

_PREFIX_STUCK = f"""WITH p AS (SELECT {_WALL} AS t, x.queried_tokens_total AS q
                        FROM prefix_counters x JOIN sources s USING (source_id) WHERE s.run_id = $run),
        pc AS (SELECT count(*) AS n, max(q) AS qmax FROM p),
        {{moved}},
        adm AS (SELECT min(x.ts_ns + s.wall_minus_mono_ns) FILTER (WHERE x.event = 'scheduled') / 1e9 AS t,
                       coalesce(max(x.tokens) FILTER (WHERE x.event = 'arrival'), 0) AS prompt_tokens
                FROM request_log x JOIN sources s USING (source_id) WHERE x.run_id = $run
                GROUP BY x.request_id HAVING count(*) FILTER (WHERE x.event = 'scheduled') > 0),
        ad AS (SELECT max(adm.t) AS last_admission_s,
                      count(*) FILTER (WHERE adm.t > moved.last_move_s) AS admissions_after,
                      coalesce(sum(adm.prompt_tokens) FILTER (WHERE adm.t > moved.last_move_s), 0)
                          AS admitted_prompt_tokens_after
               FROM moved, adm),
        pre AS (SELECT {_WALL} AS t, x.prefill_tokens FROM steps x JOIN sources s USING (source_id)
                WHERE s.run_id = $run AND x.prefill_tokens > 0)
    SELECT any_value(pc.n) AS counter_records, any_value(pc.qmax) AS queried_tokens_total,
           any_value(moved.last_move_s) AS last_move_s, any_value(ad.last_admission_s) AS last_admission_s,
           any_value(ad.admissions_after) AS admissions_after,
           any_value(ad.admitted_prompt_tokens_after) AS admitted_prompt_tokens_after,
           max(pre.t) AS last_prefill_s,
           count(pre.t) FILTER (WHERE pre.t > moved.last_move_s) AS prefill_steps_after,
           coalesce(sum(pre.prefill_tokens) FILTER (WHERE pre.t > moved.last_move_s), 0) AS prefill_tokens_after
    FROM moved, pc, ad LEFT JOIN pre ON true"""
# the last time the queried counter grew over the record before it (time order)
PREFIX_STUCK_SQL = _PREFIX_STUCK.format(moved="""moved AS (SELECT max(t) AS last_move_s FROM
                    (SELECT t, q, lag(q) OVER (ORDER BY t) AS prev FROM p) WHERE prev IS NULL OR q > prev)""")
# the same over the latest records only (no sort of them all): when one of them grew over the one before, the
# last that did is the answer; when none did (or the first of them is the run's first) the whole is needed
PREFIX_TAIL = 1024
PREFIX_STUCK_TAIL_SQL = _PREFIX_STUCK.format(moved=f"""moved AS (SELECT max(t) AS last_move_s FROM
                    (SELECT t, q, lag(q) OVER (ORDER BY t) AS prev, row_number() OVER (ORDER BY t) AS i
                     FROM (SELECT t, q FROM p ORDER BY t DESC LIMIT {PREFIX_TAIL + 1}))
                    WHERE (i > 1 AND q > prev) OR (i = 1 AND (SELECT n FROM pc) <= {PREFIX_TAIL + 1}))""")

GPU_STOPPED_SQL = f"""WITH st AS (SELECT x.source_id, {_WALL} AS t, NOT isnan(x.gpu_ms) AS timed
                        FROM steps x JOIN sources s USING (source_id) WHERE s.run_id = $run),
        per AS (SELECT source_id, max(t) FILTER (WHERE timed) AS last_timed_s, max(t) AS last_step_s,
                       count(*) FILTER (WHERE timed) AS timed_steps
                FROM st GROUP BY source_id HAVING count(*) FILTER (WHERE timed) > 0)
    SELECT per.source_id, per.timed_steps, per.last_timed_s, per.last_step_s,
           (SELECT count(*) FROM st WHERE st.source_id = per.source_id AND st.t > per.last_timed_s) AS steps_after
    FROM per ORDER BY per.last_step_s - per.last_timed_s DESC LIMIT 1"""

SKEW_SQL = """SELECT source_id, pid, rank,
           ((ts_ns + wall_minus_mono_ns) - connected_ns) / 1e9 AS skew_s
    FROM sources WHERE run_id = $run AND connected_ns IS NOT NULL AND connected_ns > 0
    ORDER BY abs((ts_ns + wall_minus_mono_ns) - connected_ns) DESC LIMIT 1"""

# Cheap aggregates that decide first whether a reason can fire at all (one pass each, no sort, no per-row
# join to a maximum): the full queries above run only when it can, and their answer is the evidence. Same
# findings, same evidence; a healthy run (the common case) pays only these.
# (maxima of ts_ns, then wall seconds once per source: (ts + wall) / 1e9 is monotone in ts, so the maximum is the
# same number the full queries compute row by row)
STEPS_LAST_SQL = """WITH per AS (
        SELECT source_id, max(ts_ns) AS last_ns, max(ts_ns) FILTER (WHERE NOT isnan(gpu_ms)) AS timed_ns,
               count(*) FILTER (WHERE NOT isnan(gpu_ms)) AS timed_steps
        FROM steps WHERE source_id IN (SELECT source_id FROM sources WHERE run_id = $run) GROUP BY source_id)
    SELECT p.source_id, (p.last_ns + s.wall_minus_mono_ns) / 1e9 AS last_step_s,
           (p.timed_ns + s.wall_minus_mono_ns) / 1e9 AS last_timed_s, p.timed_steps
    FROM per p JOIN sources s USING (source_id)"""
# the run's last scheduled event, wall seconds: re-admissions included, so never before its last admission
SCHEDULED_LAST_SQL = """WITH per AS (SELECT source_id, max(ts_ns) AS last_ns FROM request_events
                 WHERE event = 'scheduled' AND source_id IN (SELECT source_id FROM sources WHERE run_id = $run)
                 GROUP BY source_id)
    SELECT max((p.last_ns + s.wall_minus_mono_ns) / 1e9) AS last_scheduled_s FROM per p JOIN sources s USING (source_id)"""
KV_LAST_SQL = """WITH per AS (SELECT source_id, max(ts_ns) AS last_ns, count(*) AS n FROM kv_snapshots
                 WHERE source_id IN (SELECT source_id FROM sources WHERE run_id = $run) GROUP BY source_id)
    SELECT max((p.last_ns + s.wall_minus_mono_ns) / 1e9) AS last_kv_s, coalesce(sum(p.n), 0) AS snapshots
    FROM per p JOIN sources s USING (source_id)"""
# whether the queried counter grew after $w_ns (wall ns): when the largest value after it exceeds every value up
# to it, the first record holding that value grew over the record before it (whatever the order of equal times)
PREFIX_MOVED_AFTER_SQL = """SELECT count(*) AS n,
           max(x.queried_tokens_total) FILTER (WHERE x.ts_ns + s.wall_minus_mono_ns > $w_ns) >
               coalesce(max(x.queried_tokens_total) FILTER (WHERE x.ts_ns + s.wall_minus_mono_ns <= $w_ns), -1)
               AS moved_after
    FROM prefix_counters x JOIN sources s USING (source_id) WHERE s.run_id = $run"""
_MARGIN_S = 1e-3  # wall seconds near 2^31 carry ~2e-7 s of rounding: a move this far past the window is in it


# the sidecar's fold health rows (agent/sidecar/folding.py) from the run's first connect to its last step (+60 s),
# with the last one before when it was failing (one row a minute at most while a failure lasts)
FOLD_SQL = """WITH span AS (
        SELECT (SELECT min(connected_ns) FROM sources WHERE run_id = $run) AS lo,
               (SELECT max(x.ts_ns + s.wall_minus_mono_ns) FROM steps x JOIN sources s USING (source_id)
                WHERE s.run_id = $run) + 60000000000 AS hi),
     f AS (SELECT * FROM sidecar_health WHERE check_name = 'derived-fold'),
     -- the rows in the span, and the last one before it when that one says failing (a state the run began in)
     h AS (SELECT f.* FROM f, span WHERE f.ts_ns >= span.lo AND (span.hi IS NULL OR f.ts_ns <= span.hi)
           UNION ALL
           SELECT * FROM (SELECT f.* FROM f, span WHERE f.ts_ns < span.lo ORDER BY f.ts_ns DESC LIMIT 1) WHERE NOT ok)
    SELECT count(*) FILTER (WHERE NOT ok) AS failures, min(ts_ns) FILTER (WHERE NOT ok) / 1e9 AS first_failure_s,
           max(ts_ns) FILTER (WHERE NOT ok) / 1e9 AS last_failure_s, arg_max(ok, ts_ns) AS ok_at_end,
           arg_max(detail, ts_ns) FILTER (WHERE NOT ok) AS last_detail, max(lag_s) AS lag_max_s,
           max(behind_rows) AS behind_rows_max
    FROM h"""


def _fold_health(con, run_id: str) -> dict | None:
    """FOLD_SQL's row when the run's span holds a failing fold record; None otherwise or without the table (a
    store older than it, an export)."""
    if not con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'sidecar_health'").fetchone()[0]:
        return None
    row = one(con, FOLD_SQL, run_id)
    return row if row and row["failures"] else None


def _can_fire(con, run_id: str, stale_s: float) -> dict[str, bool]:
    """Per reason (kv, prefix, gpu): False when the cheap aggregates prove it cannot fire (its silence is
    under `stale_s`); True when the full query must decide."""
    per = con.execute(STEPS_LAST_SQL, {"run": run_id}).fetchall()
    last_step = max((r[1] for r in per if r[1] is not None), default=None)
    kv = one(con, KV_LAST_SQL, run_id)
    out = {"kv": bool(kv["snapshots"]) and last_step is not None and last_step - kv["last_kv_s"] >= stale_s}
    gaps = [r[1] - r[2] for r in per if r[3]]  # sources that had GPU-timed steps
    out["gpu"] = bool(gaps) and max(gaps) >= stale_s
    last_scheduled = one(con, SCHEDULED_LAST_SQL, run_id)["last_scheduled_s"]
    if last_scheduled is None:
        out["prefix"] = False
    else:
        px = one(con, PREFIX_MOVED_AFTER_SQL, run_id, w_ns=int((last_scheduled - stale_s + _MARGIN_S) * 1e9))
        out["prefix"] = bool(px["n"]) and not px["moved_after"]
    return out


ADAPTER_SQL = "SELECT value FROM run_info WHERE run_id = $run AND key = 'adapter_missing'"
# the vLLM adapter's budget lowered its detail (adapters/vllm/budget.py): what is off, since when, why
LOWERED_SQL = ("SELECT max(CASE WHEN key = 'detail_lowered' THEN value END), "
               "max(CASE WHEN key = 'vllm_adapter_budget' THEN value END) FROM run_info WHERE run_id = $run")

SUGGEST_ADAPTER = ("Check the probe's log for the adapter's warning and the runtime's version against the versions "
                   "the adapter supports; until then, read the affected figures from the server's own metrics "
                   "(scrape mode) and do not alert on their absence as if it were zero.")


def _stopped(row: dict, last_key: str, sql: str, stale_s: float, min_steps: int) -> dict | None:
    """The evidence of a reason whose records stopped while steps went on: `row` (a query's, with `last_step_s`,
    `steps_after` and the last record's wall seconds under `last_key`) with `silent_s`, when steps ran on for
    >= `stale_s` seconds and >= `min_steps` steps after that record; else None."""
    silent = row["last_step_s"] - row[last_key]
    if silent >= stale_s and row["steps_after"] >= min_steps:
        return {**row, "silent_s": silent, "query": sql}
    return None


def _warning(run_id: str, thresholds: dict, *, id: str, title: str, evidence: dict, suggestion: str,
             expected_effect: str, severity: str = "warning", summary: str = "", action: str = "") -> Finding:
    """Every reason's finding: a warning on the probe's health (info where it is the probe's own choice)."""
    return Finding(id=id, title=title, severity=severity, evidence=evidence, suggestion=suggestion,
                   expected_effect=expected_effect, reference=ref("Probe health"), run_id=run_id,
                   thresholds=thresholds, summary=summary, action=action)


def telemetry_degraded(con, run_id: str, *, telemetry_stale_s: float = T["telemetry_stale_s"],
                       max_clock_skew_s: float = T["max_clock_skew_s"], min_stale_steps: int = 20,
                       **_: object) -> list[Finding]:
    """One finding per reason the run's telemetry stopped being true (see the module doc)."""
    out: list[Finding] = []
    th = {"telemetry_stale_s": telemetry_stale_s, "min_stale_steps": min_stale_steps}

    can = _can_fire(con, run_id, telemetry_stale_s)
    kv = one(con, KV_STOPPED_SQL, run_id) if can["kv"] else {}
    if kv and kv["snapshots"] and kv["last_step_s"] is not None and (
            e := _stopped(kv, "last_kv_s", KV_STOPPED_SQL, telemetry_stale_s, min_stale_steps)):
        out.append(_warning(
            run_id, th, id="telemetry-kv-snapshots-stopped",
            title="KV snapshots stopped while steps went on: KV figures are stale", evidence=e,
            summary=(f"{e['steps_after']} steps over {e['silent_s']:.1f} s ran after the last KV snapshot: every KV "
                     "figure since is missing."),
            action="Check the probe's log for adapter errors, then restart the adapter or the server.",
            suggestion=("The runtime adapter stopped reporting the KV cache: check the probe's log (adapter "
                        "errors, a runtime upgrade), restart the adapter or the server; until then KV usage, "
                        "fragmentation and headroom on the dashboard describe the past."),
            expected_effect=(f"{e['steps_after']} steps over {e['silent_s']:.1f} s ran after the last of "
                             f"{e['snapshots']} KV snapshots; every KV figure since is missing.")))

    px = one(con, PREFIX_STUCK_TAIL_SQL, run_id) if can["prefix"] else {}
    if px and px["last_move_s"] is None and (px["counter_records"] or 0) > PREFIX_TAIL + 1:
        px = one(con, PREFIX_STUCK_SQL, run_id)
    if px and px["counter_records"] and px["last_move_s"] is not None and px["last_admission_s"] is not None:
        stuck = px["last_admission_s"] - px["last_move_s"]
        if stuck >= telemetry_stale_s and px["admissions_after"] >= max(1, min_stale_steps // 4):
            out.append(_warning(
                run_id, th, id="telemetry-prefix-counters-stuck",
                title="Prefix-cache counters stopped moving while new requests were admitted",
                summary=(f"The prefix counters last moved {stuck:.1f} s before the last admission: "
                         f"{px['admissions_after']} requests went uncounted."),
                action="Check the adapter's log and the server's prefix-caching setting: hit rates shown are old.",
                evidence={**px, "stuck_s": stuck, "query": PREFIX_STUCK_SQL},
                suggestion=("The prefix-cache counters are no longer wired (adapter lost its hook, cache disabled "
                            "at runtime): hit rates shown are those of the past. Check the adapter's log and the "
                            "server's prefix-caching setting."),
                expected_effect=(f"{px['admissions_after']} requests ({px['admitted_prompt_tokens_after']} prompt "
                                 f"tokens) admitted over {stuck:.1f} s after the counters' last move went uncounted "
                                 f"by the prefix cache; {px['prefill_tokens_after']} prompt tokens in "
                                 f"{px['prefill_steps_after']} prefill steps ran in that time.")))

    gpu = one(con, GPU_STOPPED_SQL, run_id) if can["gpu"] else {}
    if gpu and gpu.get("last_timed_s") is not None and (
            e := _stopped(gpu, "last_timed_s", GPU_STOPPED_SQL, telemetry_stale_s, min_stale_steps)):
        out.append(_warning(
            run_id, th, id="telemetry-gpu-timing-stopped",
            title="GPU step times stopped: CUDA-event sampling fell to zero", evidence=e,
            summary=(f"{e['steps_after']} steps over {e['silent_s']:.1f} s after the last GPU-timed step carry host "
                     "time only."),
            action="Check the probe's GPU sample rate, unsampled steps and errors; raise gpu_budget at its floor.",
            suggestion=("Look at the probe's health: its GPU sample rate (phasescope_probe_gpu_sample_ratio), "
                        "unsampled steps (event pool exhausted: the poller is stuck or the GPU never completes) "
                        "and errors; raise gpu_budget if the rate is at its floor."),
            expected_effect=(f"{e['steps_after']} steps over {e['silent_s']:.1f} s after the last of "
                             f"{e['timed_steps']} GPU-timed steps carry host time only.")))

    skew = one(con, SKEW_SQL, run_id)
    if skew and skew.get("skew_s") is not None and abs(skew["skew_s"]) > max_clock_skew_s:
        out.append(_warning(
            run_id, {"max_clock_skew_s": max_clock_skew_s}, id="telemetry-clock-skew",
            title="A probe's clock disagrees with the sidecar's", evidence={**skew, "query": SKEW_SQL},
            summary=f"Source {skew['source_id']} (pid {skew['pid']}) is {skew['skew_s']:+.3f} s off the sidecar's clock.",
            action="Synchronize the hosts' clocks (NTP/chrony): this source's timestamps line up again.",
            suggestion=("Synchronize the clocks of the probe's and the sidecar's hosts (NTP/chrony); timestamps of "
                        "this source are shifted by the skew when compared with other sources or the server."),
            expected_effect=f"source {skew['source_id']} (pid {skew['pid']}) is {skew['skew_s']:+.3f} s off."))

    rows = con.execute(ADAPTER_SQL, {"run": run_id}).fetchall()
    missing = rows[0][0] if rows else ""
    if missing:
        out.append(_warning(
            run_id, {}, id="telemetry-adapter-partial",
            title="The runtime adapter understands this runtime only in part",
            evidence={"adapter_missing": missing, "query": ADAPTER_SQL}, suggestion=SUGGEST_ADAPTER,
            summary=f"Hooks missing: {missing}; what they measure is absent, not zero.",
            action="Check the probe's log and the runtime's version; read those figures from the server meanwhile.",
            expected_effect=f"missing: {missing}; the figures those hooks produce are absent, not zero."))
    fold = _fold_health(con, run_id)
    if fold:
        now = not fold["ok_at_end"]
        out.append(_warning(
            run_id, {}, id="telemetry-store-fold-failed", severity="warning" if now else "info",
            title=("The sidecar's live fold of request events is failing" if now else
                   "The sidecar's live fold of request events failed, then recovered"),
            evidence={**fold, "query": FOLD_SQL},
            summary=(f"The live fold failed {fold['failures']} time(s)" + (", and still fails." if now else
                                                                          ", then caught up.")),
            action="Figures stay exact (reads fold what is missing): give the fold memory or CPU (--evidence).",
            suggestion=("Every figure is still exact: reads fold the events the derived tables miss themselves, "
                        "at a cost that grows with them. Read the error: out of memory means a larger "
                        "--read-memory-mib or a smaller --fold-slice-rows; behind means the host's CPU cannot "
                        "fold at the event rate (more CPU for the sidecar, or --store-threads off its cap)."),
            expected_effect=(f"{fold['failures']} failing health record(s) from {fold['first_failure_s']:.0f} to "
                             f"{fold['last_failure_s']:.0f} (Unix s); the last: {fold['last_detail']}"
                             + ("" if now else "; the last record says it caught up") + ".")))
    lowered, budget = con.execute(LOWERED_SQL, {"run": run_id}).fetchone() or (None, None)
    if lowered:
        # info, not a warning: the budget doing its job (every GPU run so far lowered at the 0.5% default) is no
        # fault of the server's; what is off is said, and every /metrics counter is still exact
        out.append(_warning(
            run_id, {}, id="telemetry-detail-lowered", severity="info",
            title="The probe lowered its detail to stay inside its budget",
            evidence={"detail_lowered": lowered, "budget_share": budget, "query": LOWERED_SQL},
            summary=f"Detail lowered: {lowered}.",
            action="Read those figures as absent from then on (/metrics counters stay exact), or raise "
                   "PHASESCOPE_VLLM_BUDGET.",
            suggestion=("Read the lowered figures (page lifecycles, KV walks: shared pages and the free run, "
                        "per-lookup prefix miss causes, by level) as absent from then on; every counter vLLM's own "
                        "/metrics has is still exact. To keep them, raise PHASESCOPE_VLLM_BUDGET (the share of "
                        "step time the adapter may take)."),
            expected_effect=f"detail lowered: {lowered}."))
    return out
