"""A load sweep's points, its SLO knee, and the constraint that binds there (issue 28).

Pure functions over the store: each sweep point is one run (labels `sweep_id`, `sweep_point`,
`sweep_rate_per_s`). Definitions (tests pin them):

- a request is *good* when it finished and meets every SLO given: TTFT <= `ttft_slo_s`, TPOT <= `tpot_slo_s`
  (a one-token request has no TPOT and meets it, as in `slo_attainment`), E2E <= `e2e_slo_s` (None: no SLO);
- goodput = good requests / the point's duration (first arrival to last token), vLLM `--goodput`'s
  definition (good completed requests over the benchmark's duration);
- SLO attainment = good / all requests of the point (an aborted or unfinished request is not good);
- survival rate = finished / all requests;
- the knee = the largest offered rate such that every point at or below it has attainment >= `target`
  (DistServe's goodput); None when the lowest rate already misses it.

The binding constraint is read at the *evidence point*: the first point whose attainment fell below the
target (where the knee broke), else the highest rate (the knee was not reached: what limits it next).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from phasescope.agent.read import sweep as read_sweep
from phasescope.agent.read.sweep import GOOD_SQL  # noqa: F401  (the goodput SQL, kept where the store is read)
from phasescope.agent.read.thresholds import T

from .dp import dp_skew
from .host import host_bound
from .kvcache import kv_near_cap
from .prefill import prefill_stalls_decode
from .prefix import prefix_hit_collapse
from .queueing import QUEUE_SQL, ttft_queueing
from .reliability import preemption_recompute
from .constraints import vllm_limits
from .runinfo import runtime_of
from .sql import RUN_STEPS, one

# the requests that missed an SLO at a point, and how many of them were preempted / mostly queued
MISSED_SQL = """SELECT count(*) AS missed, count(*) FILTER (WHERE preemptions > 0) AS missed_preempted,
           count(*) FILTER (WHERE queue_s >= 0.5 * ttft_s) AS missed_mostly_queued
    FROM requests WHERE run_id = $run AND NOT coalesce(status = 'finished' AND ttft_s <= $ttft
                                                      AND coalesce(tpot_s, 0) <= $tpot AND e2e_s <= $e2e, false)"""

CEILING_SQL = f"""WITH st AS ({RUN_STEPS})
    SELECT count(*) AS steps, max(num_seqs) AS max_running,
           count(*) FILTER (WHERE num_seqs >= $cap) / nullif(count(*), 0) AS at_cap_share,
           avg(num_seqs) AS running_mean
    FROM st"""

POINT_KEYS = ("point", "rate_per_s", "run_id", "requests", "finished", "good", "duration_s",
              "achieved_rate_per_s", "goodput_req_per_s", "attainment", "survival",
              "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "tpot_p50_s", "tpot_p95_s", "tpot_p99_s",
              "itl_p50_s", "itl_p99_s", "e2e_p50_s", "e2e_p99_s", "queue_p50_s", "preemptions")


@dataclass(frozen=True)
class Slo:
    """Service-level objectives, seconds (None: not an objective)."""

    ttft_s: float | None = 2.5
    tpot_s: float | None = 0.1
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for k, v in (("ttft_s", self.ttft_s), ("tpot_s", self.tpot_s), ("e2e_s", self.e2e_s)):
            if v is not None and not v > 0:
                raise ValueError(f"SLO {k} must be > 0 seconds, got {v!r}")


@dataclass(frozen=True)
class Constraint:
    """One candidate for what limits the load: whether it binds, its figures (units in keys), the change."""

    name: str  # dp-skew, kv-capacity, batch-ceiling, prefill-interference, prefix-collapse, host-bound, queueing
    binds: bool
    figures: dict[str, Any] = field(default_factory=dict)
    change: str = ""
    finding: str | None = None  # the analyzer finding it stands on, when one


# the order in which a binding constraint is named: a structural limit before the queueing it causes; an engine
# skew first, since the KV cap or queue it shows on the hottest engine is capacity left idle on another
PRECEDENCE = ("dp-skew", "kv-capacity", "batch-ceiling", "prefill-interference", "prefix-collapse", "host-bound",
              "queueing")


def _big(v: float | None) -> float:
    return 1e18 if v is None else float(v)


def point_metrics(con: Any, run_id: str, slo: Slo) -> dict[str, Any]:
    """One point's figures (agent/read/sweep.py's `point_metrics`, the `sweep_points` named query's rows)."""
    return read_sweep.point_metrics(con, run_id, slo.ttft_s, slo.tpot_s, slo.e2e_s)


def find_knee(points: Sequence[dict[str, Any]], target: float = 0.9) -> int | None:
    """Index (into `points`) of the knee: the largest rate whose attainment, and every lower rate's, is >=
    `target`; None when the lowest rate misses it."""
    if not 0 < target <= 1:
        raise ValueError(f"target attainment must be in (0, 1], got {target!r}")
    knee = None
    for i in sorted(range(len(points)), key=lambda j: points[j]["rate_per_s"]):
        a = points[i].get("attainment")
        if a is None or a < target:
            break
        knee = i
    return knee


def evidence_point(points: Sequence[dict[str, Any]], target: float = 0.9) -> int | None:
    """Index of the point the binding constraint is read at: the first one under the target, else the top rate."""
    order = sorted(range(len(points)), key=lambda j: points[j]["rate_per_s"])
    for i in order:
        a = points[i].get("attainment")
        if a is None or a < target:
            return i
    return order[-1] if order else None


def _pick(d: dict, keys: Sequence[str]) -> dict:
    return {k: d.get(k) for k in keys}


def _explains(figs: dict, missed: dict | None, key: str, min_share: float) -> bool:
    """Adds `missed` and `key` to `figs`; False when requests missed an SLO and fewer than `min_share` of them
    carry the constraint's mark (it cannot be why the point missed); True otherwise."""
    if missed is None:
        return True
    figs["missed"], figs[key] = missed["missed"], missed[key]
    return not missed["missed"] or missed[key] / missed["missed"] >= min_share


def _kv(con, run_id: str, labels: dict, runtime: str, missed: dict | None = None,
        min_explained_share: float = 0.5) -> Constraint:
    f = kv_near_cap(con, run_id, labels=labels)
    p = preemption_recompute(con, run_id)
    if not f:
        return Constraint("kv-capacity", False)
    e = f[0].evidence
    figs = _pick(e, ("block_usage_max", "near_cap_share", "total_pages", "page_size", "preemptions",
                     "preempted_requests", "preempted_request_share", "recomputed_tokens", "seq_tokens_p95",
                     "max_seqs"))
    if p:
        figs["recomputed_share_of_prefill"] = p[0].evidence["recomputed_share_of_prefill"]
    peak = one(con, "SELECT max(n) AS peak FROM (SELECT sum(d) OVER (ORDER BY ts, d DESC ROWS UNBOUNDED PRECEDING)"
               " AS n FROM (SELECT arrival_ns AS ts, 1 AS d FROM requests WHERE run_id = $run UNION ALL "
               "SELECT coalesce(last_token_ns, arrival_ns), -1 FROM requests WHERE run_id = $run))", run_id)["peak"]
    per_seq = math.ceil((e["seq_tokens_p95"] or 1) / (e["page_size"] or 1))
    need = per_seq * (peak or 1)
    figs.update(peak_concurrency=peak, pages_for_peak=need)
    if runtime == "hf-cb":
        change = (f"give the KV pool room for the {peak} requests in flight at peak: ContinuousBatchingConfig("
                  f"num_blocks={need}) (now {e['total_pages']} pages of {e['page_size']} tokens; {per_seq} pages per "
                  f"p95 sequence of {e['seq_tokens_p95']} tokens), or cap admission with max_requests_per_batch="
                  f"{max(1, (e['total_pages'] or 0) // per_seq)} so admitted requests keep their pages")
    else:
        change = f[0].suggestion
    binds = _explains(figs, missed, "missed_preempted", min_explained_share)
    return Constraint("kv-capacity", binds, figs, change, "kv-near-cap")


def _ceiling(con, run_id: str, labels: dict, runtime: str, min_at_cap_share: float,
             min_queue_share: float, missed: dict | None = None, min_explained_share: float = 0.5) -> Constraint:
    key = "max_num_seqs" if runtime == "vllm" else "max_requests_per_batch"
    try:
        cap = int(float(labels.get(key) or 0))
    except ValueError:
        cap = 0
    if cap <= 0:
        return Constraint("batch-ceiling", False, {"cap": None})
    c = one(con, CEILING_SQL, run_id, cap=cap)
    q = one(con, QUEUE_SQL, run_id)
    figs = {"cap": cap, "max_running": c["max_running"], "at_cap_share": c["at_cap_share"],
            "running_mean": c["running_mean"], "steps": c["steps"], "queue_p50_s": q["queue_p50_s"],
            "queue_share_of_ttft": q["queue_share_of_ttft"]}
    binds = (c["max_running"] == cap and (c["at_cap_share"] or 0) >= min_at_cap_share
             and (q["queue_share_of_ttft"] or 0) >= min_queue_share)
    binds = _explains(figs, missed, "missed_mostly_queued", min_explained_share) and binds
    if runtime == "vllm":
        lim = vllm_limits(labels)
        change = f"--max-num-seqs {2 * cap} (now {cap})"
        if lim.max_num_batched_tokens is not None and lim.max_num_batched_tokens < 2 * cap:
            change += f" with --max-num-batched-tokens {2 * cap} (vLLM needs it >= --max-num-seqs)"
    else:
        change = f"ContinuousBatchingConfig(max_requests_per_batch={2 * cap}) (now {cap})"
    change += "; check KV headroom after: more running sequences hold more pages"
    return Constraint("batch-ceiling", binds, figs, change)


def _from_finding(name: str, findings: list, keys: Sequence[str]) -> Constraint:
    if not findings:
        return Constraint(name, False)
    f = findings[0]
    return Constraint(name, True, _pick(f.evidence, keys), f.suggestion, f.id)


def constraints_at(con: Any, run_id: str, labels: dict | None = None, slo: Slo | None = None, *,
                   min_at_cap_share: float = 0.5, min_queue_share: float = 0.5,
                   min_explained_share: float = 0.5, max_dp_imbalance: float = 0.25,
                   min_dp_stranded_share: float = 0.2, near_cap: float = T["near_cap"]) -> list[Constraint]:
    """Every candidate constraint of one run, in `PRECEDENCE` order (the first that binds is the binding one).
    `min_at_cap_share`: share of steps running at the batch cap to call it a ceiling; `min_queue_share`: share of
    the summed TTFT spent queued that shows requests waited for it (a ratio: the same on a fast or a slow host).
    The DP skew binds when KV usage or waiting requests across data-parallel engines reach `max_dp_imbalance`
    (max/mean - 1) and the hottest engine was at `near_cap` KV usage or queueing while another had headroom
    >= `min_dp_stranded_share` of the time (analyzers/dp.py).
    With `slo`, KV capacity binds only when >= `min_explained_share` of the requests that missed it were preempted,
    the batch ceiling only when as many spent >= half their TTFT queued (no misses: no such condition)."""
    labels = dict(labels or {})
    runtime = runtime_of(labels)
    missed = None if slo is None else one(con, MISSED_SQL, run_id, ttft=_big(slo.ttft_s), tpot=_big(slo.tpot_s),
                                          e2e=_big(slo.e2e_s))
    dp = dp_skew(con, run_id, runtime, near_cap, max_dp_imbalance, min_dp_stranded_share)
    out = {
        "dp-skew": Constraint("dp-skew", *dp),
        "kv-capacity": _kv(con, run_id, labels, runtime, missed, min_explained_share),
        "batch-ceiling": _ceiling(con, run_id, labels, runtime, min_at_cap_share, min_queue_share, missed,
                                  min_explained_share),
        "prefill-interference": _from_finding("prefill-interference", prefill_stalls_decode(con, run_id, labels=labels),
                                              ("stall_ratio", "cosched_steps", "decode_steps", "cosched_p50_ms",
                                               "pure_decode_p50_ms", "suggested_chunk_tokens")),
        "prefix-collapse": _from_finding("prefix-collapse", prefix_hit_collapse(con, run_id, labels=labels),
                                         ("hit_rate", "achievable_hit_rate", "prefill_tokens_saved")),
        "host-bound": _from_finding("host-bound", host_bound(con, run_id),
                                    ("busiest_thread_cores_p50", "cpu_wait_ratio", "host_ms_p50", "gpu_ms_p50")),
        "queueing": _from_finding("queueing", ttft_queueing(con, run_id, labels=labels),
                                  ("queue_p50_s", "queue_share_of_ttft", "ttft_p50_s", "prefill_utilization")),
    }
    return [out[n] for n in PRECEDENCE]


def binding(constraints: Sequence[Constraint]) -> Constraint | None:
    """The first constraint that binds (they come in `PRECEDENCE` order), or None."""
    return next((c for c in constraints if c.binds), None)


def explain_point(con: Any, run_id: str, slo: Slo | None = None) -> list[dict[str, Any]]:
    """`constraints_at` over a point with its own labels, as plain dicts (what a reader's `analyze` returns)."""
    from dataclasses import asdict

    from .runinfo import read_run_info

    return [asdict(c) for c in constraints_at(con, run_id, read_run_info(con, run_id), slo)]
