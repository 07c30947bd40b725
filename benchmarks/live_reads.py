"""Read latency of a live agent's read API while a probe writes: what a live dashboard page waits for.

A real `Sidecar` with its read API on 127.0.0.1:0 and the analyzers, a tiny random-weight Llama attached with
`attach()` running `generate()` calls in a thread (a request every ~50 ms, as tests/dashboard/test_browser.py's
live test does), then `open_reader(url)` times the named queries the dashboard's sidebar runs on every page
(`runs`, `run_span`) while the probe writes, with every read folding (fold_every_s 0, as before) and with
the default, and once the probe has stopped. Prints medians and maxima (ms) and the
derived-table folds the reads triggered. Before the read API folded at most every 5 s (agent/sidecar/readapi.py
FOLD_EVERY_S) each read folded, and a read took ~1.2 s on a busy 2-core host.

    python benchmarks/live_reads.py [--reads 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reads", type=int, default=15, help="reads timed per query and condition")
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from phasescope.agent import attach
    from phasescope.agent.probe.adapters.hf_generate import GenerateRequests
    from phasescope.agent.read.reader import open_reader
    from phasescope.agent.records import derived
    from phasescope.agent.sidecar import Sidecar
    from phasescope.agent.sidecar.readapi import FOLD_EVERY_S
    from phasescope.analyzers.diagnose import diagnose

    folds = []
    refresh = derived.refresh

    def counted(con):  # count the folds the reads trigger (the read API calls derived.refresh)
        t0 = time.perf_counter()
        try:
            return refresh(con)
        finally:
            folds.append(time.perf_counter() - t0)

    derived.refresh = counted
    tmp = tempfile.mkdtemp(prefix="ps-lr-", dir="/tmp")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256)).eval()
    sc = Sidecar(os.path.join(tmp, "live.duckdb"), listen=[f"unix:{tmp}/a.sock"], batch_interval_s=0.05,
                 read_api="127.0.0.1:0", findings=diagnose).start()
    probe = attach(model, address=f"unix:{tmp}/a.sock", runtime="hf-generate", flush_interval_s=0.02)
    stop = threading.Event()

    def serve() -> None:
        for i in range(100_000):
            if stop.is_set():
                return
            tracker = GenerateRequests(probe, [f"req_{i % 4}"], [6])
            model.generate(input_ids=torch.tensor([[3 + i % 50, 4, 5, 6, 7, 8]]), max_new_tokens=8, do_sample=False,
                           pad_token_id=0, eos_token_id=None, streamer=tracker)
            tracker.finish([8])
            time.sleep(0.05)

    writer = threading.Thread(target=serve, daemon=True)
    writer.start()
    time.sleep(8.0)  # some requests stored
    reader = open_reader(sc.read_api.url)
    rows = []
    try:
        for cond, every in (("writing", 0.0), ("writing", FOLD_EVERY_S), ("idle", FOLD_EVERY_S)):
            sc.read_api.fold_every_s = every  # 0: every read folds (before); FOLD_EVERY_S: the default
            if cond == "idle":
                stop.set()
                writer.join(60)
                time.sleep(1.0)
            for name in ("runs", "run_span"):
                folds.clear()
                ts = []
                for _ in range(args.reads):
                    run = reader.query("runs")[0]["run_id"] if name == "run_span" else None
                    t0 = time.perf_counter()
                    reader.query(name, **({"run_id": run} if run else {}))
                    ts.append(time.perf_counter() - t0)
                rows.append((cond, every, name, statistics.median(ts) * 1e3, max(ts) * 1e3, len(folds),
                             statistics.median(folds) * 1e3 if folds else 0.0, os.getloadavg()[0]))
    finally:
        stop.set()
        probe.close()
        sc.stop()
    print(f"{'probe':8} {'fold every s':>12} {'query':9} {'p50 ms':>8} {'max ms':>8} {'folds':>6} {'fold p50 ms':>12} {'load':>5}")
    for cond, every, name, p50, mx, n, fold, load in rows:
        print(f"{cond:8} {every:12g} {name:9} {p50:8.1f} {mx:8.1f} {n:6d} {fold:12.1f} {load:5.1f}")


if __name__ == "__main__":
    main()
