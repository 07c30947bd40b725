"""The Fleet page (exports of several hosts): the same figures per host and the hosts that stand out."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from phasescope.analyzers.fleet import HOST_SQL
from phasescope.dashboard.common import badge, fleet_for, explain
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
    st.subheader(f"Fleet findings ({len(report['findings'])})")
    if not report["findings"]:
        st.success("No host stands out from the fleet.")
    for f in report["findings"]:
        with st.expander(f"{badge(f['severity'])} · {f['title']}", expanded=True):
            finding_body(f)
