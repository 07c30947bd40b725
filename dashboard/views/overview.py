"""The Overview page: the run's headline figures, the telemetry's health and the findings (as `diagnose` prints
them: what is wrong, what to change, then the full texts and the raw figures)."""

from __future__ import annotations

from typing import Any

import streamlit as st

from phasescope.agent.read.summary import requests_hint
from phasescope.analyzers.findings import first_sentence
from phasescope.dashboard.common import SEVERITY_ORDER, badge, snapshot, as_of, explain, ms, pct


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
