"""The Hardware page: GPU samples, the memory budget, the server process and the host."""

from __future__ import annotations

from typing import Any

import altair as alt
import streamlit as st

from phasescope.dashboard.charts import line, melt
from phasescope.dashboard.common import RECOMMENDED_SPLIT, q, snapshot, df, explain, gib


def page_hardware(reader: Any, run: str, win: dict[str, Any]) -> None:
    """The GPU (NVML) beside the host and the server process (psutil)."""
    snap = snapshot(reader, [("memory_budget", {"run_id": run})], findings_run=run)
    mb, found = snap["rows"][0], snap["findings"]
    st.subheader("GPU memory budget")
    total = mb["gpu_total_bytes"]
    if total:
        weights = mb["weights_bytes"] or 0.0
        kv = mb["kv_budget_bytes"] or 0.0
        used = mb["gpu_used_bytes"] or 0.0
        act = max(used - weights - kv, 0.0)
        rows = [dict(split="Measured", part=p, share=v / total) for p, v in
                (("Weights", weights), ("KV cache", kv), ("Activations", act), ("Margin", max(total - used, 0.0)))]
        rows += [dict(split="Recommended", part=p.capitalize() if p != "kv cache" else "KV cache", share=v)
                 for p, v in RECOMMENDED_SPLIT.items()]
        st.altair_chart(alt.Chart(df(rows)).mark_bar().encode(
            x=alt.X("share:Q", stack="normalize", title="Share of GPU memory (%)", axis=alt.Axis(format="%")),
            y=alt.Y("split:N", title=None), color=alt.Color("part:N", title="Part"),
            tooltip=[alt.Tooltip("split:N", title="Split"), alt.Tooltip("part:N", title="Part"),
                     alt.Tooltip("share:Q", title="Share", format=".1%")]), width="stretch")
        explain("Starting split: weights 30 / activations 20 / KV 45 / margin 5. Good: KV at or below ~80% of what "
                "remains after weights; a thin margin risks OOM at activation peaks.")
    else:
        st.info(f"No GPU data for this run (no NVML samples). KV budget {gib(mb['kv_budget_bytes'])}, "
                f"peak KV held {gib(mb['kv_peak_bytes'])}.")
    g = df(q(reader, "gpu_timeline", run_id=run, bucket_s=win["bucket_s"]))
    if not g.empty:
        st.subheader("Utilisation and memory")
        g = g.assign(mem_share=g["mem_used_bytes"] / g["mem_total_bytes"], util_share=g["util_pct"] / 100)
        m = melt(g, ["t_s", "gpu_index"], ["util_share", "mem_share"])  # both shares: one unit (%)
        st.altair_chart(line(m, "value", "Share (%)", win["bucket_s"], color="series", dash="gpu_index",
                             y_format="%"), width="stretch")
        explain("Good: utilisation high while serving; memory flat (growth means leaks or an unbounded cache).")
    mbu = [f for f in found if "mbu" in str(f.get("evidence", {})).lower()]
    if mbu:
        st.subheader("Decode roofline")
        st.json(mbu[0].get("evidence", {}), expanded=False)
    host_part(reader, run, win, found)


def host_part(reader: Any, run: str, win: dict[str, Any], found: list[dict[str, Any]]) -> None:
    """Server process and host/container charts, and the host findings."""
    p = df(q(reader, "process_timeline", run_id=run, bucket_s=win["bucket_s"]))
    h = df(q(reader, "host_timeline", run_id=run, bucket_s=win["bucket_s"]))
    if p.empty and h.empty:
        st.caption("No host or server-process samples for this run (the agent's psutil collector was not running).")
        return
    if not p.empty:
        st.subheader("Server process")
        b = win["bucket_s"]
        cores = melt(p, ["t_s", "pid"], ["cpu_cores", "busiest_thread_cores"])
        st.altair_chart(line(cores, "value", "CPU (cores)", b, color="series", dash="pid"), width="stretch")
        wait = p.dropna(subset=["busiest_thread_wait_ratio"])
        if not wait.empty:
            st.altair_chart(line(wait, "busiest_thread_wait_ratio", "Busiest thread waiting for a CPU (%)", b,
                                 dash="pid", y_format="%"), width="stretch")
        explain("Good: the busiest thread well under 1.0 core (one full core: a single Python thread is the limit) "
                "and its run-queue wait near 0% (waiting means other work holds the CPU the engine wants).")
        st.altair_chart(line(p.assign(rss_gib=p["rss_bytes"] / 2**30), "rss_gib", "Resident memory (GiB)", b,
                             dash="pid", tooltip=["open_fds", "threads"]), width="stretch")
        explain("Good: resident memory flat under steady load; a steady climb is a leak suspicion.")
    if not h.empty:
        st.subheader("Host / container")
        b = win["bucket_s"]
        h = h.assign(cpu_busy=h["cpu_util_pct"] / 100, cpu_pressure=h["cpu_pressure_pct"] / 100)
        shares = melt(h, ["t_s"], ["cpu_busy", "cpu_pressure", "throttled_ratio"])  # shares of time: one unit (%)
        if not shares.empty:
            st.altair_chart(line(shares, "value", "Share of time (%)", b, color="series", y_format="%"),
                            width="stretch")
        load = h.dropna(subset=["load_per_cpu"])
        if not load.empty:  # a ratio that may pass 1: its own axis
            st.altair_chart(line(load, "load_per_cpu", "Load per CPU (1-min load / CPUs)", b), width="stretch")
        explain("Good: CPU pressure (share of time a task waited for a CPU) and CFS throttling near 0, load per CPU "
                "below 1; swap in/out none. Memory available: "
                f"{gib(h['mem_available_bytes'].min())} at least of {gib(h['mem_total_bytes'].max())}.")
    for f in found:
        if f.get("id") in ("host-bound", "process-memory-growth"):
            st.warning(f"{f['title']}: {f['suggestion']}")
