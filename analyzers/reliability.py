"""Preemption and recomputation cost, survival rate under load, probe drops."""

from __future__ import annotations

from .findings import Finding, ref
from .sql import PREEMPTIONS, PREFIX_TOTALS, RUN_STEPS, one, prefill_cost

PREEMPT_SQL = f"""WITH st AS ({RUN_STEPS})
    SELECT sum(prefill_tokens) AS prefill_tokens_total FROM st"""

PREEMPTED_LATENCY_SQL = """SELECT quantile_cont(e2e_s, 0.5) FILTER (WHERE preemptions > 0) AS e2e_p50_preempted_s,
           quantile_cont(e2e_s, 0.5) FILTER (WHERE preemptions = 0) AS e2e_p50_other_s
    FROM requests WHERE run_id = $run"""


def preemption_recompute(con, run_id: str, *, min_preemptions: int = 1, critical_recompute_share: float = 0.2,
                         **_: object) -> list[Finding]:
    """Fires when >= `min_preemptions` preemptions happened; the cost is the recomputed prefill tokens
    (share of all prefill tokens) times the measured ms per prefill token."""
    pre = one(con, PREEMPTIONS, run_id)
    if pre["preemptions"] < min_preemptions:
        return []
    px = one(con, PREFIX_TOTALS, run_id)
    tot = one(con, PREEMPT_SQL, run_id)
    lat = one(con, PREEMPTED_LATENCY_SQL, run_id)
    cost = prefill_cost(con, run_id)
    recomputed = px["recomputed_tokens"] or 0
    # never more recompute than the run's steps prefilled: a counter over that (a store whose steps were trimmed
    # or rolled out while the counters kept their totals) is said and counted at that bound
    prefilled = tot["prefill_tokens_total"] or 0
    counted = min(recomputed, prefilled) if prefilled else recomputed
    over = (f" (the recompute counter reads {recomputed} tokens, more than the {prefilled} prefill tokens the "
            "run's steps computed: at most those are counted)") if counted < recomputed else ""
    share = counted / prefilled if prefilled else 0.0
    seconds = counted * max(cost["ms_per_prefill_token"] or 0.0, 0.0) / 1e3
    e = {**pre, "recomputed_tokens": recomputed, "recomputed_tokens_counted": counted, **tot,
         "recomputed_share_of_prefill": share, "affected_share": share, "affected_of": "prefill tokens",
         "ms_per_prefill_token": cost["ms_per_prefill_token"], "recompute_cost_s": seconds, **lat,
         "query": PREEMPTIONS + ";\n" + PREFIX_TOTALS + ";\n" + PREEMPT_SQL + ";\n" + PREEMPTED_LATENCY_SQL}
    return [Finding(
        summary=(f"{pre['preemptions']} preemptions recomputed {counted}{'+' if over else ''} tokens, {share:.0%} of "
                 f"all prefill work (~{seconds:.2f} s of step time)."),
        action="Admit fewer sequences than the KV cache holds at peak and shed load early: that time goes back to "
               "useful work.",
        id="preemption-recompute",
        title="Preempted requests are recomputed",
        severity="critical" if share >= critical_recompute_share else "warning",
        evidence=e,
        suggestion=("Admit fewer sequences than the KV cache can hold at peak (max concurrent sequences), reject or "
                    "redirect new requests when KV usage passes a threshold, and preempt early or swap KV to host "
                    "memory for long-context requests rather than recompute them; CPU offload is a last resort."),
        expected_effect=(f"{pre['preemptions']} preemptions of {pre['preempted_requests']} requests recomputed "
                         f"{counted} tokens{over}, {share:.0%} of all prefill work (~{seconds:.2f} s of step time); "
                         + (f"preempted requests took a median {lat['e2e_p50_preempted_s']:.2f} s end to end vs "
                            f"{lat['e2e_p50_other_s']:.2f} s for the others. " if lat['e2e_p50_preempted_s'] and
                            lat['e2e_p50_other_s'] else "")
                         + "Avoiding preemption returns that time to useful work."),
        reference=ref("Overload and preemption"),
        run_id=run_id,
        thresholds={"min_preemptions": min_preemptions, "critical_recompute_share": critical_recompute_share},
    )]


SURVIVAL_SQL = """WITH r AS (SELECT * FROM requests WHERE run_id = $run),
    d AS (SELECT arrival_ns AS ts, 1 AS delta FROM r
          UNION ALL SELECT coalesce(last_token_ns, arrival_ns), -1 FROM r WHERE status != 'running'),
    c AS (SELECT sum(delta) OVER (ORDER BY ts, delta DESC ROWS UNBOUNDED PRECEDING) AS n FROM d),
    w AS (SELECT max(t.ts_ns + s.wall_minus_mono_ns) AS last_wall_ns
          FROM request_events t JOIN sources s USING (source_id) WHERE s.run_id = $run)
    SELECT (SELECT count(*) FROM r) AS requests,
           (SELECT count(*) FROM r WHERE status = 'finished') AS finished,
           (SELECT count(*) FROM r WHERE status = 'aborted') AS aborted,
           (SELECT count(*) FROM request_events t JOIN sources s USING (source_id)
            WHERE s.run_id = $run AND t.event = 'cancelled') AS cancelled,
           (SELECT count(*) FROM r WHERE status = 'running') AS unfinished,
           (SELECT max(n) FROM c) AS peak_concurrency,
           (SELECT last_wall_ns FROM w) AS last_event_wall_ns"""


def survival_rate(con, run_id: str, *, min_survival: float = 0.99, critical_survival: float = 0.95,
                  in_flight_window_s: float = 60.0, labels: dict | None = None, now_ns: int | None = None,
                  **_: object) -> list[Finding]:
    """Fires when the share of judged requests that finished is below `min_survival`.

    Requests the client cancelled (a hang-up, an abort call: the runtime says which, event 'cancelled') are
    not judged; `aborted` counts those the server or engine ended (errors, shutdown).

    A request still running is a failure only once the run is over. `now_ns` (wall clock, Unix ns) is given
    by a live reader (the agent's read API): when the run's last request event is less than
    `in_flight_window_s` before it, the run is live and its running requests are in flight, not judged.
    Offline (`now_ns` None: a file no agent writes) the data is complete and they never finished."""
    e = one(con, SURVIVAL_SQL, run_id)
    if not e["requests"]:
        return []
    last = e.pop("last_event_wall_ns")
    age_s = (now_ns - last) / 1e9 if now_ns is not None and last is not None else None
    live = age_s is not None and age_s < in_flight_window_s
    in_flight = e["unfinished"] if live else 0
    # a client's cancel (hang-up, abort call: event 'cancelled') is no failure of the server: not judged
    cancelled = min(e.pop("cancelled") or 0, e["aborted"])
    e["cancelled"], e["aborted"] = cancelled, e["aborted"] - cancelled
    judged = e["requests"] - in_flight - cancelled
    e.update(in_flight=in_flight, judged=judged, live=live,
             last_event_age_s=None if age_s is None else round(age_s, 3))
    if not judged:
        return []
    rate = e["finished"] / judged
    if rate >= min_survival:
        return []
    e["survival_rate"] = rate
    oom = (labels or {}).get("oom_total")
    if oom is not None:
        e["oom_total"] = oom
    e["query"] = SURVIVAL_SQL
    never = (f"{e['unfinished']} never finished" if not live else
             f"{in_flight} still in flight (the run is live: not judged)")
    return [Finding(
        summary=(f"{e['finished']} of {judged} requests finished ({rate:.1%}); {e['aborted']} aborted by the server, "
                 f"{never}."),
        action=f"Find what kills requests (OOM, timeouts, KV exhaustion) and shed load early: target >= {min_survival:.0%}.",
        id="survival-rate-low",
        title="Requests fail under load",
        severity="critical" if rate < critical_survival else "warning",
        evidence=e,
        suggestion=("Find what kills requests (OOM, timeouts, KV exhaustion) and protect the service: admission "
                    "control that rejects or redirects early when KV usage or queue length passes a threshold, a "
                    "KV budget at or below ~80% of the memory left after weights, then load-test at 2-3x the "
                    "production peak and track the survival rate after each change."),
        expected_effect=(f"{e['finished']} of {judged} requests finished ({rate:.1%}); {e['aborted']} aborted by the "
                         f"server, "
                         f"{never}, at up to {e['peak_concurrency']} concurrent requests"
                         + (f" ({cancelled} cancelled by their clients, not judged)" if cancelled else "") + ". "
                         f"The target is >= {min_survival:.0%}."),
        reference=ref("Experiments"),
        run_id=run_id,
        thresholds={"min_survival": min_survival, "critical_survival": critical_survival,
                    "in_flight_window_s": in_flight_window_s},
    )]


PROBE_SQL = """WITH last AS (
        SELECT h.*, row_number() OVER (PARTITION BY h.source_id ORDER BY h.ts_ns DESC) AS rn
        FROM probe_health h JOIN sources s USING (source_id) WHERE s.run_id = $run)
    SELECT coalesce(sum(records_total), 0) AS records_total, coalesce(sum(dropped_total), 0) AS dropped_total,
           coalesce(sum(errors_total), 0) AS errors_total, coalesce(sum(send_failures_total), 0) AS send_failures_total
    FROM last WHERE rn = 1"""


def probe_dropping(con, run_id: str, *, max_drop_share: float = 0.0, critical_drop_share: float = 0.01,
                   **_: object) -> list[Finding]:
    """Fires when the probe dropped more than `max_drop_share` of its records (or hit errors)."""
    e = one(con, PROBE_SQL, run_id)
    total = e["records_total"] + e["dropped_total"]
    share = e["dropped_total"] / total if total else 0.0
    if share <= max_drop_share and not e["errors_total"]:
        return []
    e["drop_share"] = share
    e["query"] = PROBE_SQL
    return [Finding(
        summary=(f"The probe dropped {e['dropped_total']} of {total} records ({share:.2%}) with {e['errors_total']} "
                 "errors: the figures here are incomplete."),
        action="Check that the sidecar runs and keeps up (socket, CPU, disk), or enlarge the probe's ring.",
        id="probe-dropping",
        title="The probe is dropping records: findings may be incomplete",
        severity="critical" if share >= critical_drop_share else "warning",
        evidence=e,
        suggestion=("Check that the sidecar runs and keeps up (its socket, CPU, disk); enlarge the probe's ring or "
                    "flush more often; look at the probe's errors in the host's log."),
        expected_effect=(f"{e['dropped_total']} of {total} records dropped ({share:.2%}), {e['errors_total']} "
                         f"errors, {e['send_failures_total']} failed sends; with none dropped every figure here is "
                         "complete."),
        reference=ref("Probe health"),
        run_id=run_id,
        thresholds={"max_drop_share": max_drop_share, "critical_drop_share": critical_drop_share},
    )]
