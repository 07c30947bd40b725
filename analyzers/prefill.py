"""Long prefills stalling decode: decode steps that share a forward with a long prefill vs pure decode steps."""

from __future__ import annotations

from phasescope.agent.read.thresholds import T
from .findings import Finding, ref
from .constraints import VllmLimits, vllm_limits
from .runinfo import budget_knob, runtime_of
from .sql import RUN_STEPS, one, page_size, step_source

# (the co-scheduled p50 and p95 as one list quantile: one copy and selection of those steps, not two; the same
# order statistics and interpolation, so the same numbers: 10M steps ~0.6 -> ~0.35 s)
STALL_SQL = f"""WITH st AS ({RUN_STEPS}),
    a AS (SELECT count(*) FILTER (WHERE phase = 'decode') AS pure_decode_steps,
                 quantile_cont(ms, 0.5) FILTER (WHERE phase = 'decode') AS pure_decode_p50_ms,
                 count(*) FILTER (WHERE decode_tokens > 0) AS decode_steps,
                 count(*) FILTER (WHERE decode_tokens > 0 AND prefill_tokens >= $long) AS cosched_steps,
                 quantile_cont(ms, [0.5, 0.95]) FILTER (WHERE decode_tokens > 0 AND prefill_tokens >= $long) AS cq,
                 max(prefill_tokens) AS max_prefill_tokens_per_step,
                 sum(decode_tokens) FILTER (WHERE decode_tokens > 0 AND prefill_tokens >= $long) AS stalled_decode_tokens
          FROM st)
    SELECT pure_decode_steps, pure_decode_p50_ms, decode_steps, cosched_steps, cq[1] AS cosched_p50_ms,
           cq[2] AS cosched_p95_ms, max_prefill_tokens_per_step, stalled_decode_tokens
    FROM a"""

# extra step time per prefill token of the co-scheduled steps: median of (step - pure decode p50) / prefill tokens
EXTRA_SQL = f"""WITH st AS ({RUN_STEPS})
    SELECT quantile_cont((ms - $decode_ms) / prefill_tokens, 0.5) AS ms_per_prefill_token
    FROM st WHERE decode_tokens > 0 AND prefill_tokens >= $long"""

TPOT_SQL = "SELECT quantile_cont(tpot_s, 0.5) AS tpot_p50_s, quantile_cont(tpot_s, 0.95) AS tpot_p95_s FROM requests WHERE run_id = $run"


def suggest_chunk(pure_decode_ms: float, ms_per_token: float | None, target_ratio: float, page: int,
                  max_prefill: int, min_chunk: int = 64) -> int:
    """Largest chunk (a multiple of the page size, at least `min_chunk` tokens and one page) whose extra
    step time keeps a co-scheduled decode step within `target_ratio` x a pure decode step."""
    if not ms_per_token or ms_per_token <= 0:
        return max(page, min(512, max_prefill // 2 // page * page))
    chunk = int((target_ratio - 1.0) * pure_decode_ms / ms_per_token)
    chunk = max(chunk, min_chunk) // page * page
    return max(page, min(chunk, max(page, (max_prefill - 1) // page * page)))


def prefill_trade(pure_decode_ms: float, ms_per_token: float, chunk: int, budget: int | None) -> dict | None:
    """The other side of a smaller per-step budget, from the run's own step-time fit (a step with c prefill
    tokens takes pure_decode_ms + ms_per_token x c): prefill tokens per second of step time at the budget now
    (`budget`: the run's, else its largest prefill step) and at `chunk`, and the share lost. None without a fit
    or when `chunk` is no smaller than the budget."""
    if not ms_per_token or ms_per_token <= 0 or not budget or chunk >= budget or pure_decode_ms is None:
        return None
    rate = lambda c: c / ((pure_decode_ms + ms_per_token * c) / 1e3)  # noqa: E731 - tokens per second
    now, then = rate(budget), rate(chunk)
    return {"prefill_tokens_per_s_now": now, "prefill_tokens_per_s_at_chunk": then,
            "prefill_rate_loss": 1 - then / now, "budget_now_tokens": budget}


def trade_text(t: dict | None) -> str:
    """The trade in words ("" without one): what the smaller budget costs prefill."""
    if t is None:
        return ""
    return (f"prefill throughput {t['prefill_tokens_per_s_now']:,.0f} -> {t['prefill_tokens_per_s_at_chunk']:,.0f} "
            f"tokens/s (-{t['prefill_rate_loss']:.0%})")


def _limits(labels: dict | None) -> VllmLimits | None:
    return vllm_limits(labels) if runtime_of(labels) == "vllm" else None


def chunked_prefill(labels: dict | None) -> tuple[bool | None, int | None]:
    """(chunked prefill on?, per-step token budget) from a run's labels; None where the labels do not say.

    vLLM labels `enable_chunked_prefill` and `max_num_batched_tokens`; HF continuous batching (the demo's
    `runtime` cb) always splits prompts to its `max_batch_tokens` per step."""
    labels = labels or {}
    budget = labels.get("max_num_batched_tokens") or labels.get("max_batch_tokens")
    try:
        budget_i = int(float(budget)) if budget is not None else None
    except ValueError:
        budget_i = None
    flag = labels.get("enable_chunked_prefill")
    if flag is not None:
        return flag.strip().lower() in ("1", "true", "yes", "on"), budget_i
    if runtime_of(labels) == "hf-cb" or "max_batch_tokens" in labels:
        return True, budget_i
    if runtime_of(labels) == "hf-generate":
        return False, None
    return None, budget_i


def chunk_plan(con, run_id: str, stall: dict, long_prefill_tokens: int, target_ratio: float,
               min_chunk_tokens: int) -> tuple[float, int, int]:
    """(ms per prefill token of the co-scheduled steps (>= 0), page size, suggested chunk in tokens) for
    `stall`, the row of STALL_SQL: the one chunk every finding about long prefills names."""
    slope = one(con, EXTRA_SQL, run_id, decode_ms=stall["pure_decode_p50_ms"],
                long=long_prefill_tokens)["ms_per_prefill_token"]
    page = page_size(con, run_id) or 16
    chunk = suggest_chunk(stall["pure_decode_p50_ms"], slope, target_ratio, page,
                          stall["max_prefill_tokens_per_step"], min_chunk_tokens)
    return max(slope or 0.0, 0.0), page, chunk


def _time_share(e: dict) -> float:
    """The co-scheduled decode steps' share of decode time, from STALL_SQL's counts and median step times."""
    stalled = e["cosched_steps"] * e["cosched_p50_ms"]
    return stalled / (stalled + e["pure_decode_steps"] * e["pure_decode_p50_ms"])


def prefill_stalls_decode(con, run_id: str, *, long_prefill_tokens: int = int(T["long_prefill_tokens"]),
                          stall_ratio: float = 3.0, critical_ratio: float = 10.0, min_steps: int = 5,
                          min_cosched_share: float = 0.01, min_time_share: float = 0.05, target_ratio: float = 2.0,
                          min_chunk_tokens: int = 64, labels: dict | None = None, **_: object) -> list[Finding]:
    """Fires when decode steps co-scheduled with prefills of >= `long_prefill_tokens` tokens take
    >= `stall_ratio` x the median pure decode step (step times in ms, medians) and are at least
    `min_cosched_share` of the decode steps, or take at least `min_time_share` of the decode time (steps x median
    step time). Below 1% of the steps no percentile of the step time up to the p99 moves, so the tail the
    suggestion would cut is not there (one H100 run: 76 of 20,545 decode steps, the first of each block, with a
    TPOT p95 only 1.1x its median, warned and advised a 50x smaller token budget); rarer stalls long enough to
    hold 5% of the decode time still cost every decoder that much TPOT on average (the H100 matrix's
    interference run: 7 of 768 decode steps beside 8000-token prefills, ~15x a pure decode step, 12% of the
    decode time; its block starts of a healthy run: 1.8%)."""
    e = one(con, STALL_SQL, run_id, long=long_prefill_tokens)
    if (e["pure_decode_steps"] or 0) < min_steps or (e["cosched_steps"] or 0) < min_steps:
        return []
    if e["cosched_steps"] < min_cosched_share * e["decode_steps"] and _time_share(e) < min_time_share:
        return []
    ratio = e["cosched_p50_ms"] / e["pure_decode_p50_ms"]
    if ratio < stall_ratio:
        return []
    slope, page, chunk = chunk_plan(con, run_id, e, long_prefill_tokens, target_ratio, min_chunk_tokens)
    expected_ms = e["pure_decode_p50_ms"] + slope * chunk
    tpot = one(con, TPOT_SQL, run_id)
    chunked, budget = chunked_prefill(labels)
    trade = prefill_trade(e["pure_decode_p50_ms"], slope, chunk,
                          min(budget or e["max_prefill_tokens_per_step"], e["max_prefill_tokens_per_step"] or 0)
                          or budget)
    evidence = {
        **e, "stall_ratio": ratio, "cosched_share": e["cosched_steps"] / e["decode_steps"],
        # the decode time the stalled steps took (medians x counts): what TPOT feels, the severity's weight
        "affected_share": _time_share(e), "affected_of": "decode time (steps x median step time)",
        "step_ms_source": step_source(con, run_id),
        "ms_per_prefill_token": slope, "page_size": page,
        "suggested_chunk_tokens": chunk, **tpot, **(trade or {}),
        "query": (STALL_SQL + ";\n" + EXTRA_SQL.replace("$decode_ms", "<pure_decode_p50_ms>")).replace(
            "$long", str(long_prefill_tokens)),
    }
    return [Finding(
        summary=(f"{e['cosched_steps']} of {e['decode_steps']} decode steps ran beside a prefill of >= "
                 f"{long_prefill_tokens} tokens at a median {e['cosched_p50_ms']:.1f} ms, {ratio:.1f}x a pure "
                 f"decode step ({e['pure_decode_p50_ms']:.1f} ms)."),
        action=(f"{chunk_action(chunk, chunked, budget, runtime_of(labels), _limits(labels))}: those steps ~{expected_ms:.1f} ms"
                + (f", prefill throughput -{trade['prefill_rate_loss']:.0%}." if trade else ".")),
        id="prefill-stalls-decode",
        title="Long prefills stall decode steps",
        severity="critical" if ratio >= critical_ratio else "warning",
        evidence=evidence,
        suggestion=chunk_suggestion(chunk, *chunked_prefill(labels), runtime_of(labels), _limits(labels)),
        expected_effect=(f"{e['cosched_steps']} of {e['decode_steps']} decode steps ran next to a prefill of "
                         f">= {long_prefill_tokens} tokens at a median {e['cosched_p50_ms']:.1f} ms, {ratio:.1f}x the "
                         f"{e['pure_decode_p50_ms']:.1f} ms of a pure decode step; at {slope:.3f} ms per prefill "
                         f"token a {chunk}-token chunk keeps them near {expected_ms:.1f} ms "
                         f"(~{expected_ms / e['pure_decode_p50_ms']:.1f}x), cutting the TPOT tail "
                         f"(p95 now {(tpot['tpot_p95_s'] or 0) * 1e3:.1f} ms). Step times: "
                         f"{evidence['step_ms_source']}."
                         + (f" The other side, from the same fit: {trade_text(trade)} while prompts are prefilled."
                            if trade else "")),
        reference=ref("Prefill"),
        run_id=run_id,
        thresholds={"long_prefill_tokens": long_prefill_tokens, "stall_ratio": stall_ratio,
                    "critical_ratio": critical_ratio, "min_steps": min_steps, "min_cosched_share": min_cosched_share,
                    "min_time_share": min_time_share,
                    "target_ratio": target_ratio,
                    "min_chunk_tokens": min_chunk_tokens},
    )]


def vllm_budget_flags(chunk: int, limits: VllmLimits | None) -> str:
    """vLLM's flags for a per-step budget of `chunk` tokens that vLLM accepts: it refuses
    --max-num-batched-tokens below --max-num-seqs, so a budget under the run's max_num_seqs lowers that too."""
    flags = f"--max-num-batched-tokens {chunk}"
    if limits is not None and limits.max_num_seqs and chunk < limits.max_num_seqs:
        flags += f" --max-num-seqs {chunk}; vLLM refuses a budget below max-num-seqs"
    return flags


def chunk_action(chunk: int, chunked: bool | None, budget: int | None, runtime: str = "",
                 limits: VllmLimits | None = None) -> str:
    """`chunk_suggestion` in a few words (the finding's `action`, before its gain); on vLLM the flags it accepts
    (`limits`: a budget below --max-num-seqs lowers that too)."""
    if runtime == "hf-generate":
        return f"Serve with continuous batching at ~{chunk} tokens per step"
    if chunked and budget is not None and budget <= chunk:
        return "Separate prefill from decode (disaggregation) or cap the prefills per step"
    if chunked:
        now = f" from {budget}" if budget is not None else ""
        return f"Lower the per-step token budget{now} to ~{chunk} ({_short_knob(runtime, chunk, limits)})"
    return f"Enable chunked prefill at ~{chunk} tokens per step ({_short_knob(runtime, chunk, limits)})"


def _short_knob(runtime: str, chunk: int, limits: VllmLimits | None = None) -> str:
    """The per-step budget's setting in the runtime's own words, short (`budget_knob` names the runtime too)."""
    return {"vllm": vllm_budget_flags(chunk, limits).split(";")[0], "hf-cb": f"max_batch_tokens={chunk}"}.get(
        runtime, budget_knob(runtime, chunk))


def chunk_suggestion(chunk: int, chunked: bool | None, budget: int | None, runtime: str = "",
                     limits: VllmLimits | None = None) -> str:
    """What to change, given whether the run already chunks its prefills (its labels), its budget, and its runtime
    (`runinfo.runtime_of`: each names only its own knobs; static-batch HF generate has no per-step budget);
    `limits`: a vLLM run's own (`constraints.vllm_limits`), so the flags are ones it accepts."""
    tail = (" Cost: slightly lower prefill efficiency. If TTFT is the tighter SLO, consider prefill/decode "
            "disaggregation instead.")
    if runtime == "hf-generate":
        return (f"HF generate runs each static batch's whole prompts in one forward and cannot chunk them: serve "
                f"with continuous batching (model.generate_batch / init_continuous_batching with "
                f"max_batch_tokens={chunk}, or vLLM with --max-num-batched-tokens {chunk}), which splits long "
                "prompts between decode steps; or batch long prompts apart from short ones." + tail)
    if chunked and budget is not None and budget <= chunk:
        return (f"Chunked prefill is already on with a per-step budget of {budget} tokens, at or below the "
                f"~{chunk}-token chunk that would keep decode steps within target: the stall is not the chunk "
                "size. Separate prefill and decode (disaggregation), or cap how many prefills share a step.")
    if chunked:
        now = f" (now {budget})" if budget is not None else ""
        knob = f"vLLM {vllm_budget_flags(chunk, limits)}" if runtime == "vllm" else budget_knob(runtime, chunk)
        return (f"Chunked prefill is on, but its per-step token budget{now} lets long prompt chunks stall decode: "
                f"lower it to ~{chunk} tokens ({knob})." + tail)
    how = {"vllm": f"vLLM: --enable-chunked-prefill {vllm_budget_flags(chunk, limits)}",
           "hf-cb": f"HF continuous batching: max_batch_tokens={chunk}"}.get(
        runtime, f"vLLM: --enable-chunked-prefill --max-num-batched-tokens {chunk}; HF continuous batching: "
                 f"max_batch_tokens={chunk}")
    return (f"Enable chunked prefill with a chunk of ~{chunk} tokens ({how}) so long prompts are split between "
            "decode steps." + tail)
