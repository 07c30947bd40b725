"""DuckDB append cost by transaction size: why the sidecar's writer waits for a row group of records.

Appends the same Step rows (as the writer does: an Arrow table with the store's column types, one
INSERT ... SELECT per transaction) in transactions of several sizes, and times INSERT, COMMIT and the
CHECKPOINT after. Transactions under DuckDB's row group (122,880 rows) go through the WAL and their
COMMIT dominates.

    python benchmarks/duckdb_commit.py [--rows 1966080] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa

from phasescope.agent.sidecar.store import Store

SELECT = ("source_id, ts_ns, step_id, rank, phase::VARCHAR, num_seqs, prefill_tokens, decode_tokens, "
          "context_tokens, host_ms, gpu_ms")


def _table(n: int, off: int) -> pa.Table:
    j = np.arange(off, off + n, dtype=np.int64)
    return pa.table({
        "source_id": np.ones(n, np.int32), "ts_ns": 1000 + j, "step_id": j, "rank": np.zeros(n, np.int16),
        "phase": pa.DictionaryArray.from_arrays(np.full(n, 1, np.int8), ["prefill", "decode", "mixed", "idle"]),
        "num_seqs": np.full(n, 8, np.int32), "prefill_tokens": np.zeros(n, np.int32),
        "decode_tokens": np.full(n, 8, np.int32), "context_tokens": 4096 + j, "host_ms": np.full(n, 1.5),
        "gpu_ms": np.full(n, np.nan)})


def run(rows: int, tx: int) -> tuple[float, float, float]:
    """(insert s, commit s, checkpoint s) for `rows` rows in transactions of `tx` rows."""
    tmp = tempfile.mkdtemp(prefix="ps-commit-", dir="/tmp")
    try:
        store = Store(os.path.join(tmp, "t.duckdb"))
        batches = [_table(min(tx, rows - o), o) for o in range(0, rows, tx)]
        t_ins = t_com = 0.0
        for batch in batches:  # noqa: B007 - DuckDB finds `batch` by name
            t0 = time.perf_counter()
            store.con.execute("BEGIN")
            store.con.execute(f"INSERT INTO steps SELECT {SELECT} FROM batch")
            t1 = time.perf_counter()
            store.con.execute("COMMIT")
            t_ins, t_com = t_ins + t1 - t0, t_com + time.perf_counter() - t1
        t0 = time.perf_counter()
        store.checkpoint()
        t_ck = time.perf_counter() - t0
        store.close()
        return t_ins, t_com, t_ck
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16 * 122_880)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tx", type=int, nargs="+", default=[37_500, 75_000, 122_880, 245_760, 491_520])
    args = ap.parse_args()
    print(f"{'rows/tx':>9} {'insert s':>9} {'commit s':>9} {'checkpoint s':>12} {'rows/s':>11}  (medians of {args.repeat})")
    for tx in args.tx:
        runs = [run(args.rows, tx) for _ in range(args.repeat)]
        ins, com, ck = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"{tx:>9,} {ins:>9.2f} {com:>9.2f} {ck:>12.2f} {args.rows / (ins + com + ck):>11,.0f}", flush=True)


if __name__ == "__main__":
    main()
