"""`phasescope agent` with /metrics and --otlp as a real process, and `phasescope rules`."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import MODEL, send_workload
from phasescope.exporters.rules import dashboard_text, rules_text
from hang import HANG_S, HTTP_S

CLI = [sys.executable, "-m", "phasescope.cli"]


def _metrics_url(line: str) -> str:
    """The /metrics URL `phasescope agent` prints once it listens (it bound port 0: the port is its own)."""
    m = re.search(r"metrics on (http://\S+/metrics)", line)
    assert m, line
    return m.group(1)


def test_rules_prints_the_shipped_rule_file_and_dashboard():
    out = subprocess.run(CLI + ["rules"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == rules_text()
    out = subprocess.run(CLI + ["rules", "--grafana"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == dashboard_text()


@pytest.mark.slow
def test_agent_serves_metrics_and_exports_otlp(short_tmp, otlp_receiver):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=otlp_receiver.endpoint, OTEL_SERVICE_NAME="agent-under-test")
    sock = os.path.join(short_tmp, "a.sock")
    proc = subprocess.Popen(CLI + ["agent", "--db", os.path.join(short_tmp, "a.duckdb"), "--listen", f"unix:{sock}",
                                   "--metrics-addr", "127.0.0.1:0", "--api", "127.0.0.1:0", "--otlp",
                                   "--otlp-interval-s", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "listening" in line, line
        metrics = _metrics_url(line)
        assert metrics.startswith("http://127.0.0.1:") and "read API on http://127.0.0.1:" in line, line
        send_workload(sock)
        want = f'gen_ai_server_time_to_first_token_seconds_count{{model="{MODEL}"}} 4.0'
        text = ""
        deadline = time.monotonic() + HANG_S
        while want not in text and time.monotonic() < deadline:
            time.sleep(0.2)
            with urllib.request.urlopen(metrics, timeout=HTTP_S) as resp:
                text = resp.read().decode()
        assert want in text
        assert 'phasescope_otlp_exports_total{signal="metrics"}' in text
        assert "phasescope_sidecar_records_total" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "stopped" in out
    # on SIGTERM the OTLP exporter flushed: the 4 ended requests' spans arrived with the env's service name
    roots = [s for s in otlp_receiver.spans() if not s.parent_span_id]
    assert len(roots) == 4
    res = otlp_receiver.traces[0].resource_spans[0].resource
    assert {a.key: a.value.string_value for a in res.attributes}["service.name"] == "agent-under-test"
    assert "gen_ai.server.time_to_first_token" in otlp_receiver.last_metrics()


def test_agent_refuses_an_explicit_metrics_address_in_use(short_tmp):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        out = subprocess.run(CLI + ["agent", "--db", os.path.join(short_tmp, "b.duckdb"), "--listen",
                                    f"unix:{short_tmp}/b.sock", "--no-api", "--metrics-addr",
                                    f"127.0.0.1:{taken.getsockname()[1]}"],
                             capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert out.returncode != 0
    assert "cannot serve /metrics" in out.stderr


@pytest.mark.slow
def test_agent_samples_a_pid_and_the_host(short_tmp):
    """`phasescope agent --pid P`: P's CPU, memory and files and the host's appear on /metrics and in the store."""
    sock = os.path.join(short_tmp, "h.sock")
    db = os.path.join(short_tmp, "h.duckdb")
    server = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: sum(range(10**5)); time.sleep(0.01)"])
    proc = subprocess.Popen(CLI + ["agent", "--db", db, "--listen", f"unix:{sock}", "--metrics-addr",
                                   "127.0.0.1:0", "--no-api", "--no-retention", "--sample-s", "0.2",
                                   "--pid", str(server.pid)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = _metrics_url(proc.stdout.readline())
        want = f'phasescope_process_resident_memory_bytes{{pid="{server.pid}",run_id=""}}'
        text = ""
        deadline = time.monotonic() + HANG_S
        while want not in text and time.monotonic() < deadline:
            time.sleep(0.3)
            with urllib.request.urlopen(metrics, timeout=HTTP_S) as resp:
                text = resp.read().decode()
        assert want in text
        assert f'phasescope_process_cpu_seconds_total{{mode="user",pid="{server.pid}",run_id=""}}' in text
        assert f"phasescope_host_cpus {float(os.cpu_count())}" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        server.kill()
        server.wait()
    assert proc.returncode == 0, out
    import duckdb

    con = duckdb.connect(db, read_only=True)
    try:
        n, pid = con.execute("SELECT count(*), any_value(pid) FROM process_samples").fetchone()
    finally:
        con.close()
    assert n >= 5 and pid == server.pid
