"""The Ranks page: step skew and KV per rank."""

from __future__ import annotations

from typing import Any

import altair as alt
import streamlit as st

from phasescope.dashboard.charts import label
from phasescope.dashboard.common import q, df, explain


def page_ranks(reader: Any, run: str, win: dict[str, Any]) -> None:
    rk = df(q(reader, "rank_kv", run_id=run, bucket_s=win["bucket_s"], since_s=win["since_s"], until_s=win["until_s"]))
    if rk.empty or rk["rank"].nunique() < 2:
        st.info("One rank in this run: per-rank balance needs a tensor-parallel run (one probe per rank).")
    else:
        st.subheader("KV bytes per rank")
        rk = rk.assign(kv_gib=rk["kv_bytes"] / 2**30)
        st.altair_chart(alt.Chart(rk).mark_rect().encode(
            x=alt.X("t_s:O", title=label("t_s")), y=alt.Y("rank:O", title="Rank"),
            color=alt.Color("kv_gib:Q", title="KV held (GiB)"),
            tooltip=[alt.Tooltip("t_s:Q", title=label("t_s"), format=".1f"), alt.Tooltip("rank:O", title="Rank"),
                     alt.Tooltip("kv_gib:Q", title="KV held (GiB)", format=",.3f"),
                     alt.Tooltip("imbalance:Q", title="Imbalance (max/mean − 1)", format=".1%")]), width="stretch")
        explain("Good: one colour per column (every rank holds the same KV). A hot row is a rank holding more: "
                "imbalance = max/mean − 1 over ranks.")
    steps = df(q(reader, "rank_steps", run_id=run))
    st.subheader("Stragglers")
    if steps.empty:
        st.caption("No step seen on two or more ranks.")
    else:
        st.altair_chart(alt.Chart(steps).mark_bar().encode(
            x=alt.X("slowest_share:Q", title="Steps where this rank was slowest (%)", axis=alt.Axis(format="%")),
            y=alt.Y("rank:O", title="Rank"),
            tooltip=[alt.Tooltip("rank:O", title="Rank"), alt.Tooltip("p50_ms:Q", title="Step p50 (ms)", format=",.2f"),
                     alt.Tooltip("slowest_share:Q", title="Slowest in", format=".1%"),
                     alt.Tooltip("skew_mean:Q", title="Mean step skew", format=".1%")]), width="stretch")
        explain("Good: shares near 1/ranks. One rank slowest most of the time is a straggler (step skew = max/median − 1).")
