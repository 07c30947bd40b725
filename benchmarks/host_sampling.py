"""The sidecar's own CPU cost of host and server-process sampling (psutil) at a 1 s interval.

Runs a real `Sidecar` (DuckDB file, writer thread) twice for `--seconds` each: once with no collector
(baseline) and once with a `HostCollector` (plus the NVML collector, which finds no GPU on a CPU
machine) watching a server-like process with `--threads` busy threads. Reports

- collector_cpu_pct_of_core: CPU time spent inside `HostCollector.sample()` (the sampler thread's
  `time.thread_time()` around each call) / wall time, in % of one core;
- sidecar_cpu_pct_of_core: the whole sidecar process's CPU (user + system) / wall time, with and
  without the collector, and the increment (sampling + storing the rows).

    python benchmarks/host_sampling.py --seconds 60 --interval 1 --threads 16 --batch 5 --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from phasescope.agent.sidecar import Sidecar
from phasescope.agent.sidecar.collectors import NvmlCollector
from phasescope.agent.sidecar.host import HostCollector

SERVER = """
import threading, time
def work():
    while True:
        sum(range(20000)); time.sleep(0.002)
for _ in range({n}):
    threading.Thread(target=work, daemon=True).start()
time.sleep(3600)
"""


class Timed:
    """Wraps a collector and adds up the thread CPU time its sample() takes."""

    def __init__(self, inner: HostCollector) -> None:
        self.inner = inner
        self.cpu_s = 0.0
        self.calls = 0
        self.records = 0

    def sample(self):
        t0 = time.thread_time()
        out = self.inner.sample()
        self.cpu_s += time.thread_time() - t0
        self.calls += 1
        self.records += len(out)
        return out


def run(seconds: float, interval: float, collectors: list, sinks: list) -> dict:
    tmp = tempfile.mkdtemp(prefix="ps-hostbench-")
    db = os.path.join(tmp, "bench.duckdb")
    sc = Sidecar(db, listen=[f"unix:{os.path.join(tmp, 's.sock')}"], collectors=collectors, sinks=sinks,
                 sample_interval_s=interval).start()
    try:
        c0, w0 = os.times(), time.monotonic()
        time.sleep(seconds)
        c1, w1 = os.times(), time.monotonic()
    finally:
        sc.stop()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    return {"wall_s": w1 - w0, "cpu_s": cpu, "cpu_pct_of_core": 100.0 * cpu / (w1 - w0),
            "rows_written": sc.stats.rows_written_total}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=16, help="threads of the watched server process")
    p.add_argument("--batch", type=int, default=5, help="HostCollector batch (the agent's: 5)")
    p.add_argument("--out", help="write the JSON result here")
    args = p.parse_args()
    server = subprocess.Popen([sys.executable, "-c", SERVER.format(n=args.threads)])
    try:
        time.sleep(1.0)
        base = run(args.seconds, args.interval, [], [])
        host = HostCollector(pids=[server.pid], batch=args.batch)
        timed = Timed(host)
        with_host = run(args.seconds, args.interval, [timed, NvmlCollector()], [host])
    finally:
        server.kill()
        server.wait()
    wall = with_host["wall_s"]
    result = {
        "interval_s": args.interval, "batch": args.batch, "seconds": args.seconds, "watched_threads": args.threads + 1,
        "samples": timed.calls, "records": timed.records,
        "collector_cpu_s": timed.cpu_s, "collector_cpu_ms_per_sample": 1e3 * timed.cpu_s / max(timed.calls, 1),
        "collector_cpu_pct_of_core": 100.0 * timed.cpu_s / wall,
        "sidecar_baseline": base, "sidecar_with_host": with_host,
        "sidecar_increment_pct_of_core": with_host["cpu_pct_of_core"] - base["cpu_pct_of_core"],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load1_at_end": os.getloadavg()[0]},
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
