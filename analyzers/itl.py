"""Which step made an inter-token gap long: ITL tail attribution and what a chunk size would have saved.

Every gap between two token events of a request (the `itl` view's samples: a gap bringing k tokens
gives k samples of gap/k) is tied to the engine steps that ended inside it (steps of the run's
lowest rank; a token is handed out after the step that computed it ends, on one host's monotonic
clock, so the frontend's token times of vLLM join the workers' steps too). Each gap gets one cause,
the first that holds:

- `preemption`: the request was preempted inside the gap (it waited, then was recomputed);
- `queueing`: more steps ended in the gap than it brought tokens: the request sat out steps (but a token
  stamped after the next step already ended, as vLLM's frontend may, gives one step too many and then a gap
  of none: that pair is charged to its steps);
- `prefill`: its step computed >= `long_prefill_tokens` prompt tokens next to the decodes;
- `host`: the gap is >= `host_stall_ratio` x its step's compute time (GPU time when CUDA-timed,
  else the forward's host time): host work between forwards, or a CPU-starved engine;
- `other` (larger decode batches, longer contexts, noise) and `unattributed` (no step ended in it).

The tail is every sample >= the p99 ITL; a cause's share is its part of the tail's excess over the
median ITL, sum(itl - p50) over its tail samples / the same over all tail samples. A TPOT-SLO
violation is explained by a cause when removing that cause's excess from the request's gaps (each
such gap brought down to the median ITL) brings its TPOT within the SLO.

Prefill cost is fit from the run's own steps: `ms = pure_decode_p50 + m * prefill_tokens`, with m
the median of (ms - pure_decode_p50) / prefill_tokens over steps that decode and prefill at least
`fit_min_prefill_tokens` tokens (robust to the odd slow step; least squares is reported beside it).
A per-step token budget B caps a step's prefill at c = max(B - decode_tokens, 1) tokens: a gap
whose step prefilled p > c tokens becomes ceil(p / c) gaps, one per chunk of q tokens, each
`o + pure_decode_p50 + m * q + r * q / p`, where r = step_ms - pure_decode_p50 - m * p is that step's
residual off the fit (attention over the prompt's own context, noise), spread over its chunks like its
tokens, and o is what the gap held besides its step (gap - step_ms: admission, scheduling) for the first
chunk, and for the others what a pure decode gap holds besides its step (the run's median): the gap's
one-off host work happens once, not once per chunk. The predicted p99 ITL is the p99 of the samples so rewritten (the extra
chunk gaps included), the saving the measured p99 minus it.
"""

from __future__ import annotations

from typing import Any

from phasescope.agent.read.itl import LADDER_N_SQL, LADDER_TOP_SQL, attribution, p99_by_budget
from phasescope.agent.read.queries import sql_text
from phasescope.agent.read.thresholds import T

from .findings import Finding, ref
from .constraints import vllm_limits
from .predictions import KNOWN_ERROR
from .prefill import (STALL_SQL, chunk_action, chunk_plan, chunk_suggestion, chunked_prefill, prefill_trade,
                      trade_text)
from .runinfo import runtime_of
from .sql import RUN_STEPS, one

# the prefill cost fit from the run's steps (intercept: the median pure decode step)
FIT_SQL = f"""WITH st AS ({RUN_STEPS}),
    base AS (SELECT quantile_cont(ms, 0.5) AS b FROM st WHERE prefill_tokens = 0 AND decode_tokens > 0)
    SELECT (SELECT b FROM base) AS pure_decode_p50_ms,
           quantile_cont((ms - (SELECT b FROM base)) / prefill_tokens, 0.5)
               FILTER (WHERE prefill_tokens >= $fit_min) AS ms_per_prefill_token,
           count(*) FILTER (WHERE prefill_tokens >= $fit_min) AS fit_steps,
           regr_slope(ms, prefill_tokens) AS ols_ms_per_prefill_token,
           regr_intercept(ms, prefill_tokens) AS ols_intercept_ms, regr_r2(ms, prefill_tokens) AS ols_r2
    FROM st WHERE decode_tokens > 0"""

# the p99 ITL had each step's prefill been capped at max($budget - decode_tokens, 1) tokens per step, for every
# budget of the ladder at once, over the gaps computed once (agent/read/itl.py: exact, nothing expanded)
PREDICT_SQL = LADDER_N_SQL + ";\n" + LADDER_TOP_SQL


def prefill_fit(con: Any, run_id: str, fit_min_prefill_tokens: int = int(T["fit_min_prefill_tokens"])) -> dict:
    """ms per prefill token of the run's decode-carrying steps (median ratio over the pure-decode median;
    least squares beside it), with the SQL."""
    e = one(con, FIT_SQL, run_id, fit_min=fit_min_prefill_tokens)
    e["query"] = FIT_SQL.replace("$fit_min", str(fit_min_prefill_tokens))
    return e


def predict_p99(con: Any, run_id: str, budget_tokens: int, ms_per_prefill_token: float, pure_decode_ms: float,
                *, long_prefill_tokens: int = int(T["long_prefill_tokens"]),
                host_stall_ratio: float = T["host_stall_ratio"], quantile: float = 0.99) -> float | None:
    """Predicted p99 ITL (ms) of this run had every step held at most `budget_tokens` tokens (prefill chunks
    of max(budget - decode tokens, 1)), at `ms_per_prefill_token`; see the module doc."""
    return predict_p99_ladder(con, run_id, [budget_tokens], ms_per_prefill_token, pure_decode_ms,
                              long_prefill_tokens=long_prefill_tokens, host_stall_ratio=host_stall_ratio,
                              quantile=quantile)[int(budget_tokens)]


def predict_p99_ladder(con: Any, run_id: str, budgets: list[int], ms_per_prefill_token: float,
                       pure_decode_ms: float, *, long_prefill_tokens: int = int(T["long_prefill_tokens"]),
                       host_stall_ratio: float = T["host_stall_ratio"],
                       quantile: float = 0.99) -> dict[int, float | None]:
    """`predict_p99` of every budget, from one pass over the gaps (not one per candidate)."""
    return p99_by_budget(con, run_id, budgets, ms_per_prefill_token, pure_decode_ms,
                         long_prefill_tokens=long_prefill_tokens, host_stall_ratio=host_stall_ratio,
                         quantile=quantile)


LADDER = (64, 128, 256, 512, 1024, 2048)  # token budgets the evidence predicts p99 ITL for


def itl_spikes(con, run_id: str, *, long_prefill_tokens: int = int(T["long_prefill_tokens"]),
               host_stall_ratio: float = T["host_stall_ratio"], itl_spike_ratio: float = T["itl_spike_ratio"],
               min_cause_share: float = T["min_cause_share"], tpot_slo_s: float = T["tpot_slo_s"],
               fit_min_prefill_tokens: int = int(T["fit_min_prefill_tokens"]), min_itl_samples: int = 500,
               target_ratio: float = 2.0, min_chunk_tokens: int = 64, labels: dict | None = None,
               **_: object) -> list[Finding]:
    """`itl-spikes-<cause>` when the p99 ITL is >= `itl_spike_ratio` x the median and one cause holds
    >= `min_cause_share` of the tail's excess (causes: prefill, preemption, queueing, host); silent below
    `min_itl_samples` tokens (a p99 of fewer than 500 rests on fewer than 5 samples)."""
    # the causes are read only when the p99 is a spike (`min_spike_ratio`): a run without spikes skips the tail and
    # TPOT passes over the gaps, and is silent as before
    e = attribution(con, run_id, long_prefill_tokens, host_stall_ratio, tpot_slo_s, min_spike_ratio=itl_spike_ratio)
    if (e["itl_samples"] or 0) < min_itl_samples or not e["itl_p50_ms"]:
        return []
    ratio = e["itl_p99_ms"] / e["itl_p50_ms"]
    if ratio < itl_spike_ratio:
        return []
    cause = max(("prefill", "preemption", "queueing", "host"), key=lambda c: e[f"tail_{c}_share"])
    share = e[f"tail_{cause}_share"]
    if share < min_cause_share:
        return []
    e["itl_spike_ratio"] = ratio
    e["cause"] = cause
    th = {"long_prefill_tokens": long_prefill_tokens, "host_stall_ratio": host_stall_ratio,
          "itl_spike_ratio": itl_spike_ratio, "min_cause_share": min_cause_share, "tpot_slo_s": tpot_slo_s,
          "fit_min_prefill_tokens": fit_min_prefill_tokens, "min_itl_samples": min_itl_samples,
          "target_ratio": target_ratio, "min_chunk_tokens": min_chunk_tokens}
    n, tail = e["tail_samples"], e[f"tail_{cause}_samples"]
    viol, expl = e["tpot_violations"], e[f"tpot_violations_explained_{cause}"]
    head = (f"p99 ITL {e['itl_p99_ms']:.1f} ms is {ratio:.1f}x the {e['itl_p50_ms']:.1f} ms median; {tail} of the "
            f"{n} tail samples, {share:.0%} of the tail's time over the median, ")
    slo = (f" {expl} of {viol} requests over the {tpot_slo_s * 1e3:.0f} ms TPOT SLO would meet it without them."
           if viol else "")
    severity = "critical" if viol and expl else "warning"
    summary = (f"p99 ITL {e['itl_p99_ms']:.1f} ms is {ratio:.1f}x the {e['itl_p50_ms']:.1f} ms median; "
               f"{share:.0%} of the tail's excess " + SHORT_WHY[cause] + ".")
    if cause == "prefill":
        return [_prefill_finding(con, run_id, e, th, head, slo, severity, labels, summary)]
    texts = {
        "preemption": ("ITL spikes come from preemptions",
                       "span a preemption and the recompute that followed.",
                       "Admit fewer concurrent sequences than the KV cache holds at peak (vLLM --max-num-seqs) and "
                       "shed load when KV usage nears its cap, so running requests are not preempted and "
                       "recomputed mid-stream (see preemption-recompute).", "Overload and preemption"),
        "queueing": ("ITL spikes come from requests sitting out steps",
                     "span steps that ran without them: the request was ready but not scheduled.",
                     "Every running sequence should decode in every step: cap concurrent sequences (vLLM "
                     "--max-num-seqs) at what one step holds next to the prefill chunks, and keep the scheduler "
                     "serving running requests before admitting new ones.", "Queueing"),
        "host": ("ITL spikes are host stalls, not compute",
                 f"took >= {host_stall_ratio:g}x their step's compute time: the host, not the model, made them "
                 "long.", "", "Host"),  # its suggestion and action name only the levers that are off: _host_texts
    }
    title, why, suggestion, section = texts[cause]
    suggestion, action = _host_texts(labels or {}) if cause == "host" else (suggestion, SHORT_ACTION[cause])
    return [Finding(id=f"itl-spikes-{cause}", title=title, severity=severity, evidence=e, suggestion=suggestion,
                    expected_effect=head + why + slo, reference=ref(section), run_id=run_id, thresholds=th,
                    summary=summary, action=action)]


def _host_texts(labels: dict) -> tuple[str, str]:
    """(suggestion, action) of itl-spikes-host, without the levers a vLLM run's labels say are on already."""
    vllm = runtime_of(labels) == "vllm"
    async_on = vllm and str(labels.get("async_scheduling")) == "True"
    graphs_on = vllm and str(labels.get("enforce_eager")) == "False"
    python = ("Python work per step (sampling, detokenization" + ("; async scheduling is on and overlaps one step "
              "of it" if async_on else "; vLLM --async-scheduling overlaps it with the GPU" if vllm else "") + ")")
    launch = "" if graphs_on else ", and launch overhead (CUDA graphs)"
    levers = ["own cores"] + ([] if async_on else ["async scheduling"]) + ([] if graphs_on else ["CUDA graphs"])
    return ("Find what holds the engine's host thread between forwards: CPU starvation (give the server dedicated "
            f"cores; see host-bound), {python}, garbage-collection pauses{launch}.",
            f"Free the engine's host thread ({', '.join(levers)}): the spikes go with the stalls.")


SHORT_WHY = {"prefill": "ran beside a long prefill", "preemption": "spans preemptions and their recompute",
             "queueing": "is requests sitting out steps", "host": "is host stalls, not compute"}
SHORT_ACTION = {
    "preemption": "Admit fewer concurrent sequences than the KV cache holds at peak and shed load near its cap: no "
                  "mid-stream recompute.",
    "queueing": "Cap concurrent sequences at what one step holds (vLLM --max-num-seqs): every running request "
                "decodes every step.",
}


def _prefill_finding(con, run_id: str, e: dict, th: dict, head: str, slo: str, severity: str,
                     labels: dict | None, summary: str = "") -> Finding:
    long = th["long_prefill_tokens"]
    fit = prefill_fit(con, run_id, th["fit_min_prefill_tokens"])
    stall = one(con, STALL_SQL, run_id, long=long)
    base = fit["pure_decode_p50_ms"] or stall["pure_decode_p50_ms"] or 0.0
    stall["pure_decode_p50_ms"] = stall["pure_decode_p50_ms"] or base
    _, page, chunk = chunk_plan(con, run_id, stall, long, th["target_ratio"], th["min_chunk_tokens"])
    slope = max(fit["ms_per_prefill_token"] or 0.0, 0.0)
    chunked, budget = chunked_prefill(labels)
    kw = {"long_prefill_tokens": long, "host_stall_ratio": th["host_stall_ratio"]}
    rungs = [b for b in LADDER if b < (stall["max_prefill_tokens_per_step"] or 0)]
    by_budget = predict_p99_ladder(con, run_id, rungs + [chunk], slope, base, **kw)
    predicted = by_budget[chunk]
    ladder = {b: by_budget[b] for b in rungs}
    e.update({k: v for k, v in fit.items() if k != "query"})
    e.update({"page_size": page, "suggested_chunk_tokens": chunk, "budget_tokens": budget,
              "chunked_prefill": chunked, "max_prefill_tokens_per_step": stall["max_prefill_tokens_per_step"],
              "predicted_itl_p99_ms": predicted,
              "predicted_saving_ms": e["itl_p99_ms"] - predicted if predicted is not None else None,
              "predicted_itl_p99_ms_by_budget": ladder})
    e["query"] = e["query"] + ";\n" + fit["query"] + ";\n" + sql_text(PREDICT_SQL, {
        "quantile": 0.99, "budgets": str(sorted(set(rungs + [chunk]))), "bmin": min(rungs + [chunk]),
        "slope": slope, "base_ms": base, "top": "<the most samples above any budget's p99>",
        "r_lo": "<ranks from the top>", "r_hi": "<ranks from the top>"})
    trade = prefill_trade(base, slope, chunk, min(budget or stall["max_prefill_tokens_per_step"] or 0,
                                                   stall["max_prefill_tokens_per_step"] or 0) or budget)
    e.update(trade or {})
    effect = (head + f"ran next to a prefill of >= {long} tokens (the largest {e['tail_max_prefill_tokens']})." + slo
              + f" Fit from {fit['fit_steps']} steps: {slope:.3f} ms per prefill token over a "
              f"{base:.1f} ms pure decode step; with at most {chunk} tokens per step the p99 ITL would have been "
              f"~{predicted:.1f} ms ({e['predicted_saving_ms']:.1f} ms saved). Known error of this prediction: "
              + KNOWN_ERROR["itl_p99_ms"] + "."
              + (f" The other side, from the same fit: {trade_text(trade)} while prompts are prefilled." if trade
                 else ""))
    return Finding(
        id="itl-spikes-prefill",
        title="ITL spikes come from prefills sharing the step",
        severity=severity, evidence=e,
        suggestion=chunk_suggestion(chunk, chunked, budget, runtime_of(labels),
                                    vllm_limits(labels) if runtime_of(labels) == "vllm" else None),
        expected_effect=effect, reference=ref("Prefill"), run_id=run_id, thresholds=th, summary=summary,
        action=chunk_action(chunk, chunked, budget, runtime_of(labels),
                            vllm_limits(labels) if runtime_of(labels) == "vllm" else None)
        + (f": p99 ITL ~{predicted:.0f} ms from {e['itl_p99_ms']:.0f} (predicted)" if predicted is not None else "")
        + (f", prefill throughput -{trade['prefill_rate_loss']:.0%}." if trade else "."))
