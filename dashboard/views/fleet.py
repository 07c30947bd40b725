"""The Fleet page: the same figures per host and the hosts that stand out, over several hosts' Parquet exports
(`page_fleet`) or through a Prometheus-compatible query API that scrapes the sidecars (`page_fleet_prometheus`)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from phasescope.analyzers.fleet import HOST_SQL
from phasescope.agent.read.promfleet import FIGURES
from phasescope.dashboard.common import badge, explain, fleet_for, prometheus_fleet_for
from phasescope.dashboard.views.overview import finding_body


def page_fleet(pattern: str) -> None:
    report = fleet_for(pattern)
    names = list(HOST_SQL)
    heads = [f"{HOST_SQL[k][2][0].upper()}{HOST_SQL[k][2][1:]} ({HOST_SQL[k][1]})" for k in names] + ["Steps", "Runs"]
    table = pd.DataFrame({h: [m.get(k) for k in names + ["steps", "runs"]] for h, m in report["hosts"].items()},
                         index=heads).T.astype(float).round(4)
    table.index.name = "Host"
    st.dataframe(table)
    explain("The same figures on every host (more is worse for each); a host at 1.5x the fleet median or "
            "more is named below. Three hosts at least: two have no median to stand out from.")
    _findings(report["findings"], "No host stands out from the fleet.")


def _findings(findings: list[dict], none: str, promql: bool = False) -> None:
    """The fleet findings, one expander each (with its PromQL when `promql`); `none`: said when there are none."""
    st.subheader(f"Fleet findings ({len(findings)})")
    if not findings:
        st.success(none)
    for f in findings:
        with st.expander(f"{badge(f['severity'])} · {f['title']}", expanded=True):
            finding_body(f)
            if promql:
                st.code(f["evidence"]["query"], language="promql")


def page_fleet_prometheus(url: str, range_: str = "10m", selector: str = "") -> None:
    """The pods' figures from Prometheus (analyzers/fleet_prom.py), the pods that stand out and each pod's causes,
    every finding with its PromQL."""
    from phasescope.agent.read.promapi import PrometheusError

    try:
        report = prometheus_fleet_for(url, range_, selector)
    except (PrometheusError, ValueError) as exc:
        st.error(str(exc))
        return
    names = [f.name for f in FIGURES]
    heads = [f"{f.what[0].upper()}{f.what[1:]} ({f.unit})" for f in FIGURES]
    table = pd.DataFrame({pod: [m.get(k) for k in names] for pod, m in report["pods"].items()},
                         index=heads).T.astype(float).round(4)
    table.index.name = report["by"].capitalize()
    st.dataframe(table)
    explain(f"From {url}, the last {range_}: the same figures on every pod (more is worse for each); a pod at 1.5x "
            "the fleet median or more is named below, with the causes its own series show.")
    if report["missing"]:
        st.caption(f"No series for: {', '.join(report['missing'])} (not judged).")
    _findings(report["findings"], "No pod stands out from the fleet, and none shows a cause in its series.", True)
