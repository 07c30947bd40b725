"""The Prefix cache page: hit rate over the run, why lookups missed, and how long pages stayed cached."""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd
import streamlit as st

from phasescope.dashboard.charts import label, line, time_x
from phasescope.dashboard.common import snapshot, as_of, df, explain, pct


def page_prefix(reader: Any, run: str, win: dict[str, Any]) -> None:
    snap = snapshot(reader, [("prefix_summary", {"run_id": run}), ("prefix_timeline", {
        "run_id": run, "bucket_s": win["bucket_s"], "since_s": win["since_s"], "until_s": win["until_s"]}),
        ("prefix_miss_causes", {"run_id": run}), ("kv_residency", {"run_id": run})])
    px, timeline, causes, residency = snap["rows"]
    c = st.columns(4)
    c[0].metric("Hit rate", pct(px["hit_rate"]))
    c[1].metric("Hit tokens", f"{px['hit_tokens'] or 0:,}", f"of {px['queried_tokens'] or 0:,} queried",
                delta_color="off", delta_arrow="off")
    c[2].metric("Recomputed tokens", f"{px['recomputed_tokens'] or 0}", f"{px['preemptions']} preemptions",
                delta_color="off", delta_arrow="off")
    c[3].metric("Evicted pages", f"{px['evicted_blocks'] or 0}")
    as_of(snap)
    tl = df(timeline)
    if tl.empty:
        st.info("No prefix-cache counters in this run.")
    else:
        prefix_timeline_view(tl, win["bucket_s"])
    prefix_miss_view(causes)
    residency_view(residency)


def prefix_timeline_view(tl: pd.DataFrame, bucket_s: float) -> None:
    st.subheader("Hit rate over time")
    st.altair_chart(line(tl, "hit_rate", "Hit rate (%)", bucket_s, y_format="%", point=True,
                         tooltip=["queried_tokens", "hit_tokens"]), width="stretch")
    explain("Δhit / Δqueried tokens per interval. Good: steady and close to the share of prompts that is shared "
            "(system prompt); a collapse means evictions or prompts that put the variable part first.")
    st.subheader("Evictions and recomputation")
    cols = st.columns(2)  # two units: one chart each
    for col, key, title in ((cols[0], "evicted_blocks", "Pages evicted"), (cols[1], "recomputed_tokens",
                                                                           "Tokens recomputed")):
        col.altair_chart(alt.Chart(tl).mark_bar().encode(
            x=time_x(), y=alt.Y(f"{key}:Q", title=f"{title} per interval"),
            tooltip=[alt.Tooltip("t_s:Q", title=label("t_s"), format=".1f"),
                     alt.Tooltip(f"{key}:Q", title=title, format=",")]), width="stretch")
    explain("Recomputation after preemption is counted apart, never as a hit. Good: near zero; steady evictions "
            "mean the cache is too small for the working set of prefixes.")


MISS_CAUSE_DOC = {
    "no-shared-prefix": "starts unlike any earlier prompt", "sub-page": "shared, but not a whole cacheable page",
    "evicted": "shared pages evicted before reuse", "in-flight": "shared pages still being computed",
    "readmission": "re-prefill after preemption (apart)", "cache-disabled": "prefix cache off",
}


def prefix_miss_view(c: dict[str, Any]) -> None:
    st.subheader("Why prefix lookups miss")
    if not (c["lookups"] or c["readmissions"] or c["disabled_lookups"]):
        st.caption("No per-lookup records in this run (the adapter predates them or the runtime has none).")
        return
    rows = df([{"cause": k, "tokens": c[k], "what": MISS_CAUSE_DOC[k]} for k in MISS_CAUSE_DOC])
    st.altair_chart(alt.Chart(rows).mark_bar().encode(
        x=alt.X("tokens:Q", title="missed prompt tokens"), y=alt.Y("cause:N", sort=list(MISS_CAUSE_DOC), title=None),
        tooltip=["cause", "tokens", "what"]), width="stretch")
    cols = st.columns(3)
    cols[0].metric("Missed tokens, per lookup", f"{c['missed_tokens']:,}", f"of {c['queried_tokens']:,} queried "
                   "(first admissions)", delta_color="off", delta_arrow="off")
    cols[1].metric("Eviction-to-reuse gap p50", "–" if c["evict_gap_ms_p50"] is None else f"{c['evict_gap_ms_p50']:.0f} ms")
    cols[2].metric("Page hashes dropped (table cap)", f"{c['table_dropped_pages'] or 0}")
    explain("Every missed token has one cause; they add up to queried − hit of the per-lookup records (first "
            "admissions only: re-admissions after preemption are apart), so these totals differ from the "
            "runtime's counters above, which count every lookup. Good: misses are mostly no-shared-prefix (truly "
            "unique text); sub-page, evicted and in-flight tokens are avoidable.")


def residency_view(r: dict[str, Any]) -> None:
    st.subheader("KV residency")
    if not r["page_events"]:
        st.caption("No sampled page events in this run.")
        return
    cols = st.columns(4)
    fmt = lambda v: "–" if v is None else f"{v:.0f} ms"  # noqa: E731
    cols[0].metric("Page lifetime p50", fmt(r["lifetime_ms_p50"]), f"p90 {fmt(r['lifetime_ms_p90'])}",
                   delta_color="off", delta_arrow="off")
    cols[1].metric("Idle before eviction p50", fmt(r["idle_before_evict_ms_p50"]))
    cols[2].metric("Reuse gap p50", fmt(r["reuse_gap_ms_p50"]), f"p90 {fmt(r['reuse_gap_ms_p90'])}",
                   delta_color="off", delta_arrow="off")
    cols[3].metric("Extra pages needed", f"{r['extra_pages_needed']}",
                   f"{r['evicted_reuse_tokens']} tokens missed", delta_color="off", delta_arrow="off")
    explain(f"One page id in {r['sample_every']} followed ({r['dropped_events'] or 0} events over the cap dropped). "
            "Good: reuse gaps shorter than the idle time before eviction, and 0 extra pages needed.")
