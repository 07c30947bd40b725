"""The Requests page: TTFT / TPOT / ITL / E2E / queue distributions, SLO attainment and the ITL tail's causes."""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd
import streamlit as st

from phasescope.agent.read.thresholds import T
from phasescope.dashboard.common import snapshot, as_of, df, explain, pct


def page_requests(reader: Any, run: str, win: dict[str, Any]) -> None:
    cols = st.columns(2)
    ttft_slo = cols[0].number_input("TTFT SLO (ms)", min_value=1.0, value=T["ttft_slo_s"] * 1e3, step=50.0) / 1e3
    tpot_slo = cols[1].number_input("TPOT SLO (ms)", min_value=1.0, value=T["tpot_slo_s"] * 1e3, step=5.0) / 1e3
    metrics = ("ttft", "tpot", "itl")
    # one read (one open of the file, one moment of a live store): 5 queries read one by one opened the file 5 times
    snap = snapshot(reader, [("slo_attainment", {"run_id": run, "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo})]
                    + [("latency_histogram", {"run_id": run, "metric": m, "bins": 30}) for m in metrics]
                    + [("itl_attribution", {"run_id": run, "tpot_slo_s": tpot_slo})])
    slo, hists, attribution = snap["rows"][0], dict(zip(metrics, snap["rows"][1:4])), snap["rows"][4]
    c = st.columns(3)
    c[0].metric("SLO attainment", pct(slo["attainment"]), f"{slo['both_ok']} of {slo['finished']} requests",
                delta_color="off", delta_arrow="off")
    c[1].metric("Goodput", "–" if slo["goodput_req_per_s"] is None else f"{slo['goodput_req_per_s']:.2f} req/s")
    c[2].metric("Goodput tokens", "–" if slo["goodput_tokens_per_s"] is None else f"{slo['goodput_tokens_per_s']:.0f} tok/s")
    explain("Goodput counts only requests that met both SLOs. Good: attainment near 100% at the load you serve.")
    for metric, title, good in (("ttft", "TTFT", "tight, under the TTFT SLO; a long right tail is queueing or "
                                 "long prefills"), ("tpot", "TPOT", "one narrow peak; a second peak is decode "
                                 "sharing steps with prefills"), ("itl", "Inter-token latency", "narrow and left of the TPOT SLO line; "
                                 "gaps right of it are stalls a user sees as a frozen stream")):
        h = df(hists[metric])
        st.subheader(f"{title} distribution")
        if not h.empty:
            h["ms"] = (h["lo_s"] * h["hi_s"]) ** 0.5 * 1e3
            chart = alt.Chart(h).mark_bar().encode(
                x=alt.X("ms:Q", title=f"{title} (ms, log)", scale=alt.Scale(type="log")),
                y=alt.Y("count:Q", title="requests" if metric != "itl" else "tokens"),
                tooltip=["lo_s", "hi_s", "count"])
            # the SLO set above, as a red rule; a gap between two tokens is held to the TPOT SLO
            slo_ms = {"ttft": ttft_slo, "tpot": tpot_slo, "itl": tpot_slo}[metric] * 1e3
            label = f"{'TPOT ' if metric == 'itl' else ''}SLO {slo_ms:g} ms"
            if slo_ms:
                rule = alt.Chart(pd.DataFrame({"ms": [slo_ms], "label": [label]})).mark_rule(
                    color="red", strokeDash=[4, 3]).encode(x="ms:Q", tooltip=["label"])
                chart = chart + rule
            st.altair_chart(chart, width="stretch")
        explain(f"Good: {good}.")
    as_of(snap)
    itl_tail(attribution)


def itl_tail(a: dict[str, Any]) -> None:
    """Which steps made the slowest tokens slow: the ITL tail (>= p99) by cause (analyzers/itl.py), from the
    `itl_attribution` query's answer `a`."""
    st.subheader("ITL tail: what the slowest tokens waited for")
    if not a.get("itl_samples"):
        st.info("No inter-token gaps in this run (requests with two or more token events).")
        return
    c = st.columns(3)
    c[0].metric("ITL p50", f"{a['itl_p50_ms']:.1f} ms", f"p99 {a['itl_p99_ms']:.1f} ms "
                f"({a['itl_p99_ms'] / a['itl_p50_ms']:.1f}x)" if a["itl_p50_ms"] else None,
                delta_color="off", delta_arrow="off")
    c[1].metric("Tail samples (>= p99)", f"{a['tail_samples']}", f"of {a['itl_samples']} tokens",
                delta_color="off", delta_arrow="off")
    c[2].metric("TPOT-SLO violations", f"{a['tpot_violations']}",
                f"{a['tpot_violations_explained_prefill']} explained by prefills alone", delta_color="off",
                delta_arrow="off")
    causes = df(a["causes"])
    st.altair_chart(alt.Chart(causes).mark_bar().encode(
        x=alt.X("tail_share:Q", title="share of the tail's time over the median ITL", axis=alt.Axis(format="%")),
        y=alt.Y("cause:N", sort=list(causes["cause"])),
        tooltip=["cause", "tail_samples", "tail_share", "tpot_violations_explained"]), width="stretch")
    explain(f"Each gap is charged to the step(s) it waited on: a prefill of >= {T['long_prefill_tokens']:g} tokens "
            "in the same step, a preemption, steps it sat out (queueing), or host time >= "
            f"{T['host_stall_ratio']:g}x the step's compute. Good: p99 within ~{T['itl_spike_ratio']:g}x the median; "
            "a tail of 'prefill' means a smaller per-step token budget (chunked prefill) would steady the stream.")
