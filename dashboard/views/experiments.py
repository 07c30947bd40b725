"""The Experiments page: two runs side by side, and whether their workloads differ."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from phasescope.analyzers.compare import describe, workload_differs
from phasescope.dashboard.common import q, explain


def page_experiments(reader: Any, run: str, win: dict[str, Any]) -> None:
    runs = q(reader, "runs")
    ids = [r["run_id"] for r in runs]
    if len(ids) < 2:
        st.info("One run in this store: run the workload again with one setting changed to compare.")
        return
    c = st.columns(2)
    a = c[0].selectbox("Run A", ids, index=1)
    b = c[1].selectbox("Run B", ids, index=0)
    rows = q(reader, "run_compare", run_a=a, run_b=b)
    table = pd.DataFrame([compare_row(name, rows[0].get(k), rows[1].get(k), unit) for k, name, unit in COMPARE_ROWS],
                         columns=["Metric", f"A {a}", f"B {b}", "B vs A"]).set_index("Metric")
    st.dataframe(table)
    la, lb = q(reader, "run_labels", run_id=a), q(reader, "run_labels", run_id=b)
    differ = {k: (la.get(k), lb.get(k)) for k in sorted(set(la) | set(lb))
              if la.get(k) != lb.get(k) and k not in ("seed",)}
    work = workload_differs(*(workload_of(r) for r in rows))
    if work:
        st.warning(f"The workloads differ ({describe(work)}): the changes above are not the effect of a setting "
                   "alone. Replay the same workload to compare settings.")
    if len(differ) > 1:
        st.warning(f"{len(differ)} settings differ: the effect cannot be pinned on one of them.")
    if differ:
        st.dataframe(pd.DataFrame(differ, index=[a, b]).T, column_config=None)
    elif not (la or lb):
        st.caption("Neither run carries labels: nothing says which setting changed between them.")
    elif work:
        st.caption(f"The two runs carry the same {len(la)} labels, but not the same workload.")
    else:
        st.caption(f"The two runs carry the same {len(la)} labels and the same workload.")
    explain("Change one variable per run (KV budget, then quantization, then layout); compare TTFT, TPOT, "
            "throughput and failures side by side.")


# (request_summary key, human name, unit of its row: "s" rows are shown in ms unless either run is >= 10 s)
COMPARE_ROWS = (("ttft_p50_s", "TTFT p50", "s"), ("ttft_p95_s", "TTFT p95", "s"), ("tpot_p50_s", "TPOT p50", "s"),
                ("tpot_p95_s", "TPOT p95", "s"), ("output_tokens_per_s", "Throughput (tok/s)", "rate"),
                ("requests", "Requests", "count"), ("finished", "Finished", "count"), ("aborted", "Aborted", "count"),
                ("preemptions", "Preemptions", "count"))


def compare_row(name: str, x: Any, y: Any, unit: str) -> list[Any]:
    """One row of the Experiments table in one unit, with B's change against A."""
    change = f"{(y - x) / x:+.1%}" if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x else "–"
    if unit == "s":
        in_s = any(v is not None and v >= 10 for v in (x, y))
        shown = ["–" if v is None else f"{v:.2f}" if in_s else f"{v * 1e3:.1f}" for v in (x, y)]
        return [f"{name} ({'s' if in_s else 'ms'})", *shown, change]
    if unit == "rate":
        return [name, *("–" if v is None else f"{v:,.0f}" for v in (x, y)), change]
    return [name, *("–" if v is None else f"{int(v):,}" for v in (x, y)), change]


def workload_of(summary: dict[str, Any]) -> dict[str, Any]:
    """A run's workload figures (analyzers.compare.WORKLOAD) from its request summary."""
    n = summary.get("requests") or 0
    return {"requests": n, "prompt_tokens_mean": (summary.get("prompt_tokens") or 0) / n if n else None,
            "output_tokens_mean": (summary.get("output_tokens") or 0) / n if n else None}
