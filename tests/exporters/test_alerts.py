"""Alerting rules: their shape, `promtool check rules`, and `promtool test rules` on synthetic series."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from phasescope.exporters.rules import rules_text

HERE = os.path.dirname(__file__)
RULES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "exporters", "alerts.yml")
FINDINGS = {"prefill-stalls-decode", "ttft-queueing", "kv-near-cap", "kv-internal-fragmentation",
            "kv-external-fragmentation", "prefix-hit-collapse", "tp-kv-imbalance", "tp-straggler", "probe-dropping",
            "gpu-memory-near-full", "gpu-xid-errors", "host-bound", "process-memory-growth",
            "telemetry-{{ $labels.reason }}", "kv-evicted-before-reuse",
            "telemetry-store-fold-failed"}  # one alert for the telemetry-<reason> findings
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus; "
                                                             ".ci/run installs it)")


def alerts() -> dict[str, dict]:
    doc = yaml.safe_load(rules_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


def test_shipped_rules_are_the_repository_file():
    with open(RULES, encoding="utf-8") as f:
        assert rules_text() == f.read()


def test_every_alert_has_severity_annotations_and_a_runbook_naming_a_finding():
    seen = set()
    for name, rule in alerts().items():
        assert rule["labels"]["severity"] in {"page", "ticket", "warning", "critical"}, name
        ann = rule["annotations"]
        assert ann["summary"] and ann["description"], name
        m = re.match(r"phasescope finding ([a-z-]+(?:\{\{ \$labels\.reason \}\})?): \S", ann["runbook"])
        assert m and m.group(1) in FINDINGS, (name, ann["runbook"])
        seen.add(m.group(1))
    assert seen == FINDINGS  # every finding has an alert pointing to it
    assert len(alerts()) == 19


def _render(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: str(labels.get(m.group(1), "<no value>")), template)


def filled_tests(rule_file: str) -> dict:
    """alerts_test.yml with rule_files and every expected alert's annotations rendered from the rules."""
    with open(os.path.join(HERE, "alerts_test.yml"), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    rules = alerts()
    doc["rule_files"] = [rule_file]
    for group in doc["tests"]:
        for case in group.get("alert_rule_test", []):
            ann = rules[case["alertname"]]["annotations"]
            for exp in case["exp_alerts"]:
                labels = {k: str(v) for k, v in exp["exp_labels"].items()}
                exp["exp_labels"] = labels
                exp["exp_annotations"] = {k: _render(v, labels) for k, v in ann.items()}
    return doc


def test_every_alert_is_tested_firing_and_silent():
    doc = filled_tests(RULES)
    firing, silent = set(), set()
    for group in doc["tests"]:
        for case in group.get("alert_rule_test", []):
            (firing if case["exp_alerts"] else silent).add(case["alertname"])
    assert firing == set(alerts()) == silent


@needs_promtool
def test_promtool_check_rules():
    out = subprocess.run([PROMTOOL, "check", "rules", RULES], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 29 rules found" in out.stdout


@needs_promtool
def test_promtool_test_rules(tmp_path):
    path = tmp_path / "alerts_test.yml"
    path.write_text(yaml.safe_dump(filled_tests(RULES), sort_keys=False))
    out = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@needs_promtool
def test_promtool_test_rules_can_fail(tmp_path):
    """A wrong expectation (a healthy series firing) makes promtool fail: the tests above are real."""
    doc = filled_tests(RULES)
    case = doc["tests"][2]["alert_rule_test"][0]  # KV near cap
    case["exp_alerts"].append({"exp_labels": {"severity": "warning", "model": "m", "rank": "1"},
                               "exp_annotations": case["exp_alerts"][0]["exp_annotations"]})
    path = tmp_path / "wrong.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0


def test_one_table_of_thresholds_feeds_analyzers_queries_and_rules():
    import inspect

    from phasescope.agent.read import queries
    from phasescope.agent.read.thresholds import THRESHOLDS, T
    from phasescope.analyzers.diagnose import thresholds

    defaults = {n: v for params in thresholds().values() for n, v in params.items()}
    shared = [n for n in THRESHOLDS if not n.endswith("_slo_s")]
    for name in shared:
        assert defaults[name] == T[name], name
    assert inspect.signature(queries.interference).parameters["long_prefill_tokens"].default == \
        T["long_prefill_tokens"]
    assert inspect.signature(queries.slo_attainment).parameters["ttft_slo_s"].default == T["ttft_slo_s"]
    a = alerts()
    assert a["PhasescopeKVCacheNearCap"]["expr"].strip() == f"phasescope_kv_block_usage_ratio > {T['near_cap']:g}"
    assert f"> {T['max_external_fragmentation']:g}" in a["PhasescopeKVExternalFragmentationHigh"]["expr"]
    assert a["PhasescopeTPKVImbalance"]["expr"].strip() == f"phasescope_kv_imbalance_ratio > {T['max_imbalance']:g}"
    assert f'le="{T["max_skew"]:g}"' in a["PhasescopeTPStraggler"]["expr"]
    assert f'le="{T["ttft_slo_s"]:g}"' in rules_text() and "<<" not in rules_text()


def test_slos_are_options_of_phasescope_rules(capsys):
    from phasescope.cli.main import main

    assert main(["rules", "--ttft-slo-s", "1.0", "--tpot-slo-s", "0.05"]) == 0
    text = capsys.readouterr().out
    doc = yaml.safe_load(text)
    exprs = " ".join(r["expr"] for g in doc["groups"] for r in g["rules"])
    assert 'time_to_first_token_seconds_bucket{le="1"}' in exprs and 'le="2.5"' not in exprs
    assert 'time_per_output_token_seconds_bucket{le="0.05"}' in exprs
    rule = {r.get("alert"): r for g in doc["groups"] for r in g["rules"]}["PhasescopeTPOTBudgetBurnFast"]
    assert "slower than 50 ms per output token" in rule["annotations"]["description"]
    assert main(["rules", "--ttft-slo-s", "1.3"]) == 2  # not a bucket bound: the alert could never be computed
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "bucket bound" in err
