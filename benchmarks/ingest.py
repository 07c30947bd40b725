"""Sidecar ingest rate: records/s from probes to committed-and-acknowledged rows, against DuckDB's own bulk
append of the same rows measured in the same run, and the agent's peak RSS.

Each run starts `phasescope agent` (a subprocess, as deployed) on a fresh file; N producer processes
stream pre-encoded frames (8192 records, the probe's frame size) through the probe's real `Sender`
(wire v2: windowed, acknowledged): Step records alone, or with `--mix probe` a decoding probe's interleaved
records (a Step, its 8 token events, a KV snapshot every 16 steps; the baseline stays Step rows). The rate is stored rows / (first send -> last acknowledgement), and
`delivered == stored` is checked. The baseline appends the same number of rows, already as an Arrow
table with the store's column types, in one `INSERT ... SELECT` into a fresh file with the same schema.
With `--metrics` the agent runs its Prometheus exporter (a sink); at the end its /metrics is scraped: steps
the sink observed (sum of `phasescope_step_host_seconds_count`) against stored, and
`phasescope_sidecar_sink_dropped_records_total` (what the sinks missed because they lagged).
With `--otlp` the agent also exports OTLP/HTTP (`phasescope agent --otlp`, its /metrics on too) to a receiver
in this process that decodes the real protobuf requests; after the agent is stopped (its OTLP exporter
flushes on shutdown) the `phasescope.step.duration` count of the last export (cumulative) is the steps
the OTLP sink saw, against stored and the sink drops.

    python benchmarks/ingest.py [--records 2000000] [--producers 1 4 16] [--repeat 3] [--mix steps|probe]
                                [--metrics] [--otlp]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

import psutil


def _records(n_records: int, rank: int, mix: str) -> list:
    """`steps`: Step records alone (frames of one type). `probe`: what a probe sends while decoding 8
    sequences of 256 tokens: each Step followed by its 8 token events, a KV snapshot every 16 steps
    (interleaved types)."""
    from phasescope.agent.records import events as ev

    nan = float("nan")
    if mix == "steps":
        return [ev.Step(1_000 + j, j, rank, ev.PHASE_DECODE, 8, 0, 8, 4096 + j, 1.5, nan) for j in range(n_records)]
    out, j = [], 0
    while len(out) < n_records:
        ts = 1_000 + 10 * j
        out.append(ev.Step(ts, j, rank, ev.PHASE_DECODE, 8, 0, 8, 4096 + 8 * j, 1.5, nan))
        # 8 sequences of 256 output tokens each, each replaced by a new request when it ends
        out += [ev.RequestEvent(ts + 1, rank, ev.REQ_TOKEN, f"req-{rank}-{k}-{j // 256}", 1, 0) for k in range(8)]
        if j % 16 == 0:
            out.append(ev.KVSnapshot(ts + 2, rank, 16, 4096, 2048, 2048, 0, 0, 0, 8, 4096 + 8 * j, 2048, j, j,
                                     2 << 30, "float16"))
        j += 1
    return out[:n_records]


def _frames(n_records: int, frame_records: int, rank: int, mix: str = "steps") -> list[bytes]:
    from phasescope.agent.records import events as ev

    recs = _records(n_records, rank, mix)
    return [ev.encode_frame(recs[i:i + frame_records]) for i in range(0, len(recs), frame_records)]


def _producer(sock: str, n_records: int, rank: int, ready, go, results, mix: str = "steps") -> None:
    from phasescope.agent.records import events as ev
    from phasescope.agent.records.address import parse_address
    from phasescope.agent.probe.sender import Sender

    frames = _frames(n_records, 8192, rank, mix)
    hello = lambda: ev.encode_frame([ev.Hello(time.monotonic_ns(), 0, os.getpid(), rank, 1, "bench", "m", "bench")])
    s = Sender(parse_address(f"unix:{sock}"), hello, drain_s=60)  # the probe's default window (32 MiB)
    while not s.ready():
        time.sleep(0.01)
    ready.put(rank)
    go.wait()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for f in frames:
        while not s.send(f):  # the window is full: wait for acks (a probe would drop and count here)
            s.wait_room(0.05)
    s.close()  # waits for the last acknowledgements
    results.put((t0, time.perf_counter(), s.sent, s.delivered, s.lost, time.process_time() - cpu0))


class OtlpStepReceiver:
    """OTLP/HTTP receiver (a thread of this process) decoding POST /v1/metrics with the real protobuf messages;
    keeps, per export, the total count of `phasescope.step.duration` data points (and whether it was cumulative)."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

        self.step_counts: list[tuple[int, bool]] = []  # (count, cumulative) per export that held the metric
        self.requests = 0
        rx = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    import gzip

                    body = gzip.decompress(body)
                if self.path == "/v1/metrics":
                    msg = ExportMetricsServiceRequest()
                    msg.ParseFromString(body)
                    rx.requests += 1
                    for rm in msg.resource_metrics:
                        for sm in rm.scope_metrics:
                            for m in sm.metrics:
                                if m.name == "phasescope.step.duration":
                                    rx.step_counts.append((sum(dp.count for dp in m.histogram.data_points),
                                                           m.histogram.aggregation_temporality == 2))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def steps_seen(self) -> int:
        """Steps in the step-duration histogram: the last export's count (cumulative), or the sum (delta)."""
        if not self.step_counts:
            return 0
        if all(cum for _, cum in self.step_counts):
            return self.step_counts[-1][0]
        return sum(c for c, _ in self.step_counts)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _agent(db: str, sock: str, metrics: bool, otlp: str | None = None,
           extra: Sequence[str] = ()) -> tuple[subprocess.Popen, str | None]:
    args = [sys.executable, "-m", "phasescope.cli", "agent", "--db", db, "--listen", f"unix:{sock}", "--no-api",
            "--no-retention", *extra]
    args += ["--metrics-addr", "127.0.0.1:0"] if metrics or otlp else ["--no-metrics"]
    env = None
    if otlp:
        args += ["--otlp"]  # the default export interval (10 s); the agent flushes on shutdown
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = proc.stdout.readline()
    if "listening" not in line:
        raise RuntimeError(f"agent did not start: {line!r}")
    url = line.split("metrics on ", 1)[1].split(";", 1)[0].strip() if "metrics on " in line else None
    return proc, url


def _scrape(url: str) -> dict[str, float]:
    """What the agent's /metrics says the Prometheus sink saw: steps observed (sum of the
    `phasescope_step_host_seconds` counts) and decode tokens; and the sidecar's sink counters."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    out = {"sink_steps_seen": 0.0, "sink_decode_tokens": 0.0, "sink_dropped_records": 0.0, "sink_errors": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "phasescope_step_host_seconds_count":
                out["sink_steps_seen"] += s.value
            elif s.name == "phasescope_step_tokens_total" and s.labels.get("kind") == "decode":
                out["sink_decode_tokens"] += s.value
            elif s.name == "phasescope_sidecar_sink_dropped_records_total":
                out["sink_dropped_records"] = s.value
            elif s.name == "phasescope_sidecar_sink_errors_total":
                out["sink_errors"] = s.value
    return out


def _sink_figures(url: str, expect: int, settle_s: float = 60.0) -> dict:
    """Scrape /metrics when the last record is acknowledged and again once the sink stops moving (it may
    still be working through its queue): seen at the end, seen once settled, and how long that took."""
    t0 = time.perf_counter()
    first = _scrape(url)
    last, moved = first, t0
    while time.perf_counter() - t0 < settle_s:
        if last["sink_steps_seen"] + last["sink_dropped_records"] >= expect:
            break
        time.sleep(0.25)
        cur = _scrape(url)
        if cur != last:
            moved = time.perf_counter()
        elif time.perf_counter() - moved > 2.0:
            break
        last = cur
    return {"sink_steps_seen_at_end": first["sink_steps_seen"], **last,
            "sink_catch_up_s": moved - t0}


def run_once(n_records: int, producers: int, metrics: bool, otlp: bool = False, agent_args: Sequence[str] = (),
             mix: str = "steps") -> dict:
    from phasescope.agent.sidecar.store import Store

    tmp = tempfile.mkdtemp(prefix="ps-ingest-", dir="/tmp")
    rx = OtlpStepReceiver() if otlp else None
    try:
        db, sock = os.path.join(tmp, "bench.duckdb"), os.path.join(tmp, "agent.sock")
        agent, url = _agent(db, sock, metrics, rx.endpoint if rx else None, agent_args)
        proc = psutil.Process(agent.pid)
        peak = [proc.memory_info().rss]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                try:
                    peak[0] = max(peak[0], proc.memory_info().rss)
                except psutil.Error:
                    return
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        ctx = mp.get_context("spawn")
        ready, go, results = ctx.Queue(), ctx.Event(), ctx.Queue()
        per = n_records // producers
        ps = [ctx.Process(target=_producer, args=(sock, per, r, ready, go, results, mix)) for r in range(producers)]
        for p in ps:
            p.start()
        for _ in ps:  # every producer connected and its frames built
            ready.get(timeout=600)
        time.sleep(0.5)
        go.set()
        out = [results.get(timeout=600) for _ in ps]
        for p in ps:
            p.join(30)
        expect = len([r for r in _records(per, 0, mix) if type(r).__name__ == "Step"]) * producers
        sink = _sink_figures(url, expect) if url else {}
        stop.set()
        watcher.join(5)
        cpu = proc.cpu_times()
        t_stop = time.perf_counter()
        agent.terminate()  # the sidecar hands the sinks what is queued, then the OTLP exporter flushes
        agent.wait(60)
        if rx is not None:
            sink["otlp_steps_seen"] = rx.steps_seen()
            sink["otlp_metric_exports"] = len(rx.step_counts)
            sink["agent_stop_s"] = time.perf_counter() - t_stop
        t0, t1 = min(o[0] for o in out), max(o[1] for o in out)
        sent, delivered, lost, producers_cpu = (sum(o[i] for o in out) for i in (2, 3, 4, 5))
        con = Store.open_readonly(db)
        stored = con.execute("SELECT (SELECT count(*) FROM steps) + (SELECT count(*) FROM request_events) "
                             "+ (SELECT count(*) FROM kv_snapshots)").fetchone()[0]
        con.close()
        rate = stored / (t1 - t0)
        base = bulk_append_rate(stored, os.path.join(tmp, "bulk.duckdb"))
        return {"producers": producers, "records": stored, "seconds": t1 - t0, "records_per_s": rate,
                "duckdb_bulk_records_per_s": base, "ratio": rate / base, "peak_rss_mib": peak[0] / 2**20,
                "agent_cpu_us_per_record": (cpu.user + cpu.system) / stored * 1e6,
                "producers_cpu_us_per_record": producers_cpu / stored * 1e6,
                "sent": sent, "delivered": delivered, "lost": lost, "delivered_equals_stored": delivered == stored, **sink}
    finally:
        if rx is not None:
            rx.close()
        shutil.rmtree(tmp, ignore_errors=True)


def bulk_append_rate(n: int, path: str) -> float:
    """DuckDB's own rate for the same rows: one INSERT of an Arrow table with the store's column types."""
    import numpy as np
    import pyarrow as pa

    from phasescope.agent.sidecar.store import Store

    j = np.arange(n, dtype=np.int64)
    tbl = pa.table({
        "source_id": np.ones(n, np.int32), "ts_ns": 1_000 + j, "step_id": j, "rank": np.zeros(n, np.int16),
        "phase": pa.array(np.full(n, "decode", dtype=object), pa.string()), "num_seqs": np.full(n, 8, np.int32),
        "prefill_tokens": np.zeros(n, np.int32), "decode_tokens": np.full(n, 8, np.int32),
        "context_tokens": 4096 + j, "host_ms": np.full(n, 1.5), "gpu_ms": np.full(n, np.nan)})
    store = Store(path)
    t0 = time.perf_counter()
    store.con.execute("INSERT INTO steps SELECT * FROM tbl")
    dt = time.perf_counter() - t0
    store.close()
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", "--steps", type=int, default=2_000_000,
                    help="Step records streamed per run (the RSS bound is checked at 10M: --steps 10000000)")
    ap.add_argument("--producers", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--metrics", action="store_true", help="run the agent with its Prometheus exporter (a sink)")
    ap.add_argument("--otlp", action="store_true",
                    help="run the agent with /metrics and --otlp, exporting to a local OTLP/HTTP receiver")
    ap.add_argument("--agent-arg", action="append", default=[], metavar="ARG",
                    help="pass ARG to `phasescope agent` (repeatable; e.g. --agent-arg=--memory-budget-mib=32)")
    ap.add_argument("--mix", choices=("steps", "probe"), default="steps",
                    help="steps: frames of Step records alone; probe: a decoding probe's interleaved frames "
                         "(a Step, its 8 token events, a KV snapshot every 16 steps)")
    ap.add_argument("--out", default=None, help="write the JSON results here")
    args = ap.parse_args()
    rows = []
    print(f"{'producers':>9} {'records/s':>11} {'duckdb bulk/s':>13} {'ratio':>6} {'peak RSS MiB':>12}  runs")
    for n in args.producers:
        runs = [run_once(args.records, n, args.metrics, args.otlp, args.agent_arg, args.mix) for _ in range(args.repeat)]
        assert all(r["delivered_equals_stored"] for r in runs), runs
        med = {k: statistics.median(r[k] for r in runs)
               for k in ("records_per_s", "duckdb_bulk_records_per_s", "ratio", "peak_rss_mib")}
        rows.append({"producers": n, **med, "runs": runs})
        print(f"{n:>9} {med['records_per_s']:>11,.0f} {med['duckdb_bulk_records_per_s']:>13,.0f} "
              f"{med['ratio']:>6.1%} {med['peak_rss_mib']:>12.0f}  {len(runs)}", flush=True)
        for r in runs:
            if "sink_steps_seen" in r:
                print(f"{'':>9} Prometheus sink: {r['sink_steps_seen']:,.0f} of {r['records']:,} stored steps seen "
                      f"({r['sink_steps_seen_at_end']:,.0f} when the last was acknowledged, caught up "
                      f"{r['sink_catch_up_s']:.1f} s later), sink_dropped_records_total "
                      f"{r['sink_dropped_records']:,.0f}, sink errors {r['sink_errors']:,.0f}", flush=True)
            if "otlp_steps_seen" in r:
                print(f"{'':>9} OTLP sink: {r['otlp_steps_seen']:,.0f} of {r['records']:,} stored steps in the "
                      f"exported phasescope.step.duration ({r['otlp_metric_exports']} exports held it; agent stop took "
                      f"{r['agent_stop_s']:.1f} s)", flush=True)
    if args.out:
        meta = {"cpus": os.cpu_count(), "python": platform.python_version(), "records": args.records,
                "agent_args": args.agent_arg, "mix": args.mix,
                "metrics_sink": args.metrics or args.otlp, "otlp_sink": args.otlp,
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
