"""The probe's whole cost with a real sidecar process (issue 25), on a ~1 ms graph-replayed decode step.

The step: a 1.1B-geometry bf16 decode (benchmarks/graph_overhead.py's DecodeStack) captured into one
CUDA graph, replayed by a module's forward, with a host sync per step (`tok.cpu()`: a sampler needs
the token). The probe is attached to the module that replays the graph and ships to a real
`phasescope agent` process on a Unix socket. Conditions, interleaved in rounds (order rotating):

- off: no probe on the module;
- attach: a fresh `attach()` at the start of the block (its first wakes, event pool, connection and
  handshake inside the block), closed after it (the close not timed): the cost from attach;
- steady: one probe attached before the rounds and warmed 300 steps (sampler settled);
- sink: the same as steady with `sink=` (records handed to a Python list in process, no socket, no
  encode): what the repo's older benchmarks measured. Reported apart: it leaves out encode, send
  and acks.

Per block: median and mean step time. Overhead = median over rounds of (block statistic / the
round's off block) - 1. Then the probe's own account (ProbeHealth): its total share of wall time,
background CPU per wake and the wake's wall time (the GIL hold's upper bound) in us, the
estimated GIL wait, the GPU sample rate. Then every step is checked in the store (run by run) and,
with every step timed, the probe's GPU time against events recorded around the same replay.

    python benchmarks/sidecar_overhead.py --json benchmarks/results/sidecar_overhead_h200.json
    python benchmarks/sidecar_overhead.py --dry        # CPU, tiny: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_overhead import GEOMETRY, DecodeStack, GraphRunner  # noqa: E402

from phasescope.agent import attach  # noqa: E402
from phasescope.agent.probe.phases import StepShape  # noqa: E402
from phasescope.agent.records.events import PHASE_DECODE, Step  # noqa: E402


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def start_agent(folder: str) -> tuple[subprocess.Popen, str, str]:
    db, sock = os.path.join(folder, "bench.duckdb"), os.path.join(folder, "agent.sock")
    proc = subprocess.Popen([sys.executable, "-m", "phasescope.cli", "agent", "--db", db, "--listen", f"unix:{sock}",
                             "--no-api", "--no-metrics"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    if "listening" not in line:
        raise RuntimeError(f"the sidecar did not start: {line}{proc.stdout.read()}")
    return proc, db, sock


def cost_of(probe) -> dict:
    h, c = probe.health(), getattr(probe, "cost", None)
    if c is None:  # a build before issue 25 (for before/after runs): no account of its own cost
        return dict(cost_share=math.nan, wakes=0, wake_cpu_us=math.nan, wake_hold_us=math.nan,
                    wake_hold_max_us=math.nan, gpu_sample_rate=h.gpu_sample_rate, steps=probe.steps,
                    dropped=h.dropped_total, errors=h.errors_total, interval_s=probe.flush_interval_s)
    return dict(cost_share=h.cost_share, probe_cpu_s=h.probe_cpu_s_total, background_cpu_s=h.background_cpu_s_total,
                gil_wait_est_s=h.gil_wait_est_s_total, wakes=c.wakes,
                wake_cpu_us=c.background_per_wake_ns() / 1e3, wake_hold_us=c.hold_ns / max(c.wakes, 1) / 1e3,
                wake_hold_max_us=c.hold_max_ns / 1e3, gpu_sample_rate=h.gpu_sample_rate, steps=probe.steps,
                dropped=h.dropped_total, errors=h.errors_total, interval_s=probe._interval_s)


def replay_cost(batch: int, rounds: int, block: int, sock: str, device: torch.device, dtype: torch.dtype,
                dry: bool, tag: str) -> tuple[dict, dict[str, int]]:
    torch.manual_seed(0)
    layers = 2 if dry else GEOMETRY["layers"]
    stack = DecodeStack(batch, 16 if dry else 512, layers, device, dtype)
    x = torch.randn(batch, 1, GEOMETRY["hidden"], device=device, dtype=dtype)
    off = GraphRunner(stack, x, dry)

    twin = off.twin

    ctx = 512 * batch
    shape = StepShape(PHASE_DECODE, batch, 0, batch, ctx)
    dev = "cuda" if device.type == "cuda" else None
    mods = {c: twin() for c in ("attach", "steady", "sink")}
    runs: dict[str, int] = {}  # run_id -> steps its probe recorded (checked in the store)
    sunk: list[Step] = []
    steady = attach(mods["steady"], address=f"unix:{sock}", device=dev, run_id=f"{tag}-steady")
    sinkp = attach(mods["sink"], sink=lambda r: sunk.extend(s for s in r if type(s) is Step), device=dev)
    probes = {"steady": steady, "sink": sinkp}

    def run(cond: str, n: int) -> list[float]:
        m, p = (off, None) if cond == "off" else (mods[cond], probes[cond])
        times = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            if p is not None:
                p.next_shape = shape
            tok = m(x)
            tok.cpu()  # the sampler needs the token: a host sync per step
            times.append((time.perf_counter_ns() - t0) / 1e3)
        return times

    run("off", 100)
    run("steady", 300)  # the sampler settles
    run("sink", 300)
    conds = ["off", "attach", "steady", "sink"]
    stats: dict[str, dict[str, list[float]]] = {c: {"median": [], "mean": []} for c in conds}
    attach_costs = []
    for r in range(rounds):
        order = conds[r % len(conds):] + conds[:r % len(conds)]
        for cond in order:
            if cond == "attach":
                rid = f"{tag}-a{r}"
                probes["attach"] = attach(mods["attach"], address=f"unix:{sock}", device=dev, run_id=rid)
            t = run(cond, block)
            if cond == "attach":
                p = probes.pop("attach")
                p.flush(10)
                attach_costs.append(cost_of(p))
                runs[rid] = p.steps
                p.close()
            stats[cond]["median"].append(med(t))
            stats[cond]["mean"].append(statistics.fmean(t))
    res: dict = dict(batch=batch, rounds=rounds, block_steps=block, step_us_off=med(stats["off"]["median"]))
    for cond in conds[1:]:
        for stat in ("median", "mean"):
            pair = [a / b - 1 for a, b in zip(stats[cond][stat], stats["off"][stat])]
            res[f"{cond}_{stat}_pct"] = 100 * med(pair)
            res[f"{cond}_{stat}_us"] = med([a - b for a, b in zip(stats[cond][stat], stats["off"][stat])])
            res[f"{cond}_{stat}_pct_spread"] = [100 * min(pair), 100 * max(pair)]
    noise = [a / b - 1 for a, b in zip(stats["off"]["median"][1:], stats["off"]["median"][:-1])]
    res["off_round_to_round_pct_abs_median"] = 100 * med([abs(v) for v in noise])
    res["steady_cost"] = cost_of(steady)
    res["sink_cost"] = cost_of(sinkp)
    res["attach_cost_median_share"] = med([c["cost_share"] for c in attach_costs])
    res["attach_costs"] = attach_costs

    # accuracy: every step timed, against events this script records around the same replay
    steady.flush(10)
    sm = steady.sampler
    sm.budget = None
    sm.rates[:] = [1.0] * 4
    first = steady.steps
    ref: list[float] = []
    if device.type == "cuda":
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        mods["steady"].ref_events = (e0, e1)
        for _ in range(300):
            steady.next_shape = shape
            mods["steady"](x).cpu()
            ref.append(e0.elapsed_time(e1))
        mods["steady"].ref_events = None
    steady.flush(10)
    runs[f"{tag}-steady"] = steady.steps
    res["ref_first_step"], res["ref_gpu_ms"] = first, ref
    steady.close()
    sinkp.close()
    return res, runs


def check_store(db: str, runs: dict[str, int], results: list[dict], tag_of: list[str]) -> dict:
    import duckdb

    out = {}
    with duckdb.connect(db, read_only=True) as con:
        for rid, steps in runs.items():
            got = con.execute("SELECT count(*), count(DISTINCT step_id), min(step_id), max(step_id) FROM steps "
                              "JOIN sources USING (source_id) WHERE run_id = ?", [rid]).fetchone()
            out[rid] = dict(recorded=steps, stored=got[0], distinct=got[1], complete=got[0] == got[1] == steps)
        for r, tag in zip(results, tag_of):
            first, ref = r.pop("ref_first_step"), r.pop("ref_gpu_ms")
            rows = dict(con.execute("SELECT step_id, gpu_ms FROM steps JOIN sources USING (source_id) WHERE run_id = ? "
                                    "AND step_id >= ?", [f"{tag}-steady", first]).fetchall())
            rel = [abs(rows[first + i] - v) / v for i, v in enumerate(ref)
                   if first + i in rows and rows[first + i] == rows[first + i]]
            r["gpu_vs_ref_rel_p50"] = med(rel)
            r["gpu_vs_ref_rel_max"] = max(rel) if rel else math.nan
            r["gpu_compared"] = len(rel)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--block", type=int, default=400, help="steps per condition per round")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--dry", action="store_true", help="CPU, tiny: check the script runs")
    ap.add_argument("--json")
    args = ap.parse_args()
    dry = args.dry or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    folder = tempfile.mkdtemp(prefix="ps-bench-")
    agent, db, sock = start_agent(folder)
    res: dict = dict(device="cpu (dry)" if dry else torch.cuda.get_device_name(), torch=torch.__version__,
                     python=sys.version.split()[0])
    runs: dict[str, int] = {}
    tags = []
    try:
        res["replay"] = []
        for b in args.batches.split(","):
            tag = f"bs{b}"
            r, rr = replay_cost(int(b), 2 if dry else args.rounds, 20 if dry else args.block, sock, device, dtype,
                                dry, tag)
            res["replay"].append(r)
            runs.update(rr)
            tags.append(tag)
    finally:
        agent.terminate()  # the sidecar commits what it received and checkpoints
        agent.wait(60)
    res["store"] = check_store(db, runs, res["replay"], tags)
    res["every_step_stored"] = all(v["complete"] for v in res["store"].values())

    print(f"\n{res['device']} · torch {res['torch']} · real sidecar on a Unix socket; "
          f"{args.rounds} interleaved rounds x {args.block} steps; host sync per step")
    print(f"{'bs':>3} {'off us':>8} | {'attach med':>10} {'mean':>7} | {'steady med':>10} {'mean':>7} | "
          f"{'sink med':>8} {'mean':>7} | {'share':>6} {'wake cpu us':>11} {'hold us':>8} {'hold max':>8} "
          f"{'rate':>6} {'gpu err p50/max':>15}")
    for r in res["replay"]:
        c = r["steady_cost"]
        print(f"{r['batch']:>3} {r['step_us_off']:>8.1f} | {r['attach_median_pct']:>9.2f}% {r['attach_mean_pct']:>6.2f}% | "
              f"{r['steady_median_pct']:>9.2f}% {r['steady_mean_pct']:>6.2f}% | {r['sink_median_pct']:>7.2f}% "
              f"{r['sink_mean_pct']:>6.2f}% | {100 * c['cost_share']:>5.2f}% {c['wake_cpu_us']:>11.1f} "
              f"{c['wake_hold_us']:>8.1f} {c['wake_hold_max_us']:>8.1f} {c['gpu_sample_rate']:>6.3f} "
              f"{100 * r['gpu_vs_ref_rel_p50']:>6.3f}/{100 * r['gpu_vs_ref_rel_max']:.3f}%")
        print(f"    off round-to-round |change| median {r['off_round_to_round_pct_abs_median']:.2f}%; attach "
              f"blocks' reported share (median) {100 * r['attach_cost_median_share']:.2f}%; wakes {c['wakes']}, "
              f"interval {c['interval_s']:.3f} s; dropped {c['dropped']}, errors {c['errors']}")
    print(f"every recorded step stored: {res['every_step_stored']} ({len(runs)} runs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
