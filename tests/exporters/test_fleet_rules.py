"""The fleet recording rules (issue 51): shipped as rendered from agent/read/promfleet.py, valid for promtool, and
right on hand-worked series (`promtool test rules`); `diagnose --prometheus` fails in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from phasescope.agent.read.promfleet import FIGURES, SIGNALS, recording_rules, render
from phasescope.exporters.rules import fleet_rules_text

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus; "
                                                              ".ci/run installs it)")
HERE = os.path.dirname(os.path.abspath(__file__))
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(HERE)), "exporters", "fleet_rules.yml")
CLI = [sys.executable, "-m", "phasescope.cli"]


def test_shipped_file_is_the_rendering_and_the_cli_prints_it():
    with open(SHIPPED, encoding="utf-8") as f:
        assert f.read() == recording_rules() == fleet_rules_text()
    out = subprocess.run(CLI + ["rules", "--fleet"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == fleet_rules_text()
    doc = yaml.safe_load(fleet_rules_text())
    records = [r["record"] for g in doc["groups"] for r in g["rules"]]
    assert len(records) == len(set(records))
    # every recorded figure is the PromQL diagnose --prometheus reads, grouped per model, deployment and pod
    exprs = {r["record"]: r["expr"] for g in doc["groups"] for r in g["rules"]}
    for f in FIGURES + SIGNALS:
        if f.record:
            assert exprs[f.record] == render(f.expr, "model, deployment, pod", "5m")
            assert "by (model, deployment, pod" in exprs[f.record]


def test_render_puts_the_selector_inside_every_vector_selector():
    q = render(FIGURES[0].expr, "pod", "2m", '{namespace="prod"}')
    assert q == ('histogram_quantile(0.5, sum by (pod, le) (rate(phasescope_step_host_seconds_bucket'
                 '{phase="decode", namespace="prod"}[2m])))')
    q = render(FIGURES[4].expr, "instance", "1h", 'job="x"')
    assert q.count('{job="x"}[1h]') == 2 and "by (instance)" in q


@needs_promtool
def test_promtool_check_rules():
    out = subprocess.run([PROMTOOL, "check", "rules", SHIPPED], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    n = sum(1 for line in fleet_rules_text().splitlines() if line.strip().startswith("- record:"))
    assert f"SUCCESS: {n} rules found" in out.stdout


def _tests_doc() -> dict:
    with open(os.path.join(HERE, "fleet_rules_test.yml"), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    doc["rule_files"] = [SHIPPED]
    return doc


@needs_promtool
def test_promtool_test_rules(tmp_path):
    path = tmp_path / "fleet_rules_test.yml"
    path.write_text(yaml.safe_dump(_tests_doc(), sort_keys=False))
    out = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


@needs_promtool
def test_promtool_test_rules_can_fail(tmp_path):
    """A wrong expected value (pod a's KV mean) makes promtool fail: the test above is real."""
    doc = _tests_doc()
    case = doc["tests"][0]["promql_expr_test"][0]
    case["exp_samples"][0]["value"] = 0.9
    path = tmp_path / "wrong.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0


@pytest.mark.parametrize("args, code, said", [
    (["--prometheus", "http://127.0.0.1:9"], 1, "cannot reach Prometheus at http://127.0.0.1:9"),
    (["--prometheus", "http://127.0.0.1:9", "--range", "10x"], 2, "--range takes a Prometheus duration"),
    (["--prometheus", "ftp://x"], 2, "--prometheus takes an http(s) URL"),
])
def test_bad_prometheus_input_is_one_line_and_non_zero(args, code, said):
    out = subprocess.run(CLI + ["diagnose", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == code, out
    assert out.stdout == "" and said in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


class _Stub:
    """A local HTTP server answering /api/v1/* with one fixed status and body (the failure cases only; the
    answers of a real Prometheus are test_fleet_prometheus.py's)."""

    def __init__(self, status: int, body: bytes) -> None:
        import http.server
        import threading

        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                self.send_response(stub.status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(stub.body)

            def log_message(self, *a):
                pass

        self.status, self.body = status, body
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("status, body, said", [
    (401, b'{"status":"error","error":"unauthorized"}', "refused the query (HTTP 401)"),
    (200, b'{"status":"success","data":{"resultType":"vector","result":[]}}', "no phasescope series with a 'pod' label"),
    (200, b"<html>not prometheus</html>", "did not answer with Prometheus's JSON"),
    (400, b'{"status":"error","errorType":"bad_data","error":"parse error"}', "answered HTTP 400: parse error"),
])
def test_prometheus_failures_are_one_line(status, body, said):
    stub = _Stub(status, body)
    try:
        out = subprocess.run(CLI + ["diagnose", "--prometheus", stub.url], capture_output=True, text=True,
                             timeout=60)
    finally:
        stub.close()
    assert out.returncode == 1, out
    assert said in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@needs_promtool
def test_the_agent_mode_remote_write_config_is_valid(tmp_path):
    """deploy/prometheus/agent-remote-write.yml passes `promtool check config --agent`. Debian's Prometheus is built
    without Kubernetes service discovery, so the check runs on the file with its kubernetes_sd_configs swapped for
    a static target: every other part (relabelling, remote_write, agent mode's restrictions) is checked as shipped."""
    src = os.path.join(os.path.dirname(os.path.dirname(HERE)), "deploy", "prometheus", "agent-remote-write.yml")
    with open(src, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    assert doc["scrape_configs"][0]["kubernetes_sd_configs"] == [{"role": "pod"}]
    assert {r.get("target_label") for r in doc["scrape_configs"][0]["relabel_configs"]} >= {"pod", "deployment"}
    for sc in doc["scrape_configs"]:
        sc.pop("kubernetes_sd_configs")
        sc["static_configs"] = [{"targets": ["127.0.0.1:1"]}]
    path = tmp_path / "agent.yml"
    path.write_text(yaml.safe_dump(doc))
    out = subprocess.run([PROMTOOL, "check", "config", "--agent", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_causes_at_their_thresholds():
    """Each cause a pod's Prometheus series can show, just below and at its threshold (pure: no server)."""
    from phasescope.agent.read.thresholds import T
    from phasescope.analyzers.fleet_prom import DEGRADE_RATIO, MIN_BUSY_SHARE, MIN_LONG_PREFILL_SHARE, causes

    near, wait, spike = T["near_cap"], T["min_cpu_wait_ratio"], T["itl_spike_ratio"]
    assert causes({}) == {}
    assert causes({"kv_block_usage_max": near - 0.01, "preemptions": 0}) == {}
    assert set(causes({"kv_block_usage_max": near})) == {"kv-bound"}
    assert set(causes({"kv_block_usage_max": 0.1, "preemptions": 1})) == {"kv-bound"}
    assert causes({"cpu_wait_ratio": wait - 0.01, "busy_share": 1.0}) == {}
    assert causes({"cpu_wait_ratio": wait, "busy_share": MIN_BUSY_SHARE - 0.01}) == {}  # an engine idle most of it
    assert causes({"cpu_wait_ratio": wait}) == {}  # no busy figure: not judged
    assert causes({"cpu_wait_ratio": wait, "busy_share": MIN_BUSY_SHARE})["host-bound"] == {
        "cpu_wait_ratio": wait, "busy_share": MIN_BUSY_SHARE}
    itl = {"itl_p50": 0.01, "long_prefill_itl_p90": spike * 0.01}
    assert causes({**itl, "long_prefill_itl_share": MIN_LONG_PREFILL_SHARE * 0.99}) == {}
    assert set(causes({**itl, "long_prefill_itl_share": MIN_LONG_PREFILL_SHARE})) == {"prefill-interference"}
    assert causes({**itl, "long_prefill_itl_share": 0.5, "long_prefill_itl_p90": spike * 0.01 * 0.99}) == {}
    assert causes({"ttft_p90_first_quarter": 1.0, "ttft_p90_last_quarter": DEGRADE_RATIO * 0.99}) == {}
    assert set(causes({"ttft_p90_first_quarter": 1.0, "ttft_p90_last_quarter": DEGRADE_RATIO})) == {"degrading"}
    assert causes({"ttft_p90_last_quarter": 9.0}) == {}  # nothing in the first quarter: no trend to judge


def test_findings_name_outliers_with_their_causes_and_carry_promql():
    """prometheus_findings on stated per-pod figures: the outlier pod named with its cause, one cause finding per
    pod and cause, each query filtered to its pod and the selector."""
    from phasescope.agent.read.promfleet import FIGURES, SIGNALS, render
    from phasescope.analyzers.fleet_prom import prometheus_findings

    pods = {"figures": {"a": {"ttft_s_p90": 0.5}, "b": {"ttft_s_p90": 0.6}, "c": {"ttft_s_p90": 3.0}},
            "signals": {"a": {}, "b": {}, "c": {"kv_block_usage_max": 1.0, "preemptions": 12.0}},
            "queries": {f.name: render(f.expr, "pod", "10m", 'ns="x"') for f in FIGURES + SIGNALS}, "missing": []}
    found = prometheus_findings(pods, range_="10m", selector='{ns="x"}')
    assert sorted((f.id, f.evidence["host"]) for f in found) == [("fleet-kv-bound", "c"), ("fleet-outlier-pod", "c")]
    out = next(f for f in found if f.id == "fleet-outlier-pod")
    assert out.evidence["figure"] == "ttft_s_p90" and out.evidence["ratio"] == 5.0 and "kv-bound" in out.title
    assert 'ns="x", pod="c"' in out.evidence["query"]
    kv = next(f for f in found if f.id == "fleet-kv-bound")
    assert all('ns="x", pod="c"' in q for q in kv.evidence["queries"].values())
    assert kv.evidence["preemptions"] == 12.0 and kv.summary and kv.action


def test_a_degrading_pods_promql_reads_both_quarters():
    """The evidence of `fleet-degrading` is the two queries its figures came from: the first quarter offset to the
    range's start, the last quarter ending now."""
    from phasescope.analyzers.fleet_prom import prometheus_findings

    pods = {"figures": {"a": {}, "b": {}, "c": {}},
            "signals": {"a": {}, "b": {}, "c": {"ttft_p90_first_quarter": 1.0, "ttft_p90_last_quarter": 2.0}},
            "queries": {f.name: render(f.expr, "pod", "40m") for f in FIGURES + SIGNALS}, "missing": []}
    (f,) = prometheus_findings(pods, range_="40m")
    assert f.id == "fleet-degrading"
    q = f.evidence["queries"]
    assert '[600s] offset 1800s)' in q["ttft_p90_first_quarter"] and 'pod="c"' in q["ttft_p90_first_quarter"]
    assert '[600s])' in q["ttft_p90_last_quarter"] and "offset" not in q["ttft_p90_last_quarter"]
