"""Many hosts, one question: which host is unlike the others?

Over the Parquet exports of many sidecars (`agent/read/exports.py`), each host's
files become a store-like connection; `host_metrics` measures the same figures on
every host and `fleet_findings` names a host whose figure is `outlier_ratio` times
the median of the fleet (or more), for figures where more is worse. With fewer than
`min_hosts` hosts there is no fleet median to compare with, and no finding.
"""

from __future__ import annotations

import statistics
from typing import Any

from .findings import Finding, ref, sort_findings

# figure -> (SQL over one host's tables, unit, what the figure is); all "more is worse"
HOST_SQL: dict[str, tuple[str, str, str]] = {
    "decode_step_ms_p50": (
        "SELECT quantile_cont(CASE WHEN isnan(gpu_ms) THEN host_ms ELSE gpu_ms END, 0.5) FROM steps "
        "WHERE phase = 'decode'", "ms", "median decode step time (GPU-timed where sampled)"),
    "prefill_ms_per_ktok_p50": (
        "SELECT quantile_cont(CASE WHEN isnan(gpu_ms) THEN host_ms ELSE gpu_ms END / prefill_tokens * 1000, 0.5) "
        "FROM steps WHERE phase = 'prefill' AND prefill_tokens > 0", "ms", "median prefill time per 1000 tokens"),
    "ttft_s_p90": ("SELECT quantile_cont(ttft_s, 0.9) FROM requests", "s", "90th percentile time to first token"),
    "tpot_s_p50": ("SELECT quantile_cont(tpot_s, 0.5) FROM requests", "s", "median time per output token"),
    "kv_block_usage_mean": (
        "SELECT avg(used_pages / nullif(total_pages, 0)) FROM kv_snapshots", "fraction",
        "mean KV block usage"),
    "dropped_record_fraction": (
        "SELECT sum(d) / nullif(sum(r), 0) FROM (SELECT source_id, max(dropped_total) AS d, "
        "max(records_total) AS r FROM probe_health GROUP BY source_id)", "fraction",
        "records the probes dropped"),
}


def host_metrics(con: Any) -> dict[str, Any]:
    """Every figure of HOST_SQL on one host's connection, plus row counts (None where no data)."""
    out: dict[str, Any] = {}
    for name, (sql, _, _) in HOST_SQL.items():
        v = con.execute(sql).fetchone()[0]
        out[name] = None if v is None else float(v)
    out["steps"] = con.execute("SELECT count(*) FROM steps").fetchone()[0]
    out["runs"] = con.execute("SELECT count(DISTINCT run_id) FROM sources WHERE source_id > 0").fetchone()[0]
    return out


def fleet_findings(metrics: dict[str, dict[str, Any]], *, outlier_ratio: float = 1.5,
                   min_hosts: int = 3, figures: dict[str, tuple[str, str, str]] | None = None,
                   finding_id: str = "fleet-outlier-host", noun: str = "host",
                   suggestion: str | None = None) -> list[Finding]:
    """A finding per (host, figure) at `outlier_ratio` x the fleet median or more; most severe first.

    `metrics`: host -> `host_metrics(...)`. Severity: critical from 2x `outlier_ratio`, else warning. `figures`:
    name -> (query, unit, what), HOST_SQL by default (the Prometheus path passes its PromQL, `noun` "pod")."""
    if outlier_ratio <= 1:
        raise ValueError("outlier_ratio must be > 1")
    if min_hosts < 3:
        raise ValueError("min_hosts must be >= 3: a median of two hosts names no outlier")
    findings = []
    for name, (sql, unit, what) in (HOST_SQL if figures is None else figures).items():
        values = {h: m[name] for h, m in metrics.items() if m.get(name) is not None}
        if len(values) < min_hosts:
            continue
        median = statistics.median(values.values())
        if median <= 0:
            continue
        for host, v in sorted(values.items()):
            ratio = v / median
            if ratio < outlier_ratio:
                continue
            findings.append(Finding(
                id=finding_id,
                title=f"{noun} {host}: {what} is {ratio:.2f}x the fleet median",
                severity="critical" if ratio >= 2 * outlier_ratio else "warning",
                evidence={"host": host, "figure": name, "value": v, "unit": unit, "fleet_median": median,
                          "ratio": ratio, "hosts": len(values),
                          "per_host": {h: values[h] for h in sorted(values)}, "query": sql},
                suggestion=(suggestion or "Compare {host} with the others: `phasescope diagnose` on its exports names "
                            "the cause (GPU clocks or thermals, a different config or model revision, KV pressure, "
                            "noisy neighbours); `phasescope compare` shows the labels that differ.").format(host=host),
                expected_effect=f"bringing {host} to the fleet median cuts its {what} by "
                                f"{(1 - 1 / ratio) * 100:.0f}%",
                reference=ref("Fleet"),
                thresholds={"outlier_ratio": outlier_ratio, "min_hosts": min_hosts},
            ))
    return sort_findings(findings)


def diagnose_fleet(pattern: str, *, outlier_ratio: float = 1.5, min_hosts: int = 3,
                   per_host: bool = True) -> dict[str, Any]:
    """Open every host's exports under `pattern`, measure them, compare them; with `per_host`,
    also run `diagnose` on each host's latest run. Returns a JSON-ready dict."""
    from phasescope.agent.read.exports import hosts, open_host

    from .diagnose import diagnose

    names = hosts(pattern)
    if not names:
        raise FileNotFoundError(f"no export files (host=/date=/table=) match {pattern!r}")
    metrics: dict[str, dict[str, Any]] = {}
    host_findings: dict[str, list[dict[str, Any]]] = {}
    for h in names:
        con = open_host(pattern, h)
        try:
            metrics[h] = host_metrics(con)
            if per_host:
                host_findings[h] = [f.to_dict() for f in diagnose(con)]
        finally:
            con.close()
    found = fleet_findings(metrics, outlier_ratio=outlier_ratio, min_hosts=min_hosts)
    return {"pattern": pattern, "hosts": metrics, "findings": [f.to_dict() for f in found],
            "host_findings": host_findings}


def print_fleet(report: dict[str, Any]) -> None:
    """The per-host figures as a table, then the fleet findings, then each host's finding ids."""
    from rich.console import Console
    from rich.table import Table

    from phasescope.agent.read.summary import fold

    console = Console()
    t = Table(title=f"fleet: {len(report['hosts'])} hosts ({report['pattern']})", title_justify="left")
    t.add_column("host")
    for name, (_, unit, _) in HOST_SQL.items():
        t.add_column(f"{name}", justify="right")
    t.add_column("steps", justify="right")
    outliers = {(f["evidence"]["host"], f["evidence"]["figure"]) for f in report["findings"]}
    for h, m in report["hosts"].items():
        cells = []
        for name in HOST_SQL:
            v = m.get(name)
            text = "-" if v is None else f"{v:.4g}"
            cells.append(f"[bold red]{text}[/]" if (h, name) in outliers else text)
        t.add_row(h, *cells, str(m["steps"]))
    console.print(fold(t))
    if not report["findings"]:
        console.print("no host stands out from the fleet")
    for f in report["findings"]:
        console.print(f"[bold]{f['severity'].upper()}[/] {f['title']}\n  {f['suggestion']}\n  "
                      f"expected: {f['expected_effect']}")
    for h, fs in report.get("host_findings", {}).items():
        ids = ", ".join(f"{f['id']} ({f['severity']})" for f in fs) or "none"
        console.print(f"host {h} findings: {ids}")
