"""Dashboard query latency on a synthetic store of 10 million steps, as a ratio to one scan.

Builds (once, in DuckDB SQL) a store with N steps of one run on 2 ranks, one KV
snapshot and one prefix-counter row per step, NVML samples, and requests with
token events (~16 steps per request), then times every named query each page of
the app runs, as the app runs them (through the file reader), and `diagnose`.

Each figure is also given as a ratio to ONE exact scan of the steps table
(`SCAN_SQL`: count, mean and three exact quantiles of the host time over every
step) timed through the same reader in the same run, interleaved with the pages:
on a machine shared with other work the seconds move, the ratios much less.
Targets (issue 30): every page <= 1 s and diagnose <= 3 s at 10M steps on 2 cores;
tests/test_read_guard.py fails when a page exceeds 10x the scan or diagnose 30x.

    python benchmarks/dashboard_queries.py [--steps 10000000] [--db /tmp/ps-10m.duckdb] [--repeat 3]
    python benchmarks/dashboard_queries.py --db STORE --run RUN_ID --no-fold   # a store a real agent wrote
                                                                                # (gpu_rate.py --keep)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import duckdb

from phasescope.agent.read.reader import open_reader
from phasescope.agent.sidecar.store import Store
from phasescope.analyzers.diagnose import diagnose

try:
    from phasescope.agent.records import derived
except ImportError:  # a build before issue 30 (no derived tables): the benchmark still measures it
    derived = None

RUN = "bench-run"

# the unit every figure is divided by: one exact-quantile pass over every step
SCAN_SQL = "SELECT count(*), avg(host_ms), quantile_cont(host_ms, [0.5, 0.95, 0.99]) FROM steps"


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
    if derived is not None:
        t0 = time.perf_counter()
        n = derived.refresh(con)  # what the sidecar's reads and its close do as the events come
        print(f"folded {n:,} request events into the derived tables in {time.perf_counter() - t0:.1f} s")
    con.execute("CHECKPOINT")
    con.close()


def time_fold(path: str, minutes: float = 1.0) -> tuple[int, float, float]:
    """(events, seconds to fold them in, seconds of one steps scan) for `minutes` of new requests appended to a
    copy of the store: what a live read pays when the last one was that long ago."""
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="ps-fold-")
    try:
        copy = os.path.join(tmp, "copy.duckdb")
        shutil.copy(path, copy)
        con = duckdb.connect(copy)
        last = con.execute("SELECT max(ts_ns) FROM request_events").fetchone()[0]
        n_req = max(1, int(minutes * 60 / (16 * 0.01)))  # one request per 16 steps of 10 ms
        con.execute(f"""
            INSERT INTO request_events
            SELECT source_id, ts_ns - (SELECT min(ts_ns) FROM request_events) + {last} + 1000000, rank, event,
                   'new-' || request_id, tokens, cached_tokens
            FROM request_events WHERE request_id IN (SELECT 'req-' || j FROM range({n_req}) t(j))""")
        n = con.execute(f"SELECT count(*) FROM request_events WHERE request_id LIKE 'new-%'").fetchone()[0]
        t0 = time.perf_counter()
        derived.refresh(con)
        fold = time.perf_counter() - t0
        t0 = time.perf_counter()
        con.execute(SCAN_SQL).fetchall()
        scan = time.perf_counter() - t0
        con.close()
        return n, fold, scan
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# what each page of the app runs (dashboard/app.py), with the app's time window: the whole run in 60 buckets
PAGES = {
    "Overview": [("request_summary", {}), ("kv_summary", {}), ("prefix_summary", {})],
    "Phases": [("phase_summary", {"quantiles": "approx"}),
               ("step_timeline", {"bucket_s": "$bucket", "since_s": 0.0, "quantiles": "approx"}),
               ("step_sample", {"limit": 3000, "since_s": 0.0}), ("interference", {"since_s": 0.0, "quantiles": "approx"})],
    "Requests": [("slo_attainment", {}), ("latency_histogram", {"metric": "ttft", "bins": 30}),
                 ("latency_histogram", {"metric": "tpot", "bins": 30}),
                 ("latency_histogram", {"metric": "itl", "bins": 30}), ("itl_attribution", {})],
    "KV cache": [("kv_timeline", {"bucket_s": "$bucket", "since_s": 0.0}), ("kv_summary", {}),
                 ("page_size_whatif", {"sizes": "8,16,32,64,128,256"})],
    "Prefix cache": [("prefix_summary", {}), ("prefix_timeline", {"bucket_s": "$bucket", "since_s": 0.0}),
                     ("prefix_miss_causes", {}), ("kv_residency", {})],
    "Ranks": [("rank_kv", {"bucket_s": "$bucket", "since_s": 0.0}), ("rank_steps", {})],
    "GPU": [("memory_budget", {}), ("gpu_timeline", {"bucket_s": "$bucket"}), ("probe_health", {}),
            ("process_timeline", {"bucket_s": "$bucket"}), ("host_timeline", {"bucket_s": "$bucket"})],
    "Experiments": [("runs", {}), ("run_compare", {"run_a": RUN, "run_b": RUN}), ("run_labels", {}),
                    ("run_labels", {})],
}
NO_RUN_PARAM = {"runs", "run_compare"}
SNAPSHOT_PAGES = {"Requests", "Prefix cache"}  # the app reads these pages' queries in one snapshot (one open)
SIDEBAR = [("runs", {}), ("run_span", {})]  # what the app runs for every page before the page itself


def time_scan(reader: Any) -> float:
    """Seconds of one exact scan of the steps table through `reader` (a FileReader: it opens the file)."""
    t0 = time.perf_counter()
    reader._run(lambda con: con.execute(SCAN_SQL).fetchall())
    return time.perf_counter() - t0


def _kw(name: str, params: dict, run: str, bucket: float) -> dict:
    kw = dict(params) if name in NO_RUN_PARAM else {"run_id": run, **params}
    return {k: bucket if v == "$bucket" else run if v == RUN else v for k, v in kw.items()}


def time_page(reader: Any, queries: list[tuple[str, dict]], run: str = RUN,
              one_snapshot: bool = False) -> tuple[float, dict[str, float]]:
    """Seconds of the sidebar and the page's queries, and each query's seconds (`one_snapshot`: the page's queries
    read in one snapshot, as the app reads them, timed as one entry "snapshot")."""
    total, per_query, bucket = 0.0, {}, 1.0
    for name, params in SIDEBAR + ([] if one_snapshot else queries):
        t0 = time.perf_counter()
        out = reader.query(name, **_kw(name, params, run, bucket))
        dt = time.perf_counter() - t0
        if name == "run_span":  # the app's window: the whole run, in 60 buckets (multiples of 10 s from 10 s on)
            bucket = max(max(1.0, float(out["span_s"])) / 60, 0.5)
            bucket = float(10 * round(bucket / 10)) if bucket >= 10 else round(bucket, 2)
        total += dt
        key = f"{name}{'?metric=' + params['metric'] if 'metric' in params else ''}"
        per_query[key] = per_query.get(key, 0.0) + dt
    if one_snapshot:
        t0 = time.perf_counter()
        reader.snapshot([(name, _kw(name, params, run, bucket)) for name, params in queries])
        per_query["snapshot"] = time.perf_counter() - t0
        total += per_query["snapshot"]
    return total, per_query


def measure(reader: Any, repeat: int = 3, run: str = RUN, pages: dict | None = None,
            findings: bool = True) -> dict[str, Any]:
    """Every page and diagnose timed `repeat` times, each right after one steps scan through the same reader
    (so both see the same load). Per page: median seconds, median and least ratio to the scan before it."""
    pages = PAGES if pages is None else pages
    scans: list[float] = []
    runs: dict[str, list[tuple[float, float]]] = {p: [] for p in pages}  # (seconds, the scan before)
    query_s: dict[str, dict[str, list[float]]] = {p: {} for p in pages}
    diag: list[tuple[float, float]] = []
    found = None
    for _ in range(repeat):
        for page, queries in pages.items():
            scan = time_scan(reader)
            total, per_query = time_page(reader, queries, run, one_snapshot=page in SNAPSHOT_PAGES)
            scans.append(scan)
            runs[page].append((total, scan))
            for k, v in per_query.items():
                query_s[page].setdefault(k, []).append(v)
        if findings:
            scan = time_scan(reader)
            t0 = time.perf_counter()
            found = reader.findings(run)
            diag.append((time.perf_counter() - t0, scan))
            scans.append(scan)

    def summary(pairs: list[tuple[float, float]]) -> dict[str, float]:
        return {"s": statistics.median(s for s, _ in pairs), "ratio": statistics.median(s / c for s, c in pairs),
                "min_ratio": min(s / c for s, c in pairs)}

    out: dict[str, Any] = {"scan_s": statistics.median(scans), "scans": scans, "pages": {}}
    for page in pages:
        slow, slow_s = max(((k, statistics.median(v)) for k, v in query_s[page].items()), key=lambda kv: kv[1])
        out["pages"][page] = {**summary(runs[page]), "slowest": slow, "slowest_s": slow_s}
    if findings:
        out["diagnose"] = {**summary(diag), "findings": len(found or [])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10_000_000)
    ap.add_argument("--db", default="/tmp/phasescope-bench-10m.duckdb")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--run", default=RUN, help="the run the pages show (a store the benchmark did not build)")
    ap.add_argument("--no-fold", action="store_true", help="skip the timed fold of a copy (a multi-GB store)")
    args = ap.parse_args()
    if not os.path.exists(args.db):
        t0 = time.perf_counter()
        build(args.db, args.steps)
        print(f"built {args.db} ({args.steps:,} steps) in {time.perf_counter() - t0:.1f} s")
    reader = open_reader(args.db, findings=diagnose)
    n = reader._run(lambda con: con.execute("SELECT count(*) FROM steps").fetchone()[0])
    print(f"{n:,} steps · {os.cpu_count()} cores · median of {args.repeat} runs per page")
    m = measure(reader, args.repeat, run=args.run)
    print(f"one exact scan of the steps table (median of {len(m['scans'])}): {m['scan_s']:.3f} s\n")
    print(f"{'page':14} {'queries':>7} {'page s':>8} {'x scan':>7}  slowest query")
    for page, r in m["pages"].items():
        print(f"{page:14} {len(SIDEBAR) + len(PAGES[page]):>7} {r['s']:>8.3f} {r['ratio']:>7.1f}  "
              f"{r['slowest']} {r['slowest_s']:.3f} s")
    worst = max(r["s"] for r in m["pages"].values())
    worst_ratio = max(r["ratio"] for r in m["pages"].values())
    print(f"\nslowest page: {worst:.3f} s, {worst_ratio:.1f}x one scan "
          f"({'under' if worst < 1 else 'OVER'} the 1 s target; guard: 10x)")
    d = m["diagnose"]
    print(f"diagnose (Overview findings, cached 30 s by the app): {d['s']:.3f} s, {d['ratio']:.1f}x one scan, "
          f"{d['findings']} findings ({'under' if d['s'] < 3 else 'OVER'} the 3 s target; guard: 30x)")
    reader.close()
    import resource

    print(f"peak RSS of this process (every page and diagnose, in-process): "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    if derived is None or args.no_fold:
        return
    n, fold, scan = time_fold(args.db)
    print(f"a read after 1 minute of new requests ({n:,} events) folds them in first: {fold:.3f} s, "
          f"{fold / scan:.1f}x a scan of the copy ({scan:.3f} s)")


if __name__ == "__main__":
    main()
