"""Dashboard query latency on a synthetic store of 10 million steps.

Builds (once, in DuckDB SQL) a store with N steps of one run on 2 ranks, one KV
snapshot and one prefix-counter row per step, NVML samples, and requests with
token events (~16 steps per request), then times every named query each page of
the app runs, as the app runs them (through the file reader). Prints a table.

    python benchmarks/dashboard_queries.py [--steps 10000000] [--db /tmp/ps-10m.duckdb]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import duckdb

from phasescope.agent.read.reader import open_reader
from phasescope.analyzers.diagnose import diagnose
from phasescope.agent.sidecar.store import Store

RUN = "bench-run"


def build(path: str, steps: int) -> None:
    store = Store(path)  # the schema, exactly as the sidecar writes it
    store.close()
    con = duckdb.connect(path)
    base = 10**12
    con.execute("INSERT INTO sources VALUES (1, 0, ?, 0, 1, 0, 2, ?, 'llama-8b', 'vllm'),"
                " (2, 0, ?, 0, 2, 1, 2, ?, 'llama-8b', 'vllm')", [base, RUN, base, RUN])
    per_rank = steps // 2
    step_ns = 10_000_000  # 10 ms steps
    con.execute(f"""
        INSERT INTO steps
        SELECT 1 + r, {base} + i * {step_ns}, i, r,
               CASE WHEN i % 16 = 0 THEN 'prefill' WHEN i % 16 = 1 THEN 'mixed' ELSE 'decode' END,
               32, CASE WHEN i % 16 = 0 THEN 4096 WHEN i % 16 = 1 THEN 512 ELSE 0 END,
               CASE WHEN i % 16 = 0 THEN 0 ELSE 32 END, 32 * 900 + (i % 977),
               8.0 + (i % 16 = 0)::INT * 40 + (hash(i) % 100) / 100.0, 7.5 + (i % 16 = 0)::INT * 40 + r * 0.5
        FROM range({per_rank}) t(i), range(2) q(r)""")
    con.execute(f"""
        INSERT INTO kv_snapshots
        SELECT 1 + r, {base} + i * {step_ns}, r, 16, 65536, 50000 + (i % 9000), 15536 - (i % 9000), 0, 64, 2048,
               32, (50000 + (i % 9000)) * 15, 4000, i * 3, i * 3 - 2, (50000 + (i % 9000)) * 131072, 'bfloat16'
        FROM range({per_rank}) t(i), range(2) q(r)""")
    con.execute(f"""
        INSERT INTO prefix_counters
        SELECT 1 + r, {base} + i * {step_ns}, r, i * 300, i * 180, i, i // 100
        FROM range({per_rank}) t(i), range(2) q(r)""")
    con.execute(f"""
        INSERT INTO gpu_samples
        SELECT 0, {base} + i * 1000000000, g, 90.0, 120e9::BIGINT, 141e9::BIGINT, 650.0, 60.0, 1980.0, 0
        FROM range({per_rank * step_ns // 1_000_000_000}) t(i), range(2) q(g)""")
    n_req = per_rank // 16
    con.execute(f"""
        INSERT INTO request_events
        SELECT 1, {base} + j * 16 * {step_ns} + CASE e WHEN 0 THEN 0 WHEN 1 THEN 2000000 ELSE (e - 1) * 25000000 END,
               0, CASE e WHEN 0 THEN 'arrival' WHEN 1 THEN 'scheduled' WHEN 18 THEN 'finished' ELSE 'token' END,
               'req-' || j, CASE e WHEN 0 THEN 4096 WHEN 18 THEN 16 WHEN 1 THEN 0 ELSE 1 END,
               CASE e WHEN 1 THEN 1024 ELSE 0 END
        FROM range({n_req}) t(j), range(19) q(e)""")
    con.execute("CHECKPOINT")
    con.close()


PAGES = {
    "Overview": [("request_summary", {}), ("kv_summary", {}), ("prefix_summary", {})],
    "Phases": [("phase_summary", {}), ("step_timeline", {"bucket_s": 1000.0}), ("step_sample", {"limit": 3000}),
               ("interference", {})],
    "Requests": [("slo_attainment", {}), ("latency_histogram", {"metric": "ttft"}),
                 ("latency_histogram", {"metric": "tpot"}), ("latency_histogram", {"metric": "itl"})],
    "KV cache": [("kv_timeline", {"bucket_s": 1000.0}), ("page_size_whatif", {})],
    "Prefix cache": [("prefix_summary", {}), ("prefix_timeline", {"bucket_s": 1000.0})],
    "Ranks": [("rank_kv", {"bucket_s": 1000.0}), ("rank_steps", {})],
    "GPU": [("memory_budget", {}), ("gpu_timeline", {"bucket_s": 1000.0})],
    "Experiments": [("runs", {}), ("run_compare", {"run_a": RUN, "run_b": RUN})],
}
NO_RUN_PARAM = {"runs", "run_compare"}
SIDEBAR = [("runs", {}), ("run_span", {})]  # what the app runs for every page before the page itself


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10_000_000)
    ap.add_argument("--db", default="/tmp/phasescope-bench-10m.duckdb")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not os.path.exists(args.db):
        t0 = time.perf_counter()
        build(args.db, args.steps)
        print(f"built {args.db} ({args.steps:,} steps) in {time.perf_counter() - t0:.1f} s")
    reader = open_reader(args.db, findings=diagnose)
    n = reader._run(lambda con: con.execute("SELECT count(*) FROM steps").fetchone()[0])
    print(f"{n:,} steps · {os.cpu_count()} cores · median of {args.repeat} runs per page\n")
    print(f"{'page':14} {'queries':>7} {'page s':>8}  slowest query")
    worst = 0.0
    for page, queries in PAGES.items():
        totals, per_query = [], {}
        for _ in range(args.repeat):
            total = 0.0
            for name, params in SIDEBAR + queries:
                kw = dict(params) if name in NO_RUN_PARAM else {"run_id": RUN, **params}
                t0 = time.perf_counter()
                reader.query(name, **kw)
                dt = time.perf_counter() - t0
                total += dt
                per_query.setdefault(f"{name}{params.get('metric', '')}", []).append(dt)
            totals.append(total)
        med = statistics.median(totals)
        worst = max(worst, med)
        slow_name, slow = max(((k, statistics.median(v)) for k, v in per_query.items()), key=lambda kv: kv[1])
        print(f"{page:14} {len(SIDEBAR) + len(queries):>7} {med:>8.3f}  {slow_name} {slow:.3f} s")
    print(f"\nslowest page: {worst:.3f} s ({'under' if worst < 1 else 'OVER'} the 1 s target)")
    try:
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            found = reader.findings(RUN)
            times.append(time.perf_counter() - t0)
        print(f"analyzers (Overview findings, cached 30 s by the app): {statistics.median(times):.3f} s, "
              f"{len(found)} findings")
    except ImportError:
        pass
    reader.close()


if __name__ == "__main__":
    main()
