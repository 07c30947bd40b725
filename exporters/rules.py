"""The alerting rules and the Grafana dashboard shipped as package data.

The rules are rendered from `alerts.tmpl.yml` with the thresholds of `agent/read/thresholds.py`
(the analyzers' defaults), so an alert and the finding its runbook names fire on the same
numbers; the SLOs are options (`phasescope rules --ttft-slo-s 1.0 --tpot-slo-s 0.05`). The
shipped `alerts.yml` is the rendering with the defaults.
"""

from __future__ import annotations

import re
from importlib import resources

from phasescope.agent.read.thresholds import T

from . import buckets

RULES_FILE = "alerts.yml"
FLEET_RULES_FILE = "fleet_rules.yml"  # the rendering of agent/read/promfleet.py's recording rules, as shipped
TEMPLATE_FILE = "alerts.tmpl.yml"
DASHBOARD_FILE = "grafana_dashboard.json"

# thresholds used as a histogram `le`: they must be one of its bucket bounds
BUCKET_BOUNDS = {"ttft_slo_s": buckets.TTFT_S, "tpot_slo_s": buckets.TPOT_S, "max_skew": buckets.SKEW_RATIO}


def _read(name: str) -> str:
    return resources.files("phasescope.exporters").joinpath(name).read_text(encoding="utf-8")


def _fmt(v: float) -> str:
    return f"{v:g}"


def render(template: str, values: dict[str, float]) -> str:
    """Fill `<<name>>`, `<<name|pct>>` (x100) and `<<name|ms>>` (x1000) markers from `values`."""

    def sub(m: re.Match) -> str:
        name, _, fmt = m.group(1).partition("|")
        v = values[name]
        return _fmt(round(v * 100, 6)) if fmt == "pct" else _fmt(round(v * 1000, 6)) if fmt == "ms" else _fmt(v)

    return re.sub(r"<<([a-z_]+(?:\|[a-z]+)?)>>", sub, template)


def rules_text(**overrides: float) -> str:
    """The Prometheus rule file (recording rules and alerts) with the shared thresholds, `overrides` applied
    (e.g. ttft_slo_s=1.0). Raises ValueError for an unknown name or a value the histograms cannot express."""
    unknown = set(overrides) - set(T)
    if unknown:
        raise ValueError(f"unknown threshold(s) {sorted(unknown)}; known: {sorted(T)}")
    values = {**T, **overrides}
    for name, bounds in BUCKET_BOUNDS.items():
        if not any(abs(values[name] - b) < 1e-12 for b in bounds):
            raise ValueError(f"{name}={values[name]:g} is not a bucket bound of its histogram; "
                             f"choose one of {', '.join(_fmt(b) for b in bounds)}")
    return render(_read(TEMPLATE_FILE), values)


def fleet_rules_text() -> str:
    """The fleet recording rules, as shipped (`fleet_rules.yml`; tests check it equals
    `agent/read/promfleet.py`'s rendering, the PromQL `diagnose --prometheus` reads)."""
    return _read(FLEET_RULES_FILE)


def dashboard_text() -> str:
    """The Grafana dashboard JSON, as shipped."""
    return _read(DASHBOARD_FILE)
