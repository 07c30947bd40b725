"""The fleet over a real Prometheus (issue 51): three real agents, each fed by a real probe on a random-weight HF
Llama with a known behaviour (KV-pressured, host-bound, healthy: the demo scenarios of tests/builders), scraped by a
real Prometheus server that also evaluates the shipped fleet recording rules. `phasescope diagnose --prometheus`
must name the right pod and cause, agree with the Parquet path on the same runs, and every panel query of the
shipped Grafana dashboard must return data from that Prometheus."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import duckdb
import pytest

from conftest import T0, hello, send_workload
from phasescope.agent.read.thresholds import T
from hang import HANG_S, HTTP_S

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "phasescope.cli"]
# pod -> the scenario its server runs (tests/builders/scenarios.py)
PODS = {"pod-kv": "kv-pressure", "pod-ok": "healthy", "pod-host": "host-bound"}
# the host-bound pod serves its workload at a rate that keeps its engine stepping throughout: at the scenario's
# 2 requests/s an engine starved further by a loaded CI machine went idle between arrivals in most samples, near
# the busy-share threshold (CI on 2026-12-07: 4 of 17 samples), where the two paths' samples may fall either side
OVERRIDES = {"pod-host": ["requests=48", "arrival_rate_per_s=6.0"]}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus; "
                                                            ".ci/run installs it)")]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=HTTP_S) as resp:
        return json.loads(resp.read())


def _query(base: str, q: str) -> list[dict]:
    body = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": q}))
    assert body["status"] == "success", body
    return body["data"]["result"]


def _export(db: str, root: str, host: str) -> None:
    """The store's tables as the agent's Parquet exports lay them out (host=/date=/table=)."""
    con = duckdb.connect(db, read_only=True)
    try:
        from phasescope.agent.records.schema import TABLES

        day = datetime.date.today().isoformat()
        have = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
        for t in [*TABLES, "run_info"]:
            if t not in have or not con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]:
                continue
            d = os.path.join(root, f"host={host}", f"date={day}", f"table={t}")
            os.makedirs(d, exist_ok=True)
            con.execute(f"COPY (SELECT * FROM {t}) TO '{d}/part-0.parquet' (FORMAT parquet)")
    finally:
        con.close()


def _store_host(db: str, run_id: str) -> dict:
    """The host-bound analyzer's process figures (analyzers/host.py PROCESS_SQL) of `run_id` in the agent's store."""
    from phasescope.analyzers.host import PROCESS_SQL
    from phasescope.analyzers.sql import one

    con = duckdb.connect(db, read_only=True)
    try:
        p = one(con, PROCESS_SQL, run_id)
    finally:
        con.close()
    return {k: p[k] for k in ("process_samples", "busy_samples", "cpu_wait_ratio")}


def _send_eviction_reuse(sock: str) -> None:
    """Two lookups of a probe whose adapter follows evicted prefix pages (vLLM's; the HF probes here do not): the
    second missed 64 shared tokens whose pages were evicted 250 ms before, what the eviction-to-reuse panel shows."""
    import socket

    from phasescope.agent.records.events import PrefixLookup, encode_frame

    recs = [hello(0, 1)._replace(run_id="run-evict", pid=300),
            PrefixLookup(T0 + 10**6, 0, "e1", "first", 16, 128, 112, 0, 0, 0, float("nan"), 8, 0),
            PrefixLookup(T0 + 2 * 10**6, 0, "e2", "first", 16, 128, 112, 48, 112, 64, 250.0, 8, 0)]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(sock)
        s.sendall(encode_frame(recs))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Three agents, Prometheus scraping them every second with the fleet rules loaded, and the three pods' runs
    served one after another (each alone on the machine, as its scenario states). Yields a dict of what ran."""
    tmp = str(tmp_path_factory.mktemp("fleet"))
    short = tmp if len(tmp) < 60 else __import__("tempfile").mkdtemp(prefix="ps-fleet-", dir="/tmp")
    agents, targets = {}, {}
    procs = []
    try:
        # the three pods, and one agent beside them (deployment "extras", left out of the fleet by --selector) fed
        # crafted records of what a CPU probe never sends (two TP ranks) and exporting OTLP to nowhere, so the
        # dashboard's panels about those have series too
        for pod in list(PODS) + ["extras"]:
            sock = os.path.join(short, f"{pod}.sock")
            otlp_args = ["--otlp", "--otlp-interval-s", "1"] if pod == "extras" else []
            env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9") if pod == "extras" else None
            p = subprocess.Popen(CLI + ["agent", "--db", os.path.join(tmp, f"{pod}.duckdb"), "--listen",
                                        f"unix:{sock}", "--metrics-addr", "127.0.0.1:0", "--no-api",
                                        "--sample-s", "0.5", "--no-retention", *otlp_args],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            procs.append(p)
            line = p.stdout.readline()
            m = re.search(r"metrics on http://(\S+)/metrics", line)
            assert m, line
            agents[pod] = (p, sock)
            targets[pod] = m.group(1)
        for name in ("fleet_rules.yml", "alerts.yml"):
            shutil.copy(os.path.join(ROOT, "exporters", name), os.path.join(tmp, name))
        cfg = os.path.join(tmp, "prometheus.yml")
        with open(cfg, "w", encoding="utf-8") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    "rule_files: [fleet_rules.yml, alerts.yml]\nscrape_configs:\n")
            for pod, target in targets.items():
                f.write(f"  - job_name: {pod}\n    static_configs:\n      - targets: ['{target}']\n"
                        f"        labels: {{pod: {pod}, deployment: {'extras' if pod == 'extras' else 'demo'}}}\n")
        log_path = os.path.join(tmp, "prometheus.log")
        log = open(log_path, "wb")
        prom = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp}/tsdb",
                                 "--web.listen-address=127.0.0.1:0"], stdout=log, stderr=subprocess.STDOUT)
        procs.append(prom)
        base = None  # Prometheus binds port 0 itself and logs the address it got: msg="Listening on" address=...
        deadline = time.monotonic() + HANG_S
        while base is None:
            assert prom.poll() is None, open(log_path).read()[-2000:]
            m = re.search(r'msg="Listening on" address=(127\.0\.0\.1:\d+)', open(log_path).read())
            base = f"http://{m.group(1)}" if m else None
            assert time.monotonic() < deadline, "prometheus did not say where it listens"
            time.sleep(0.2)
        up = lambda: len([r for r in _query(base, "up == 1")])  # noqa: E731
        deadline = time.monotonic() + HANG_S
        while up() < len(PODS) + 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert up() == len(PODS) + 1, _query(base, "up")
        send_workload(agents["extras"][1])
        _send_eviction_reuse(agents["extras"][1])
        t0 = time.time()
        runs = {}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]))
        for pod, scenario in PODS.items():
            out = subprocess.run([sys.executable, "-m", "builders.fleet_pod", scenario, f"unix:{agents[pod][1]}",
                                  *OVERRIDES.get(pod, [])],
                                 capture_output=True, text=True, env=env, timeout=HANG_S * 4)
            assert out.returncode == 0, out.stderr[-3000:]
            runs[pod] = out.stdout.strip().splitlines()[-1]
        time.sleep(3)  # the last samples scraped and the rules evaluated on them
        # the agents stop (their stores checkpointed and free for the Parquet path); Prometheus keeps what it
        # scraped, and every figure is read over a range that ends now
        for pod, (p, _) in agents.items():
            p.send_signal(signal.SIGTERM)
        for pod, (p, _) in agents.items():
            out, _ = p.communicate(timeout=HANG_S)
            assert p.returncode == 0, out[-2000:]
        yield {"base": base, "tmp": tmp, "runs": runs, "t0": t0}
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def _range(fleet) -> str:
    """A window from just before the first pod's run to now (each test reads at its own time)."""
    return f"{int(time.time() - fleet['t0']) + 5}s"


def test_prometheus_path_names_the_pods_and_causes_and_agrees_with_parquet(fleet):
    base, span = fleet["base"], _range(fleet)
    out = subprocess.run(CLI + ["diagnose", "--prometheus", base, "--range", span, "--selector",
                                '{deployment="demo"}', "--json"], capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report["pods"]) == set(PODS), report["pods"]
    causes = {pod: {f["evidence"]["cause"] for f in report["findings"]
                    if f["id"].startswith("fleet-") and f["evidence"]["host"] == pod and "cause" in f["evidence"]}
              for pod in PODS}
    # the Parquet path on the same runs: each agent's store as its exports, read by `diagnose --fleet`
    exp = os.path.join(fleet["tmp"], "exports")
    for pod in PODS:
        _export(os.path.join(fleet["tmp"], f"{pod}.duckdb"), exp, pod)
    pq = subprocess.run(CLI + ["diagnose", "--fleet", os.path.join(exp, "**", "*.parquet"), "--json"],
                        capture_output=True, text=True, timeout=HANG_S * 2)
    assert pq.returncode == 0, pq.stderr
    parquet = json.loads(pq.stdout)
    per_pod = {pod: {f["id"] for f in fs} for pod, fs in parquet["host_findings"].items()}
    store_host = {pod: _store_host(os.path.join(fleet["tmp"], f"{pod}.duckdb"), fleet["runs"][pod]) for pod in PODS}
    print(json.dumps({"causes": causes, "parquet": per_pod, "prom_pods": report["pods"], "store_host": store_host,
                      "signals": report["signals"], "parquet_hosts": parquet["hosts"]}, indent=1, default=str))
    # the designed causes, from Prometheus alone
    assert "kv-bound" in causes["pod-kv"]
    assert "host-bound" in causes["pod-host"]
    assert "kv-bound" not in causes["pod-ok"], causes
    if "host-bound" in causes["pod-ok"]:
        # the healthy pod starved for real: the other pytest worker beside it on a 2-core CI machine (CI of
        # 2026-12-07: its busiest thread waited 46% of its busy samples, busy in 35% of the scrapes). Not a false
        # alarm only where the pod's own store saw the same wait over its busy samples (analyzers/host.py's
        # figure; Prometheus sees one process sample in five, the agent's handover, so its busy share may cross
        # the 25% bar where the store's stays under it)
        assert (store_host["pod-ok"]["cpu_wait_ratio"] or 0) >= T["min_cpu_wait_ratio"], (causes, store_host)
    # and the same causes as each pod's own store says (the Parquet path's per-host diagnosis)
    assert {"kv-near-cap", "preemption-recompute"} & per_pod["pod-kv"], per_pod
    assert "host-bound" in per_pod["pod-host"], per_pod
    for pod in PODS:
        # a pod Prometheus calls clearly host-bound (0.1 past both thresholds) is host-bound in its store too, and
        # KV-bound likewise; a loaded CI machine may starve a pod the scenario did not: then both paths say so
        # (near a threshold the two paths' samples - the gauges as scraped, the store's busy samples - may differ)
        sig = report["signals"][pod]
        if "host-bound" in causes[pod] and sig["cpu_wait_ratio"] >= 0.45 and sig["busy_share"] >= 0.35:
            # the store names it, or its busy samples show the same wait and only its busy share stayed under the
            # bar (it reads every sample; Prometheus one in five)
            same_wait = (store_host[pod]["cpu_wait_ratio"] or 0) >= T["min_cpu_wait_ratio"]
            assert "host-bound" in per_pod[pod] or same_wait, (pod, causes, per_pod, store_host)
        if "kv-bound" in causes[pod]:
            assert {"kv-near-cap", "preemption-recompute"} & per_pod[pod], (pod, causes, per_pod)
    # outliers: where a figure's ratio to the fleet median is clearly over (or under) the 1.5 threshold on one
    # path, the other path agrees (bucket interpolation against exact quantiles moves a ratio near the threshold)
    prom_out = {(f["evidence"]["host"], f["evidence"]["figure"]): f["evidence"]["ratio"]
                for f in report["findings"] if f["id"] == "fleet-outlier-pod"}
    pq_out = {(f["evidence"]["host"], f["evidence"]["figure"]): f["evidence"]["ratio"] for f in parquet["findings"]}
    assert prom_out, report["findings"]
    for figure in {f for _, f in prom_out} | {f for _, f in pq_out}:
        for pod in PODS:
            a, b = report["pods"][pod].get(figure), parquet["hosts"][pod].get(figure)
            if a is None or b is None:
                continue
            med_a = sorted(v[figure] for v in report["pods"].values() if v.get(figure) is not None)
            med_b = sorted(v.get(figure) for v in parquet["hosts"].values() if v.get(figure) is not None)
            ra, rb = a / med_a[len(med_a) // 2], b / med_b[len(med_b) // 2]
            if min(ra, rb) >= 2.0:
                assert (pod, figure) in prom_out and (pod, figure) in pq_out, (pod, figure, ra, rb)
            if max(ra, rb) < 1.2:
                assert (pod, figure) not in prom_out and (pod, figure) not in pq_out, (pod, figure, ra, rb)
    # every finding carries PromQL a person can paste into Grafana, filtered to its pod
    for f in report["findings"]:
        qs = list(f["evidence"]["queries"].values()) if "queries" in f["evidence"] else [f["evidence"]["query"]]
        for q in qs:
            assert f'pod="{f["evidence"]["host"]}"' in q
            assert _query(base, q) is not None  # it parses and runs


def test_the_fleet_recording_rules_are_evaluated_on_the_scrapes(fleet):
    base = fleet["base"]
    kv = {r["metric"]["pod"]: float(r["value"][1]) for r in _query(base, "phasescope_fleet:kv_block_usage:max")}
    assert set(PODS) <= set(kv) and kv["pod-kv"] >= 0.9 > kv["pod-ok"], kv
    steps = _query(base, 'phasescope_fleet:step_seconds:p50{phase="decode", deployment="demo"}')
    assert {r["metric"]["pod"] for r in steps} == set(PODS), steps


def _query_range(base: str, q: str, start: float, end: float, step_s: float = 5.0) -> list[dict]:
    """What Grafana asks a panel's data source for: the expression over a time range (/api/v1/query_range)."""
    body = _get(f"{base}/api/v1/query_range?" + urllib.parse.urlencode(
        {"query": q, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}"}))
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_every_grafana_panel_query_returns_data(fleet):
    """Every panel's expression, asked as Grafana asks it (a range query over the fleet's runs), returns series;
    the GPU panels only where there is a GPU (this machine has none: the agents' NVML collector sends no sample,
    and those panels' queries must still be valid)."""
    from phasescope.exporters.rules import dashboard_text

    base, start, end = fleet["base"], fleet["t0"], time.time()
    gpu = bool(_query_range(base, "phasescope_gpu_utilization_ratio", start, end))
    dash = json.loads(dashboard_text())
    panels = [p for p in dash["panels"] for p in ([p] + p.get("panels", []))]
    empty = []
    n = 0
    for p in panels:
        for t in p.get("targets", []):
            expr = t.get("expr")
            if not expr:
                continue
            n += 1
            q = (expr.replace("$__rate_interval", "1m").replace("$__interval", "15s").replace("$__range", "5m")
                 .replace("$model", ".*").replace('=~".*"', '=~".*"'))
            q = re.sub(r"\$\{?\w+\}?", ".*", q)
            if not _query_range(base, q, start, end) and (gpu or "phasescope_gpu_" not in q):
                empty.append((p.get("title"), q))
    assert n > 0
    assert not empty, "\n".join(f"{t}: {q}" for t, q in empty)


def test_the_dashboards_fleet_page_reads_that_prometheus(fleet, monkeypatch):
    """The app with a Prometheus source (`phasescope dashboard --prometheus URL`): its Fleet page shows every pod's
    figures and the same findings as `diagnose --prometheus`, each with its PromQL."""
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    from phasescope.analyzers.fleet_prom import diagnose_prometheus

    monkeypatch.setenv("PHASESCOPE_TARGET", os.path.join(fleet["tmp"], "pod-ok.duckdb"))
    monkeypatch.setenv("PHASESCOPE_PROMETHEUS", fleet["base"])
    at = AppTest.from_file(os.path.join(ROOT, "dashboard", "app.py"), default_timeout=120)
    at.run()
    assert not at.exception
    at.sidebar.radio(key="page").set_value("Fleet").run()
    span = _range(fleet)
    at.sidebar.text_input(key="prom_range").set_value(span).run()
    at.sidebar.text_input(key="prom_selector").set_value('{deployment="demo"}').run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    table = at.dataframe[0].value
    assert set(table.index) == set(PODS)
    want = diagnose_prometheus(fleet["base"], selector='{deployment="demo"}', range_=span)
    shown = [e.label for e in at.expander]
    # (read a moment apart: a ratio's last digits may move, the pods, figures and causes named may not)
    assert len(shown) == len(want["findings"]), (shown, [f["title"] for f in want["findings"]])
    assert all(f["title"].split(" is ")[0] in " ".join(shown) for f in want["findings"]), shown
    assert len(at.code) >= len(want["findings"])
