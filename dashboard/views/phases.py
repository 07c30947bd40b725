"""The Phases page: step times per phase over the run, and what prefill does to decode."""

from __future__ import annotations

from typing import Any

import altair as alt
import streamlit as st

from phasescope.agent.read.phases import APPROX_NOTE
from phasescope.dashboard.charts import human_table, label, line, time_x
from phasescope.dashboard.common import q, df, explain


def page_phases(reader: Any, run: str, win: dict[str, Any]) -> None:
    summary = q(reader, "phase_summary", run_id=run, quantiles="approx")
    st.dataframe(human_table(summary, {"phase": ("Phase", None), "steps": ("Steps", None),
                                       "p50_ms": ("Step p50 (ms)", 2), "p95_ms": ("Step p95 (ms)", 2),
                                       "p99_ms": ("Step p99 (ms)", 2), "prefill_tokens": ("Prefill tokens", None),
                                       "decode_tokens": ("Decode tokens", None),
                                       "gpu_timed": ("GPU-timed steps", None)}), hide_index=True)
    st.caption(f"Step-time percentiles on this page: {APPROX_NOTE}.")
    tl = df(q(reader, "step_timeline", run_id=run, bucket_s=win["bucket_s"], since_s=win["since_s"],
              until_s=win["until_s"], quantiles="approx"))
    st.subheader("Step time over time, by phase")
    if not tl.empty:
        st.altair_chart(line(tl, "p95_ms", "Step time p95 (ms)", win["bucket_s"], color="phase", point=True,
                             tooltip=["steps", "p50_ms"]), width="stretch")
    explain("Good: decode steps flat and low; prefill steps scale with prompt tokens. Spikes in decode mean "
            "something (a long prefill, preemption) shared its steps.")
    sample = df(q(reader, "step_sample", run_id=run, limit=3000, since_s=win["since_s"], until_s=win["until_s"]))
    st.subheader("Step timeline (sampled steps)")
    if not sample.empty:
        st.altair_chart(alt.Chart(sample).mark_circle(size=18, opacity=0.6).encode(
            x=time_x(), y=alt.Y("ms:Q", title="Step time (ms, log)", scale=alt.Scale(type="log")),
            color=alt.Color("phase:N", title="Phase"),
            tooltip=[alt.Tooltip("t_s:Q", title=label("t_s"), format=".2f"), alt.Tooltip("phase:N", title="Phase"),
                     alt.Tooltip("ms:Q", title="Step time (ms)", format=",.2f")]
            + [alt.Tooltip(f"{c}:Q", title=label(c), format=",") for c in ("prefill_tokens", "decode_tokens",
                                                                            "num_seqs")]), width="stretch")
    explain("Each dot is one forward. Good: two tight bands (prefill, decode); mixed steps close to decode.")
    inter = df(q(reader, "interference", run_id=run, since_s=win["since_s"], until_s=win["until_s"],
                 quantiles="approx"))
    st.subheader("Prefill interference")
    if not inter.empty:
        st.altair_chart(alt.Chart(inter).mark_bar().encode(
            x=alt.X("p95_ms:Q", title="Step time p95 of steps carrying decode tokens (ms)"),
            y=alt.Y("class:N", title="Decode steps"),
            tooltip=[alt.Tooltip("class:N", title="Decode steps"), alt.Tooltip("steps:Q", title="Steps", format=","),
                     alt.Tooltip("p50_ms:Q", title="p50 (ms)", format=",.2f"),
                     alt.Tooltip("p95_ms:Q", title="p95 (ms)", format=",.2f"),
                     alt.Tooltip("prefill_tokens_mean:Q", title="Mean prefill tokens", format=",.0f")]),
            width="stretch")
    explain("Decode tokens pay the time of the step they ride in. Good: 'with long prefill' close to 'decode "
            "only'; far above it means chunked prefill (a smaller token budget per step) would steady TPOT.")
