"""Scrape mode: a recorded vLLM /metrics text parsed into phasescope's records, and a real sidecar
polling a real HTTP endpoint."""

from __future__ import annotations

import http.server
import pathlib
import threading

import pytest

from phasescope.agent.records.events import PrefixCounters, RunLabel, ServerMetric
from phasescope.agent.sidecar.scrape import CANNOT, ScrapeCollector
from hang import HANG_S

SAMPLE = (pathlib.Path(__file__).parent / "vllm" / "metrics_sample.txt").read_text()


def test_parse_maps_prefix_counters_gauges_histograms_and_labels():
    c = ScrapeCollector("http://127.0.0.1:1/metrics", run_id="r", clock_ns=lambda: 7)
    recs = c.parse(SAMPLE)
    prefix = sorted((r for r in recs if type(r) is PrefixCounters), key=lambda r: r.rank)
    assert prefix == [PrefixCounters(7, 0, 4800, 2880, 0, 0), PrefixCounters(7, 1, 100, 32, 0, 0)]
    gauges = {(r.name, r.engine, r.labels): r.value for r in recs if type(r) is ServerMetric}
    assert gauges[("vllm:kv_cache_usage_perc", 1, "")] == 0.75
    assert gauges[("vllm:num_requests_waiting", 1, "")] == 2.0
    assert gauges[("vllm:time_to_first_token_seconds_bucket", 0, "le=0.1")] == 12.0
    assert gauges[("vllm:time_to_first_token_seconds_sum", 0, "")] == 1.5
    assert not any(n.endswith("_created") or n.startswith("python_") for n, _, _ in gauges)
    labels = {r.key: r.value for r in recs if type(r) is RunLabel}
    assert labels == {"block_size": "32", "num_gpu_blocks": "34", "enable_prefix_caching": "True",
                      "cache_dtype": "auto", "gpu_memory_utilization": "0.92"}
    assert not any(type(r) is RunLabel for r in c.parse(SAMPLE))  # labels once
    assert len(CANNOT) == 4


def test_bad_url_is_loud_unreachable_server_is_quiet():
    with pytest.raises(ValueError):
        ScrapeCollector("127.0.0.1:8000/metrics")
    c = ScrapeCollector("http://127.0.0.1:9/metrics", timeout_s=0.2)
    assert c.sample() == [] and c.failures == 1


def test_sidecar_scrapes_a_real_endpoint_into_its_own_source(short_tmp):
    duckdb = pytest.importorskip("duckdb")
    from phasescope.agent.sidecar import Sidecar

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = SAMPLE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    db = f"{short_tmp}/s.duckdb"
    col = ScrapeCollector(f"http://127.0.0.1:{srv.server_address[1]}/metrics", run_id="scr")
    side = Sidecar(db, listen=[f"unix:{short_tmp}/a.sock"], collectors=[col], sample_interval_s=0.05,
                   batch_interval_s=0.05).start()
    try:
        assert side.wait_rows(lambda: col.scrapes >= 3, timeout_s=HANG_S)
    finally:
        side.stop()
        srv.shutdown()
    con = duckdb.connect(db, read_only=True)
    (runtime, run_id), = con.execute("SELECT runtime, run_id FROM sources WHERE runtime = 'scrape'").fetchall()
    assert run_id == "scr"
    assert con.execute("SELECT max(queried_tokens_total) FROM prefix_counters WHERE rank = 0").fetchone()[0] == 4800
    assert con.execute("SELECT value FROM run_info WHERE run_id = 'scr' AND key = 'block_size'").fetchone()[0] == "32"
    per_engine = dict(con.execute("SELECT engine, max(value) FROM server_metrics "
                                  "WHERE name = 'vllm:kv_cache_usage_perc' GROUP BY engine").fetchall())
    assert per_engine == {0: 0.25, 1: 0.75}
