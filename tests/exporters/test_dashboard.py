"""The Grafana dashboard: valid JSON of Grafana's schema, and PromQL only over metrics the exporters expose."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml
from prometheus_client import CollectorRegistry

from conftest import crafted_batch
from phasescope.agent.sidecar import SidecarStats
from phasescope.exporters.otlp import ExportCounts, OtlpCountsCollector
from phasescope.exporters.prometheus import PrometheusExporter, SidecarStatsCollector
from phasescope.exporters.rules import dashboard_text, rules_text

KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
            "inf", "nan"}


def dashboard() -> dict:
    return json.loads(dashboard_text())


def expressions(d: dict) -> list[str]:
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """Metric (and recording-rule) names referenced by a PromQL expression."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = m.group(0)
        rest = e[m.end():].lstrip()
        if rest.startswith("(") or word.lower() in KEYWORDS:
            continue  # a function or an operator
        names.add(word)
    return names


def exposed_names() -> set[str]:
    """Every sample name the exporters expose after the crafted workload (histogram series included)."""
    from phasescope.agent.records.events import PageEvent, PrefixLookup

    reg = CollectorRegistry()
    exp = PrometheusExporter(reg)
    exp.on_records(crafted_batch())
    # issue 13's per-lookup and sampled page records (an evicted-then-reused lookup, a reuse, an eviction)
    exp.on_records([(1, [PrefixLookup(10, 0, "r9", "first", 16, 100, 96, 16, 64, 48, 250.0, 8, 0),
                         PageEvent(11, 0, 3, "reused", 40.0, 5.0, 1, 0), PageEvent(12, 0, 4, "evicted", 90.0, 30.0, 1, 0)])])
    # a decode token right after a step that prefilled a long prompt (phasescope_inter_token_latency_long_prefill_*)
    from phasescope.agent.records.events import PHASE_MIXED, REQ_ARRIVAL, REQ_TOKEN, RequestEvent, Step

    exp.on_records([(1, [RequestEvent(20, 0, REQ_ARRIVAL, "r8", 4, 0), RequestEvent(21, 0, REQ_TOKEN, "r8", 1, 0),
                         Step(22, 99, 0, PHASE_MIXED, 2, 512, 1, 4, 50.0, float("nan")),
                         RequestEvent(23, 0, REQ_TOKEN, "r8", 1, 0)])])
    reg.register(SidecarStatsCollector(SidecarStats()))
    reg.register(OtlpCountsCollector(ExportCounts()))
    return {s.name for m in reg.collect() for s in m.samples}


def recorded_names() -> set[str]:
    doc = yaml.safe_load(rules_text())
    return {r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r}


def test_metric_name_extraction():
    assert metric_names('sum by (le, model) (rate(a_bucket{model=~"$model",le="0.1"}[$__rate_interval]))') == {"a_bucket"}
    assert metric_names("x / on (model) group_left sum by (model) (y) > 0.5 and z offset 5m") == {"x", "y", "z"}


def test_dashboard_is_grafana_json_with_a_datasource_variable():
    d = dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == ["Requests", "Phases", "KV cache", "Prefix cache", "Tensor-parallel ranks", "GPU", "Agent health",
                    "Prefix misses and KV residency"]
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])


def test_every_expression_uses_only_exposed_metrics():
    allowed = exposed_names() | recorded_names()
    used = set()
    for expr in expressions(dashboard()):
        names = metric_names(expr)
        assert names, expr
        assert names <= allowed, (expr, names - allowed)
        used |= names
    # and the dashboard covers the headline series
    for name in ("gen_ai_server_time_to_first_token_seconds_bucket", "phasescope_step_host_seconds_bucket",
                 "phasescope_kv_internal_fragmentation_ratio", "phasescope_prefix_hit_tokens_total",
                 "phasescope_kv_imbalance_ratio", "phasescope_gpu_utilization_ratio"):
        assert name in used, name


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (.ci/run installs it)")
def test_every_expression_parses_as_promql(tmp_path):
    """promtool parses each expression (as a recording rule, with Grafana's variables substituted)."""
    rules = [{"record": f"dashboard:expr_{i}",
              "expr": e.replace("$__rate_interval", "5m").replace("$model", ".*")}
             for i, e in enumerate(expressions(dashboard()))]
    path = tmp_path / "exprs.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([shutil.which("promtool"), "check", "rules", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
