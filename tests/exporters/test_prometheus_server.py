"""A real Prometheus server scrapes the sidecar's /metrics while a workload runs; PromQL checks exact values.

Two producers feed one sidecar: crafted records over the socket (exact TTFT
count and a prefix-hit rate of exactly 0.75) and a real probe on a random-weight
HF Llama under `generate`. Prometheus also loads the shipped rule file, so the
recording rules are evaluated on real scrapes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from conftest import MODEL, T0, hello, request_events
from phasescope.agent.records.events import PrefixCounters, encode_frame
from phasescope.agent.sidecar import Sidecar
from phasescope.exporters.prometheus import MetricsServer, PrometheusExporter, SidecarStatsCollector
from hang import HANG_S

PROMETHEUS = shutil.which("prometheus")
RULES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "exporters", "alerts.yml")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus; "
                                                            ".ci/run installs it)")]


def _get(url: str, timeout_s: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read()


class PromServer:
    def __init__(self, base: str) -> None:
        self.base = base

    def query(self, q: str) -> list[dict]:
        body = json.loads(_get(f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": q})))
        assert body["status"] == "success", body
        return body["data"]["result"]

    def scalar(self, q: str) -> float | None:
        res = self.query(q)
        return float(res[0]["value"][1]) if res else None

    def wait(self, q: str, pred, timeout_s: float = 30.0) -> float | None:
        deadline = time.monotonic() + timeout_s
        value = None
        while time.monotonic() < deadline:
            value = self.scalar(q)
            if value is not None and pred(value):
                return value
            time.sleep(0.25)
        return value


@pytest.fixture
def stack(short_tmp):
    """Sidecar + Prometheus exporter on 127.0.0.1 + a real prometheus scraping it every second."""
    reg = CollectorRegistry()
    prom = PrometheusExporter(reg)
    sc = Sidecar(os.path.join(short_tmp, "s.duckdb"), listen=[f"unix:{short_tmp}/a.sock"], batch_interval_s=0.05,
                 sinks=[prom])
    reg.register(SidecarStatsCollector(sc.stats))
    metrics = MetricsServer(reg, "127.0.0.1:0").start()
    sc.start()
    cfg = os.path.join(short_tmp, "prometheus.yml")
    with open(cfg, "w") as f:
        f.write(f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: ["{RULES}"]
scrape_configs:
  - job_name: phasescope
    static_configs:
      - targets: ["127.0.0.1:{metrics.port}"]
""")
    log = open(os.path.join(short_tmp, "prometheus.log"), "wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={short_tmp}/tsdb",
                             "--web.listen-address=127.0.0.1:0"], stdout=log, stderr=subprocess.STDOUT)
    base = None  # Prometheus binds port 0 itself and logs the address it got: msg="Listening on" address=...
    try:
        deadline = time.monotonic() + HANG_S
        while True:
            assert proc.poll() is None, open(log.name).read()[-2000:]
            if base is None:
                m = re.search(r'msg="Listening on" address=(127\.0\.0\.1:\d+)', open(log.name).read())
                base = f"http://{m.group(1)}" if m else None
            try:
                if base is None:
                    raise OSError("not listening yet")
                if _get(f"{base}/-/ready", 1) is not None:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        yield sc, PromServer(base), short_tmp
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
        sc.stop()
        metrics.close()


def _run_probe(tiny_llama, socket_path: str) -> tuple[str, int, int]:
    """Three requests through a real probe on `generate`; returns (model name, requests, forwards)."""
    import torch

    from phasescope.agent import attach
    from phasescope.agent.probe.adapters.hf_generate import GenerateRequests

    rows = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [9, 9, 9, 9, 9]]
    width = max(map(len, rows))
    ids = torch.zeros((3, width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    new_tokens = 5
    with attach(tiny_llama, agent=f"unix:{socket_path}", runtime="hf-generate", model_name="tiny-probe") as probe:
        tracker = GenerateRequests(probe, ["p0", "p1", "p2"], [len(r) for r in rows])
        with torch.inference_mode():
            tiny_llama.generate(input_ids=ids, attention_mask=mask, streamer=tracker, max_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=0, eos_token_id=None)
        tracker.finish([new_tokens, 3, 1])
    return probe.model_name, 3, new_tokens


def test_promql_over_real_scrapes_returns_exact_ttft_count_and_prefix_hit_rate(stack, tiny_llama):
    sc, prom, tmp = stack
    path = sc.bound[0].path
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    try:
        s.sendall(encode_frame([hello(0, 1)] + request_events()))
        # prefix counters over time: every snapshot holds hit = 0.75 * queried
        q = prom.wait(f'sum(gen_ai_server_time_to_first_token_seconds_count{{model="{MODEL}"}})', lambda v: v >= 4)
        assert q == 4  # r1..r4 got a first token; r5 is still queued
        for i in range(1, 13):
            s.sendall(encode_frame([PrefixCounters(T0 + i, 0, 400 * i, 300 * i, 0, 0)]))
            time.sleep(0.4)
        model, n_requests, forwards = _run_probe(tiny_llama, path)
        rate_q = (f'sum(rate(phasescope_prefix_hit_tokens_total{{model="{MODEL}"}}[1m])) '
                  f'/ sum(rate(phasescope_prefix_queried_tokens_total{{model="{MODEL}"}}[1m]))')
        hit_rate = prom.wait(rate_q, lambda v: True)
        assert hit_rate == pytest.approx(0.75, rel=1e-12)
        # the shipped recording rule, evaluated by Prometheus on the same scrapes
        recorded = prom.wait(f'phasescope:prefix_hit_ratio:rate10m{{model="{MODEL}"}}', lambda v: True)
        assert recorded == pytest.approx(0.75, rel=1e-12)
        # the real probe: one TTFT per request, one step per forward
        assert prom.wait(f'sum(gen_ai_server_time_to_first_token_seconds_count{{model="{model}"}})',
                         lambda v: v >= n_requests) == n_requests
        assert prom.wait(f'sum(phasescope_step_host_seconds_count{{model="{model}"}})',
                         lambda v: v >= forwards) == forwards
        # TPOT only for the requests with more than one output token (5 and 3 tokens, not 1)
        assert prom.wait(f'sum(gen_ai_server_time_per_output_token_seconds_count{{model="{model}"}})',
                         lambda v: v >= 2) == 2
        # crafted TTFTs: .11, .32, .10 under 2.5 s, 3.0 over
        assert prom.scalar(f'sum(gen_ai_server_time_to_first_token_seconds_bucket{{model="{MODEL}",le="2.5"}})') == 3
        assert prom.scalar("sum(phasescope_sidecar_bad_frames_total)") == 0
        ups = prom.query('up{job="phasescope"}')
        assert [float(u["value"][1]) for u in ups] == [1.0]
    finally:
        s.close()
    print(f"\nPromQL: TTFT count {q:.0f}, prefix hit rate {hit_rate!r}, recorded {recorded!r}")
