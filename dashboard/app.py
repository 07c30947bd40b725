"""phasescope diagnostics app (Streamlit), read-only over the store.

Launch with `phasescope dashboard FILE` (offline: a DuckDB file no agent holds),
`phasescope dashboard --api http://127.0.0.1:7702` (live: a running sidecar's read
API) or `phasescope dashboard EXPORT_DIR` (the hive-partitioned Parquet exports of one or
many sidecars: every page over the host picked in the sidebar, and a Fleet page comparing
the hosts). Every figure comes from a named query aggregated in DuckDB
(`phasescope.agent.read.queries`); the app never runs SQL of its own or typed by a user.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import altair as alt
import duckdb
import pandas as pd
import streamlit as st

from phasescope.agent.records.errors import ReadError
from phasescope.agent.read.exports import export_glob, hosts
from phasescope.agent.read.phases import APPROX_NOTE
from phasescope.agent.read.reader import open_reader
from phasescope.agent.read.snapshot import decode_items, encode_items
from phasescope.agent.read.summary import requests_hint
from phasescope.agent.read.thresholds import T
from phasescope.analyzers.compare import describe, workload_differs
from phasescope.dashboard.charts import human_table, label, line, melt, time_x
from phasescope.analyzers.diagnose import diagnose
from phasescope.analyzers.findings import first_sentence
from phasescope.analyzers.fleet import HOST_SQL, diagnose_fleet

PAGES = ("Overview", "Phases", "Requests", "KV cache", "Prefix cache", "Ranks", "Hardware", "Experiments", "Sweep")
SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
SEVERITY_COLOR = {"critical": "red", "warning": "orange", "info": "blue"}


def badge(severity: str) -> str:
    """A severity as a text badge (markdown): readable without an emoji font, and by a screen reader."""
    return f":{SEVERITY_COLOR.get(severity, 'gray')}-badge[{severity.upper()}]"
RECOMMENDED_SPLIT = {"weights": 0.30, "activations": 0.20, "kv cache": 0.45, "margin": 0.05}


def target_from_argv(argv: list[str]) -> str:
    """`--target X` after `streamlit run app.py --`, else $PHASESCOPE_TARGET, else ./phasescope.duckdb."""
    if "--target" in argv:
        i = argv.index("--target")
        if i + 1 < len(argv):
            return argv[i + 1]
    return os.environ.get("PHASESCOPE_TARGET", "phasescope.duckdb")


@st.cache_resource
def reader_for(target: str, host: str | None = None) -> Any:
    """`host`: which host's Parquet exports to read when `target` is an export folder."""
    return open_reader(target, findings=diagnose, host=host)


@st.cache_data(ttl=60, show_spinner="comparing the hosts")
def fleet_for(pattern: str) -> dict[str, Any]:
    """analyzers.fleet over every host's exports (figures per host, outlier findings)."""
    return diagnose_fleet(pattern, per_host=False)


def q(reader: Any, name: str, **params: Any) -> Any:
    return reader.query(name, **params)


@st.cache_data(ttl=30, show_spinner="running the analyzers")
def snapshot_for(target: str, host: str | None, items: str, findings_run: str | None) -> dict[str, Any]:
    """Named queries and the findings read in ONE transaction (agent/read/snapshot.py), recomputed at most
    every 30 s (all analyzers: ~1.5 s on 10M steps): the tiles and the findings beside them are one moment."""
    return reader_for(target, host).snapshot(decode_items(items), findings_run)


def snapshot(reader: Any, items: list[tuple[str, dict[str, Any]]], findings_run: str | None = None) -> dict[str, Any]:
    """One read of several named queries (and, with `findings_run`, the findings): one snapshot of the store.
    With findings it is cached (see snapshot_for); without, read now."""
    if findings_run is None:
        return reader.snapshot(items)
    return snapshot_for(reader.target, getattr(reader, "host", None), encode_items(items), findings_run)


def as_of(snap: dict[str, Any]) -> None:
    """The caption that says which moment a page's figures are from."""
    import datetime

    t = datetime.datetime.fromtimestamp(snap["as_of_ns"] / 1e9).strftime("%H:%M:%S")
    st.caption(f"Every figure in this section is from one read of the store at {t}.")


def df(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(rows)


def explain(text: str) -> None:
    """The one line under each chart that says what good looks like."""
    st.caption(text)


def ms(v: float | None) -> str:
    """A duration given in seconds: milliseconds below 10 s, seconds from 10 s on."""
    if v is None:
        return "–"
    return f"{v:.1f} s" if v >= 10 else f"{v * 1e3:.1f} ms"


def pct(v: float | None) -> str:
    return "–" if v is None else f"{v * 100:.1f}%"


def gib(v: float | None) -> str:
    return "–" if v is None else f"{v / 2**30:.2f} GiB"


# --- pages ------------------------------------------------------------------------


def page_overview(reader: Any, run: str, win: dict[str, Any]) -> None:
    p = {"run_id": run}
    snap = snapshot(reader, [("request_summary", p), ("kv_summary", p), ("prefix_summary", p), ("probe_health", p),
                             ("phase_summary", p), ("verifications", p)], findings_run=run)
    r, kv, px, health, phases, checked = snap["rows"]
    hint = requests_hint({"phases": phases, "requests": r})
    if hint:
        st.info(hint[0].upper() + hint[1:])
    findings = sorted(snap["findings"], key=lambda f: SEVERITY_ORDER.get(f.get("severity"), 3))
    c = st.columns(4)
    c[0].metric("TTFT p50", ms(r["ttft_p50_s"]), f"p95 {ms(r['ttft_p95_s'])} · p99 {ms(r['ttft_p99_s'])}",
                delta_color="off", delta_arrow="off")
    c[1].metric("TPOT p50", ms(r["tpot_p50_s"]), f"p95 {ms(r['tpot_p95_s'])} · p99 {ms(r['tpot_p99_s'])}",
                delta_color="off", delta_arrow="off")
    tps = r.get("output_tokens_per_s")
    c[2].metric("Throughput", "–" if tps is None else f"{tps:.0f} tok/s",
                f"{r['finished']} of {r['requests']} requests finished", delta_color="off", delta_arrow="off")
    c[3].metric("KV usage mean", pct(kv[0]["block_usage_mean"]) if kv else "–",
                f"max {pct(kv[0]['block_usage_max'])} · prefix hit {pct(px['hit_rate'])}" if kv else "no KV data",
                delta_color="off", delta_arrow="off")
    telemetry_part(health, findings)
    as_of(snap)
    st.subheader(f"Findings ({len(findings)})")
    explain("What phasescope's analyzers conclude from this run, most severe first, each with what to change.")
    if not findings:
        st.success("No findings: nothing in this run crosses an analyzer threshold.")
    for f in findings:
        sev = str(f.get("severity", "info"))
        with st.expander(f"{badge(sev)} · {f.get('title', f.get('id'))}",
                         expanded=f.get("severity") == "critical"):
            finding_body(f, [v for v in checked if v["finding_id"] == f.get("id")])


def finding_body(f: dict[str, Any], checked: list[dict[str, Any]] = ()) -> None:
    """One finding as `diagnose` prints it: what is wrong with its numbers, what to change -> what it gains, the
    guide's section; then the full suggestion and effect, and the raw figures (collapsed) last."""
    summary = f.get("summary") or first_sentence(f.get("expected_effect", ""))
    action = f.get("action") or first_sentence(f.get("suggestion", ""))
    st.markdown(summary)
    st.markdown(f"→ **{action}**")
    for v in checked:
        st.markdown(verified_line(v["result"]))
    st.caption(f"`{f.get('id')}` · severity {f.get('severity')} · {f.get('reference', '')}")
    st.markdown(f"**Full suggestion:** {f.get('suggestion', '')}")
    if f.get("expected_effect"):
        st.markdown(f"**Expected effect:** {f['expected_effect']}")
    st.json(f.get("evidence", {}), expanded=False)


def verified_line(r: dict[str, Any]) -> str:
    """One `phasescope verify` result under its finding: the change, predicted vs measured effect, the verdict."""
    p = r["prediction"]
    change = ", ".join(f"{k}={v}" for k, v in p["change"].items())
    err = "" if r.get("error") is None else f", prediction off by {r['error']:.0%}"
    return (f"**Checked by a re-run:** {badge_verdict(r['verdict'])} · with {change}, {p['metric']} was predicted to "
            f"move {r['expected']:+.4g} and moved {r['effect']:+.4g} (95% interval "
            f"{r['effect_low']:+.4g} to {r['effect_high']:+.4g}, {len(r['baseline'])} + {len(r['changed'])} "
            f"interleaved runs{err}).")


def badge_verdict(verdict: str) -> str:
    return {"keep": "KEEP", "keep-but-mispredicted": "KEEP (mispredicted)", "revert": "REVERT"}.get(verdict, verdict)


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


def telemetry_part(h: dict[str, Any], findings: list[dict[str, Any]]) -> None:
    """Whether the figures on every page are still true: probe health and the silent-degradation findings."""
    st.subheader("Telemetry")
    degraded = [f for f in findings if str(f.get("id", "")).startswith("telemetry-")]
    c = st.columns(4)
    c[0].metric("Telemetry", f"degraded ({len(degraded)})" if degraded else "complete")
    c[1].metric("Records dropped", f"{h['dropped_total']:,}", f"of {h['records_total']:,} produced",
                delta_color="off", delta_arrow="off")
    c[2].metric("Probe errors", f"{h['errors_total']:,}")
    rate, timed = h["gpu_sample_rate_min"], h["gpu_timed_total"] or 0
    if not timed:  # on CPU (or with CUDA timing off) the probe's rate is 1.0 of nothing: no GPU time exists
        c[3].metric("GPU-timed share (min)", "none", "host time only: no step GPU-timed", delta_color="off",
                    delta_arrow="off")
    else:
        c[3].metric("GPU-timed share (min)", "–" if rate is None else pct(rate), f"{timed:,} steps timed",
                    delta_color="off", delta_arrow="off")
    for f in degraded:
        st.error(f"Do not trust what depends on it: {f.get('title')}. {f.get('expected_effect', '')}")
    explain("Good: complete, no records dropped, no probe errors; KV snapshots and prefix counters flow until "
            "the last step and the probes' clocks agree with the sidecar's. Degraded means some figures on the "
            "other pages describe the past or are absent, not zero.")


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


RENDER = dict(zip(PAGES, (page_overview, page_phases, page_requests, page_kv, page_prefix, page_ranks, page_hardware,
                          page_experiments, page_sweep)))


REFRESH_S = 10.0  # s; a live page whose render outlasts it never settles (it re-renders back to back)


@st.fragment(run_every=REFRESH_S)
def live_page(page: str, reader: Any, run: str, win: dict[str, Any]) -> None:
    """The page body, refreshed on its own every REFRESH_S seconds (no full-page rerun, no sleeping script); says
    how long its last render took (s), so a page slower than its refresh shows why it never rests."""
    t0 = time.perf_counter()
    render(page, reader, run, win)
    took = time.perf_counter() - t0
    st.caption(f"Rendered in {took:.2f} s; refreshes every {REFRESH_S:g} s"
               + (" (slower than its refresh: turn auto-refresh off in the sidebar to read it)" if took > REFRESH_S
                  else "."))


def render(page: str, reader: Any, run: str, win: dict[str, Any]) -> None:
    """One page; a store that became unreadable (a writer took the file, the agent stopped) is one line."""
    try:
        RENDER[page](reader, run, win)
    except ReadError as exc:
        st.warning(f"{exc} (the page shows it again once the store can be read)")
    except duckdb.Error as exc:  # a damaged file or one an older build wrote: one line, never a traceback
        st.error(f"{reader.target} cannot be read: {' '.join(str(exc).split())[:300]}")


def slug(name: str) -> str:
    """A page's name in its link: 'KV cache' -> 'kv-cache'."""
    return name.lower().replace(" ", "-")


def linked(key: str, options: list[str] | tuple[str, ...]) -> int:
    """The index of the option the page's link names (?page=kv-cache, ?run=..., ?host=...), else 0."""
    want = st.query_params.get(key)
    for i, option in enumerate(options):
        if want is not None and want in (option, slug(option)):
            return i
    return 0


def main() -> None:
    st.set_page_config(page_title="phasescope", layout="wide")
    target = target_from_argv(sys.argv)
    live = target.startswith("http")
    pattern = None if live else export_glob(target)
    st.sidebar.title("phasescope")
    st.sidebar.caption(("live · " if live else "exports · " if pattern else "file · ") + target)
    host = None
    if pattern is not None:
        names = hosts(pattern)
        if not names:
            st.error(f"No Parquet exports (host=/date=/table=/*.parquet) under {target}.")
            return
        host = st.sidebar.selectbox("Host", names, index=linked("host", names), key="host")
        st.query_params["host"] = host
    try:
        reader = reader_for(target, host)
    except ReadError as exc:  # a missing, foreign, empty or held file; an agent that does not answer: one line
        st.error(str(exc))
        return
    pages = PAGES + (("Fleet",) if pattern else ())
    page = st.sidebar.radio("Page", pages, index=linked("page", pages), key="page")
    st.query_params["page"] = slug(page)  # every page has its own link: ?page=kv-cache&run=...
    if page == "Fleet":
        st.header(page)
        page_fleet(pattern)
        return
    try:
        runs = q(reader, "runs")
    except ReadError as exc:
        st.error(str(exc))
        return
    if not runs:
        st.header(page)
        st.info("No runs yet. Attach a probe (phasescope.agent.attach) or run `phasescope demo`.")
        return
    labels = {r["run_id"]: f"{r['runtime']} · {r['run_id']} · {r['model']}" for r in runs}  # the runtime first
    run = st.sidebar.selectbox("Run", list(labels), index=linked("run", list(labels)), format_func=labels.get,
                               key="run", help="runtime · run id · model")
    st.query_params["run"] = run
    extent = q(reader, "run_span", run_id=run)
    span = max(1.0, float(extent["span_s"]))
    lo, hi = st.sidebar.slider("Time range (s since start)", 0.0, round(span + 1, 1), (0.0, round(span + 1, 1)),
                               key="window")
    bucket = max((hi - lo) / 60, 0.5)  # multiples of 10 s from 10 s on: the step rollup answers those (phases.py)
    win = {"since_s": lo, "until_s": hi if hi < span + 1 else None,
           "bucket_s": float(10 * round(bucket / 10)) if bucket >= 10 else round(bucket, 2)}
    refresh = st.sidebar.toggle(f"Auto-refresh ({REFRESH_S:g} s)", value=live, key="refresh")
    st.header(page)
    if not extent["steps"]:
        st.caption("This run has no steps yet.")
    if refresh:
        live_page(page, reader, run, win)  # a fragment: reruns alone every REFRESH_S, the page settles between
    else:
        render(page, reader, run, win)


main()
