"""The KV cache page: usage, fragmentation and churn over the run, per rank, and the page-size what-if."""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd
import streamlit as st

from phasescope.dashboard.charts import line, melt
from phasescope.dashboard.common import q, df, explain, pct


def page_kv(reader: Any, run: str, win: dict[str, Any]) -> None:
    kv_rows = q(reader, "kv_summary", run_id=run)
    kv = df(q(reader, "kv_timeline", run_id=run, bucket_s=win["bucket_s"], since_s=win["since_s"],
              until_s=win["until_s"]))
    if kv.empty:
        st.info("No paged-KV snapshots in this run (the runtime adapter reports them).")
        return
    b = win["bucket_s"]
    rank_lines(kv, "Block vs token usage", ["block_usage", "token_usage"], "Share of the cache (%)", b,
               "Block usage is what schedulers see; the gap to token usage is slack inside pages. Good: below ~90% "
               "with headroom, and the two lines close.", y_format="%")
    rank_lines(kv, "Fragmentation", ["internal_fragmentation", "external_fragmentation"], "Fragmentation (%)", b,
               "Internal: slack inside used pages (page size too large for the lengths served). External: free pages "
               "scattered. Good: internal under ~10%; external matters only to allocators needing contiguous runs.",
               y_format="%")
    rank_lines(kv, "Churn", ["allocated_per_s", "freed_per_s"], "Pages per second", b,  # two lines, never stacked
               "Pages allocated and freed per second. Good: both track the request rate; a sawtooth with high "
               "external fragmentation means allocation granularity is fighting the workload.", point=True)
    st.subheader("Page-size what-if")
    page_size_whatif_view(q(reader, "page_size_whatif", run_id=run,
                            sizes=",".join(map(str, sorted({8, 16, 32, 64, 128, 256} | current_pages(kv_rows))))),
                          kv_rows)


def rank_lines(kv: pd.DataFrame, title: str, series: list[str], y_title: str, bucket_s: float, note: str,
               **line_kw: Any) -> None:
    """A KV page section: `series` of the timeline over time, one colour a series and one dash a rank, and its note."""
    st.subheader(title)
    st.altair_chart(line(melt(kv, ["t_s", "rank"], series), "value", y_title, bucket_s, color="series", dash="rank",
                         **line_kw), width="stretch")
    explain(note)


def current_pages(kv_rows: list[dict[str, Any]]) -> set[int]:
    return {int(r["page_size"]) for r in kv_rows if r.get("page_size")}


def page_size_whatif_view(rows: list[dict[str, Any]], kv_rows: list[dict[str, Any]]) -> None:
    """Predicted internal fragmentation at other page sizes, calibrated so this run's page size reads exactly the
    measured mean (the model - each request's final length - and the snapshots differ: mid-run sequences are
    shorter); each bar is the model's value times measured / model at the current size."""
    w = df(rows)
    sizes = current_pages(kv_rows)
    current = next(iter(sizes)) if len(sizes) == 1 else None
    measured = [r["internal_fragmentation_mean"] for r in kv_rows if r.get("internal_fragmentation_mean") is not None]
    if w.empty:
        st.caption("No finished requests with known lengths: nothing to predict from.")
        return
    model_now = w.loc[w["page_size"] == current, "internal_fragmentation"] if current else pd.Series(dtype=float)
    scale = (sum(measured) / len(measured)) / float(model_now.iloc[0]) if measured and len(model_now) and \
        float(model_now.iloc[0]) > 0 else 1.0
    w["predicted"] = (w["internal_fragmentation"] * scale).clip(upper=0.999)
    if current is not None and measured:
        w.loc[w["page_size"] == current, "predicted"] = sum(measured) / len(measured)  # exactly the measured mean
    w["page"] = [f"{p} (current)" if p == current else str(p) for p in w["page_size"]]
    w["current"] = w["page_size"] == current
    st.altair_chart(alt.Chart(w).mark_bar().encode(
        x=alt.X("page:O", title="Page size (tokens)", sort=list(w["page"])),
        y=alt.Y("predicted:Q", title="Internal fragmentation (%)", axis=alt.Axis(format="%")),
        color=alt.Color("current:N", title="This run's page size",
                        scale=alt.Scale(domain=[True, False], range=["#d62728", "#4c78a8"])),
        tooltip=[alt.Tooltip("page_size:Q", title="Page size (tokens)"),
                 alt.Tooltip("predicted:Q", title="Internal fragmentation", format=".1%"),
                 alt.Tooltip("pages:Q", title="Pages at the end", format=",.0f")]), width="stretch")
    st.dataframe(pd.DataFrame({"Page size (tokens)": w["page"],
                               "Internal fragmentation (%)": (w["predicted"] * 100).round(1),
                               "Pages at the end": w["pages"].astype(int)}), hide_index=True)
    if current is not None and measured:
        model = float(model_now.iloc[0]) if len(model_now) else float("nan")
        explain(f"At {current} tokens (this run) the bar is the measured mean, {pct(sum(measured) / len(measured))} "
                f"of used-page space; the requests' final lengths alone predict {pct(model)}, so every other bar is "
                f"that model's value times {scale:.2f}. Smaller pages waste less but mean bigger page tables; pick "
                "the knee.")
    else:
        explain("The same requests at other page sizes (from their final lengths). Smaller pages waste less but mean "
                "bigger page tables; pick the knee.")
