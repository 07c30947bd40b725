"""The Sweep page: a load sweep's points, its knee and the constraint that binds there."""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd
import streamlit as st

from phasescope.agent.records.errors import ReadError
from phasescope.dashboard.charts import human_table
from phasescope.dashboard.common import q, df, explain, pct


SWEEP_COLUMNS = {"point": ("Point", None), "rate_per_s": ("Offered (req/s)", 2),
                 "achieved_rate_per_s": ("Achieved (req/s)", 2), "requests": ("Requests", None),
                 "goodput_req_per_s": ("Goodput (req/s)", 2), "attainment": ("SLO attainment (%)", 1),
                 "survival": ("Survival (%)", 1), "ttft_p50_ms": ("TTFT p50 (ms)", 1), "ttft_p99_ms": ("TTFT p99 (ms)", 1),
                 "tpot_p50_ms": ("TPOT p50 (ms)", 1), "tpot_p99_ms": ("TPOT p99 (ms)", 1),
                 "itl_p99_ms": ("ITL p99 (ms)", 1), "preemptions": ("Preemptions", None), "run_id": ("Run", None)}


def sweep_frame(points: list[dict[str, Any]]) -> pd.DataFrame:
    """The points with latencies in ms and shares in %, for the chart and the table."""
    d = df(points)
    for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p99"):
        d[f"{k}_ms"] = pd.to_numeric(d[f"{k}_s"], errors="coerce") * 1e3
    for k in ("attainment", "survival"):
        d[k] = pd.to_numeric(d[k], errors="coerce") * 100
    for k in ("goodput_req_per_s", "achieved_rate_per_s"):
        d[k] = pd.to_numeric(d[k], errors="coerce")
    return d


def sweep_charts(d: pd.DataFrame, knee_rate: float | None, knee_text: str) -> tuple[Any, Any]:
    """Goodput (with the offered load as a dotted diagonal) and p99 TTFT / TPOT against offered load (log x),
    the knee a red rule on both, named with its binding constraint above the goodput chart."""
    x = alt.X("rate_per_s:Q", title="Offered load (req/s, log)", scale=alt.Scale(type="log", base=2))
    good = d.assign(offered=d["rate_per_s"]).melt(id_vars=["rate_per_s"], value_vars=["goodput_req_per_s", "offered"],
                                                   var_name="series").dropna(subset=["value"])
    good["series"] = good["series"].map({"goodput_req_per_s": "Goodput", "offered": "Offered load"})
    top = alt.Chart(good).mark_line(point=True).encode(
        x=x, y=alt.Y("value:Q", title="Requests/s"), color=alt.Color("series:N", title=None),
        strokeDash=alt.StrokeDash("series:N", title=None),  # one legend with the colour (legend=None hides both in a layer)
        tooltip=[alt.Tooltip("rate_per_s:Q", title="Offered (req/s)"), alt.Tooltip("series:N", title="Series"),
                 alt.Tooltip("value:Q", title="req/s", format=",.2f")])
    lat = d.melt(id_vars=["rate_per_s"], value_vars=["ttft_p99_ms", "tpot_p99_ms"], var_name="series").dropna()
    lat["series"] = lat["series"].map({"ttft_p99_ms": "TTFT p99", "tpot_p99_ms": "TPOT p99"})
    bottom = alt.Chart(lat).mark_line(point=True).encode(
        x=x, y=alt.Y("value:Q", title="p99 latency (ms, log)", scale=alt.Scale(type="log")),
        color=alt.Color("series:N", title=None),
        tooltip=[alt.Tooltip("rate_per_s:Q", title="Offered (req/s)"), alt.Tooltip("series:N", title="Series"),
                 alt.Tooltip("value:Q", title="ms", format=",.1f")])
    if knee_rate is not None:
        k = pd.DataFrame({"rate_per_s": [knee_rate], "label": [knee_text]})
        rule = alt.Chart(k).mark_rule(color="red", strokeDash=[4, 3]).encode(x="rate_per_s:Q", tooltip=["label"])
        top, bottom = (top + rule).properties(title=alt.TitleParams(knee_text, color="red", anchor="end")), \
            bottom + rule
    return top.properties(height=240), bottom.properties(height=240)


def page_sweep(reader: Any, run: str, win: dict[str, Any]) -> None:
    """A load sweep (`phasescope sweep`): goodput and p99 TTFT/TPOT against offered load, the SLO knee and the
    constraint that binds there (analyzers/sweep.py), and the per-point table."""
    from phasescope.analyzers.sweep import Slo, evidence_point, explain_point, find_knee

    found = q(reader, "sweeps")
    if not found:
        st.info("No sweep in this store. `phasescope sweep --db FILE` records one labelled run per offered rate; "
                "open that file here.")
        return
    names = {s["sweep_id"]: f"{s['sweep_id']} · {s['points']} points · {s['rate_min_per_s']:g}–"
             f"{s['rate_max_per_s']:g} req/s · {s['runtime']}" for s in found}
    sweep = st.selectbox("Sweep", list(names), format_func=names.get, key="sweep")
    c = st.columns(3)
    ttft = c[0].number_input("TTFT SLO (ms)", min_value=1.0, value=Slo().ttft_s * 1e3, step=50.0, key="sweep_ttft") / 1e3
    tpot = c[1].number_input("TPOT SLO (ms)", min_value=1.0, value=Slo().tpot_s * 1e3, step=5.0, key="sweep_tpot") / 1e3
    target = c[2].number_input("Target attainment (%)", min_value=1.0, max_value=100.0, value=90.0, step=5.0,
                               key="sweep_target") / 100
    points = q(reader, "sweep_points", sweep_id=sweep, ttft_slo_s=ttft, tpot_slo_s=tpot)
    if not points:
        st.info(f"Sweep {sweep} has no points left in this store.")
        return
    knee, at = find_knee(points, target), evidence_point(points, target)
    knee_rate = None if knee is None else points[knee]["rate_per_s"]
    slo = Slo(ttft_s=ttft, tpot_s=tpot)
    try:
        cons = reader.analyze(lambda con: explain_point(con, points[at]["run_id"], slo)) if at is not None else []
    except ReadError as exc:
        cons = None
        st.caption(f"Binding constraint not shown: {exc}.")
    bind = next((x for x in cons or [] if x["binds"]), None)
    ev = points[at] if at is not None else None
    m = st.columns(3)
    m[0].metric("Knee", "none" if knee_rate is None else f"{knee_rate:g} req/s",
                "the lowest rate misses the target" if knee_rate is None
                else f"goodput {points[knee]['goodput_req_per_s'] or 0:.2f} req/s", delta_color="off", delta_arrow="off")
    m[1].metric("Binding constraint", "–" if cons is None else bind["name"] if bind else "none shows",
                None if ev is None else f"read at {ev['rate_per_s']:g} req/s (attainment {pct(ev['attainment'])})",
                delta_color="off", delta_arrow="off")
    m[2].metric("Points", f"{len(points)}", f"{sum(p['requests'] or 0 for p in points):,} requests",
                delta_color="off", delta_arrow="off")
    d = sweep_frame(points)
    text = "" if knee_rate is None else f"knee {knee_rate:g} req/s" + (f": {bind['name']}" if bind else "")
    for chart in sweep_charts(d, knee_rate, text):
        st.altair_chart(chart, width="stretch")
    explain("Good: goodput follows the offered load (the dotted diagonal) and p99 TTFT/TPOT stay flat up to the "
            "knee, the largest rate at which this and every lower rate meet the SLOs for the target share of requests.")
    if bind:
        st.subheader(f"Why the knee is there: {bind['name']}")
        st.markdown(f"**Change:** {bind['change']}")
        st.json(bind["figures"], expanded=False)
        also = [x["name"] for x in cons if x["binds"] and x["name"] != bind["name"]]
        if also:
            st.caption(f"Also present at that point: {', '.join(also)}.")
    elif cons is not None and ev is not None:
        st.caption("None of the known constraints shows in the per-step evidence at that point.")
    st.subheader("Points")
    st.dataframe(human_table(d, SWEEP_COLUMNS), hide_index=True)
