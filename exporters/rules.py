"""The alerting rules and the Grafana dashboard shipped as package data."""

from __future__ import annotations

from importlib import resources

RULES_FILE = "alerts.yml"
DASHBOARD_FILE = "grafana_dashboard.json"


def _read(name: str) -> str:
    return resources.files("phasescope.exporters").joinpath(name).read_text(encoding="utf-8")


def rules_text() -> str:
    """The Prometheus rule file (recording rules and alerts), as shipped."""
    return _read(RULES_FILE)


def dashboard_text() -> str:
    """The Grafana dashboard JSON, as shipped."""
    return _read(DASHBOARD_FILE)
