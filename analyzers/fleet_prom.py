"""The fleet over a Prometheus-compatible store: which pods stand out, and why (issue 51).

Every sidecar serves /metrics; a fleet of them is already scraped by Prometheus (Thanos, Mimir or VictoriaMetrics
behind it). `diagnose_prometheus` asks that store, through its HTTP query API, for each pod's figures over a range
(agent/read/promfleet.py: the same PromQL as the shipped fleet recording rules), then
- names the outliers as the Parquet path does (`fleet.fleet_findings`: a pod at `outlier_ratio` x the fleet median
  or more of a figure where more is worse), and
- reads each pod's causes from its own series (`CAUSES`): KV at its cap or preempting, the engine starved of CPU,
  long prefills ending a share of the inter-token gaps that are far over the median, TTFT degrading over the range.
Each finding carries its PromQL, filtered to the pod, to paste into Grafana. Per-step detail stays in each pod's
own store: the suggestion points there (`phasescope diagnose` on that pod).

Thresholds are the analyzers' own (agent/read/thresholds.py). A pod without a figure's series is left out of that
figure's median and said to have none (`missing`); a figure no pod has is named, never read as healthy.
"""

from __future__ import annotations

import re
import time
from typing import Any

from phasescope.agent.read.promapi import PromApi, PrometheusError
from phasescope.agent.read.promfleet import CAUSE_TEXT, FIGURES, SIGNALS, Figure, offset, render
from phasescope.agent.read.thresholds import T

from .findings import Finding, ref, sort_findings
from .fleet import fleet_findings

_RANGE = re.compile(r"^(\d+)(s|m|h|d)$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# prefill interference: at least this share of the gaps ended by a long prefill (prefill_stalls_decode's
# min_cosched_share: below it no percentile up to the p99 moves)
MIN_LONG_PREFILL_SHARE = 0.01
DEGRADE_RATIO = 1.5  # TTFT p90 of the last quarter of the range over the first quarter's
MIN_BUSY_SHARE = 0.25  # host_bound's min_busy_share


def range_seconds(range_: str) -> int:
    """'10m' -> 600. Raises ValueError for anything but a whole number of s, m, h or d."""
    m = _RANGE.match(range_.strip())
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"--range takes a Prometheus duration like 30s, 10m, 2h or 1d, got {range_!r}")
    return int(m.group(1)) * _SECONDS[m.group(2)]


def _quarter(range_: str) -> str:
    return f"{max(1, range_seconds(range_) // 4)}s"


def _query(f: Figure, by: str, range_: str, selector: str) -> str:
    """Figure `f`'s PromQL over `range_` (the TTFT quarters over a quarter of it, the first one offset to its start)."""
    if f.name == "ttft_p90_first_quarter":
        quarter = _quarter(range_)
        return offset(f.expr, by, quarter, f"{range_seconds(range_) - range_seconds(quarter)}s", selector)
    if f.name == "ttft_p90_last_quarter":
        return render(f.expr, by, _quarter(range_), selector)
    return render(f.expr, by, range_, selector)


def _pod_query(f: Figure, by: str, pod: str, range_: str, selector: str) -> str:
    """`f`'s PromQL over one pod: the selector plus `by="pod"`, to paste into Grafana."""
    inner = selector.strip().strip("{}").strip()
    matcher = f'{by}="{pod}"'
    return _query(f, by, range_, f"{inner}, {matcher}" if inner else matcher)


def read_pods(api: PromApi, *, by: str = "pod", range_: str = "10m", selector: str = "",
              at: float | None = None) -> dict[str, Any]:
    """Every figure and signal per pod. Returns {"figures": pod -> name -> value, "signals": pod -> name -> value,
    "queries": name -> PromQL (all pods), "missing": names no pod has}."""
    range_seconds(range_)
    figures: dict[str, dict[str, float]] = {}
    signals: dict[str, dict[str, float]] = {}
    queries: dict[str, str] = {}
    missing: list[str] = []
    for table, out in ((FIGURES, figures), (SIGNALS, signals)):
        for f in table:
            queries[f.name] = q = _query(f, by, range_, selector)
            rows = api.query(q, at)
            if not rows:
                missing.append(f.name)
            for labels, v in rows:
                pod = labels.get(by)
                if pod is None:
                    continue
                out.setdefault(pod, {})[f.name] = v * f.scale
    pods = set(figures) | set(signals)
    if not pods:
        raise PrometheusError(f"no phasescope series with a {by!r} label match {selector or 'any selector'} over "
                              f"the last {range_}: are the sidecars scraped, and does the scrape config attach "
                              f"{by!r}? (--by names another label, e.g. instance)")
    for pod in pods:
        figures.setdefault(pod, {})
        signals.setdefault(pod, {})
    return {"figures": figures, "signals": signals, "queries": queries, "missing": sorted(missing)}


def causes(signals: dict[str, float]) -> dict[str, dict[str, float]]:
    """The causes one pod's signals show: cause -> the figures that show it (see `CAUSE_TEXT`)."""
    out: dict[str, dict[str, float]] = {}
    usage, pre = signals.get("kv_block_usage_max"), signals.get("preemptions")
    if (usage is not None and usage >= T["near_cap"]) or (pre or 0) > 0:
        out["kv-bound"] = {k: v for k, v in (("kv_block_usage_max", usage), ("preemptions", pre)) if v is not None}
    wait, busy = signals.get("cpu_wait_ratio"), signals.get("busy_share")
    if wait is not None and wait >= T["min_cpu_wait_ratio"] and busy is not None and busy >= MIN_BUSY_SHARE:
        out["host-bound"] = {"cpu_wait_ratio": wait, "busy_share": busy}
    share, p90, p50 = (signals.get(k) for k in ("long_prefill_itl_share", "long_prefill_itl_p90", "itl_p50"))
    if (share is not None and share >= MIN_LONG_PREFILL_SHARE and p90 is not None and p50
            and p90 >= T["itl_spike_ratio"] * p50):
        out["prefill-interference"] = {"long_prefill_itl_share": share, "long_prefill_itl_p90_s": p90,
                                       "itl_p50_s": p50}
    first, last = signals.get("ttft_p90_first_quarter"), signals.get("ttft_p90_last_quarter")
    if first and last is not None and last >= DEGRADE_RATIO * first:
        out["degrading"] = {"ttft_p90_first_quarter_s": first, "ttft_p90_last_quarter_s": last}
    return out


_ADVICE = {
    "kv-bound": "more KV per pod (gpu-memory-utilization, a smaller max-model-len, fp8 KV) or fewer running "
                "sequences (max-num-seqs)",
    "host-bound": "CPU of its own for the engine (whole cores, pinning, OMP_NUM_THREADS)",
    "prefill-interference": "a smaller per-step token budget (max-num-batched-tokens) or a prefill pool apart",
    "degrading": "what changed on it over the range: load, a leak, KV filling; its own store's timeline shows which",
}
_SIGNAL_OF = {"kv-bound": ("kv_block_usage_max", "preemptions"), "host-bound": ("cpu_wait_ratio", "busy_share"),
              "prefill-interference": ("long_prefill_itl_share", "long_prefill_itl_p90", "itl_p50"),
              "degrading": ("ttft_p90_first_quarter", "ttft_p90_last_quarter")}


def prometheus_findings(pods: dict[str, Any], *, by: str = "pod", range_: str = "10m", selector: str = "",
                        outlier_ratio: float = 1.5, min_hosts: int = 3) -> list[Finding]:
    """Outlier findings (`fleet-outlier-pod`, naming the pod's causes) and one finding per pod and cause
    (`fleet-<cause>`), each with its PromQL."""
    per_pod_causes = {pod: causes(sig) for pod, sig in pods["signals"].items()}
    table = {f.name: (pods["queries"][f.name], f.unit, f.what) for f in FIGURES}
    out = fleet_findings(pods["figures"], outlier_ratio=outlier_ratio, min_hosts=min_hosts, figures=table,
                         finding_id="fleet-outlier-pod", noun="pod",
                         suggestion="Run `phasescope diagnose` against {host}'s own store (its sidecar's read API) "
                                    "for the per-step evidence and the change to make.")
    named = []
    for f in out:
        pod = f.evidence["host"]
        why = per_pod_causes.get(pod) or {}
        e = {**f.evidence, "causes": sorted(why), "query": _pod_query(
            next(x for x in FIGURES if x.name == f.evidence["figure"]), by, pod, range_, selector)}
        said = "; ".join(CAUSE_TEXT[c] for c in sorted(why)) if why else "no cause among the fleet's series"
        named.append(Finding(
            id=f.id, title=f.title + (f" ({', '.join(sorted(why))})" if why else ""), severity=f.severity,
            summary=f"{f.title}. Why, from its own series: {said}.",
            action=(f"Fix {pod}: " + "; ".join(_ADVICE[c] for c in sorted(why)) + "." if why
                    else f"Diagnose {pod} from its own store."),
            evidence=e, suggestion=f.suggestion, expected_effect=f.expected_effect, reference=f.reference,
            thresholds=f.thresholds))
    for pod in sorted(per_pod_causes):
        for cause, figs in sorted(per_pod_causes[pod].items()):
            qs = {name: _pod_query(next(x for x in SIGNALS if x.name == name), by, pod, range_, selector)
                  for name in _SIGNAL_OF[cause]}
            shown = ", ".join(f"{k} {v:.3g}" for k, v in figs.items())
            named.append(Finding(
                id=f"fleet-{cause}", title=f"{by} {pod}: {cause}", severity="warning",
                summary=f"{by} {pod}: {CAUSE_TEXT[cause]} ({shown}).",
                action=f"On {pod}: {_ADVICE[cause]}; `phasescope diagnose` on its store gives the exact change.",
                evidence={"host": pod, "cause": cause, **figs, "queries": qs, "range": range_,
                          "query": ";\n".join(qs.values())},
                suggestion=f"{_ADVICE[cause][:1].upper()}{_ADVICE[cause][1:]}. Run `phasescope diagnose` against "
                           f"{pod}'s own store for the per-step evidence and the exact change.",
                expected_effect=f"{pod} back in line with the fleet once its {cause} is gone.",
                reference=ref("Fleet"),
                thresholds={"near_cap": T["near_cap"], "min_cpu_wait_ratio": T["min_cpu_wait_ratio"],
                            "itl_spike_ratio": T["itl_spike_ratio"], "min_long_prefill_share": MIN_LONG_PREFILL_SHARE,
                            "degrade_ratio": DEGRADE_RATIO}))
    return sort_findings(named)


def diagnose_prometheus(url: str, *, selector: str = "", range_: str = "10m", by: str = "pod",
                        outlier_ratio: float = 1.5, min_hosts: int = 3, token: str | None = None) -> dict[str, Any]:
    """The fleet report from a Prometheus-compatible query API: per-pod figures, findings, what is missing."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    user = password = None
    if parts.username is not None:  # user:password@host in the URL: basic auth, kept out of the report
        user, password = parts.username, parts.password
        url = urlunsplit((parts.scheme, parts.hostname + (f":{parts.port}" if parts.port else ""), parts.path,
                          parts.query, parts.fragment))
    api = PromApi(url, token=token, user=user, password=password)
    at = time.time()
    pods = read_pods(api, by=by, range_=range_, selector=selector, at=at)
    found = prometheus_findings(pods, by=by, range_=range_, selector=selector, outlier_ratio=outlier_ratio,
                                min_hosts=min_hosts)
    return {"prometheus": url, "selector": selector, "range": range_, "by": by, "at_unix_s": at,
            "pods": pods["figures"], "signals": pods["signals"], "missing": pods["missing"],
            "queries": pods["queries"], "findings": [f.to_dict() for f in found]}


def print_prometheus(report: dict[str, Any]) -> None:
    """The per-pod figures as a table, then the findings (title, why, PromQL)."""
    from rich.console import Console
    from rich.table import Table

    from phasescope.agent.read.summary import fold

    console = Console()
    t = Table(title=f"fleet: {len(report['pods'])} pods ({report['prometheus']}, last {report['range']})",
              title_justify="left")
    t.add_column(report["by"])
    for f in FIGURES:
        t.add_column(f"{f.name}", justify="right")
    outliers = {(f["evidence"]["host"], f["evidence"].get("figure")) for f in report["findings"]}
    for pod, m in sorted(report["pods"].items()):
        cells = []
        for f in FIGURES:
            v = m.get(f.name)
            text = "-" if v is None else f"{v:.4g}"
            cells.append(f"[bold red]{text}[/]" if (pod, f.name) in outliers else text)
        t.add_row(pod, *cells)
    console.print(fold(t))
    if report["missing"]:
        console.print(f"no series for: {', '.join(report['missing'])} (those figures are not judged)")
    if not report["findings"]:
        console.print("no pod stands out from the fleet, and none shows a cause in its series")
    for f in report["findings"]:
        q = f["evidence"].get("query") or next(iter((f["evidence"].get("queries") or {}).values()), "")
        console.print(f"[bold]{f['severity'].upper()}[/] {f['title']}\n  {f.get('summary') or ''}\n"
                      f"  → {f.get('action') or f['suggestion']}\n  PromQL: {q}")


__all__ = ["PrometheusError", "diagnose_prometheus", "print_prometheus", "prometheus_findings", "read_pods",
           "causes", "range_seconds", "Figure"]
