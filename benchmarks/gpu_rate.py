"""The store at a busy GPU's rate (issue 54): a real `phasescope agent` fed by several probe processes that replay
what the vLLM adapter sends at batch 256, for minutes; prints the rate kept, records dropped, the derived tables'
lag (p50, max), the agent's peak RSS, store bytes per token, the fold at close, and diagnose's time and RSS on the
store it left.

Each producer is one vLLM server: every engine step, one `Step` (the EngineCore's) and one `token` event per
running request (the frontend's, with the engine's output stamp lead), and as requests finish (output lengths
drawn around `--output-tokens`) their `finished` event and a new request's `arrival` and `scheduled`. Records are
packed with numpy in the wire layout (records/events.py) and sent through the probe's own `Sender` (v2, acks);
a frame the sender cannot hand to the socket counts as dropped. Steps are paced to the target rate; a producer
that falls behind its schedule says so (`behind_s`): the rate kept is what the agent stored, not the target.

    python benchmarks/gpu_rate.py --minutes 10 --tokens-per-s 80000 --producers 4 --out benchmarks/results/gpu_rate
    python benchmarks/gpu_rate.py --minutes 10 --fold-interval-s 0 ...   # before: no live fold (today's default)

Lag: the agent's own gauge (`fold_lag_s` from /api/v1/health, agent/sidecar/folding.py), sampled every second;
with the live fold off it is the age of everything written since the start (nothing is folded until a read or
close), computed here from the same samples.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import duckdb
import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

from phasescope.agent.records import events as ev
from phasescope.agent.records.address import parse_address
from phasescope.agent.probe.sender import Sender

# wire layouts (records/events.py WIRE, type byte first), as numpy dtypes: one array per frame, no Python per record
TOKEN_DT = np.dtype([("code", "u1"), ("ts", "<i8"), ("rank", "<u2"), ("event", "u1"), ("rid", "S32"),
                     ("tokens", "<u4"), ("cached", "<u4")])
STEP_DT = np.dtype([("code", "u1"), ("ts", "<i8"), ("step", "<u8"), ("rank", "<u2"), ("phase", "u1"),
                    ("seqs", "<u4"), ("pre", "<u4"), ("dec", "<u4"), ("ctx", "<u8"), ("host", "<f8"), ("gpu", "<f8")])
assert TOKEN_DT.itemsize == ev.record_size(ev.RequestEvent) and STEP_DT.itemsize == ev.record_size(ev.Step)
REQ_CODE, STEP_CODE = ev.TYPE_CODES[ev.RequestEvent], ev.TYPE_CODES[ev.Step]


def _frame(parts: list[np.ndarray]) -> bytes:
    payload = b"".join(p.tobytes() for p in parts)
    count = sum(len(p) for p in parts)
    return ev.HEADER.pack(ev.MAGIC, 1, 0, count, len(payload)) + payload


def produce(address: str, run: str, batch: int, tokens_per_s: float, seconds: float, output_tokens: int,
            steps_per_frame: int, seed: int, out: "mp.Queue") -> None:
    """One vLLM server's records at `tokens_per_s` for `seconds`; puts its counts on `out`."""
    rng = np.random.default_rng(seed)
    hello = ev.Hello(time.monotonic_ns(), time.time_ns() - time.monotonic_ns(), os.getpid(), 0, 1, run, "llama-1b-shape", "vllm")
    sender = Sender(parse_address(address), lambda: ev.encode_frame([hello]))
    step_s = batch / tokens_per_s
    slots = np.array([f"{seed}-{i}".encode() for i in range(batch)], dtype="S32")
    left = rng.integers(1, 2 * output_tokens, batch)  # tokens each running request still makes
    made = np.zeros(batch, np.int64)
    serial = batch
    sent = dropped = tokens = steps = 0
    t0 = time.monotonic()
    behind = 0.0
    parts: list[np.ndarray] = []
    while True:
        due = t0 + steps * step_s
        now = time.monotonic()
        if now - t0 >= seconds:
            break
        if due > now:
            time.sleep(due - now)
        else:
            behind = max(behind, now - due)
        ts = time.monotonic_ns()
        st = np.zeros(1, STEP_DT)
        st[0] = (STEP_CODE, ts, steps, 0, ev.PHASES.index("decode"), batch, 0, batch, int(made.sum()), step_s * 1e3 * 0.9,
                 float("nan"))
        tok = np.zeros(batch, TOKEN_DT)
        tok["code"], tok["ts"], tok["event"], tok["rid"], tok["tokens"] = REQ_CODE, ts + 200_000, ev.REQ_TOKEN, slots, 1
        tok["cached"] = 150  # the engine's stamp 150 us before the frontend received it
        parts += [st, tok]
        made += 1
        left -= 1
        tokens += batch
        done = np.flatnonzero(left == 0)
        if len(done):
            end = np.zeros(3 * len(done), TOKEN_DT)
            end["code"], end["ts"] = REQ_CODE, ts + 200_000
            end["event"][0::3], end["rid"][0::3], end["tokens"][0::3] = ev.REQ_FINISHED, slots[done], made[done]
            new = np.array([f"{seed}-{serial + i}".encode() for i in range(len(done))], dtype="S32")
            serial += len(done)
            end["event"][1::3], end["rid"][1::3], end["tokens"][1::3] = ev.REQ_ARRIVAL, new, 512
            end["event"][2::3], end["rid"][2::3], end["ts"][2::3] = ev.REQ_SCHEDULED, new, ts + 300_000
            parts.append(end)
            slots[done], made[done] = new, 0
            left[done] = rng.integers(1, 2 * output_tokens, len(done))
        steps += 1
        if steps % steps_per_frame == 0:
            n = sum(len(p) for p in parts)
            if sender.send(_frame(parts)):
                sent += n
            else:
                dropped += n
            parts = []
    if parts:
        n = sum(len(p) for p in parts)
        sent, dropped = (sent + n, dropped) if sender.send(_frame(parts)) else (sent, dropped + n)
    sender.close()
    out.put({"sent": sent, "dropped": dropped, "tokens": tokens, "steps": steps, "behind_s": behind,
             "delivered": sender.delivered})


# `phasescope diagnose DB --run gpu-rate-0`, then its own peak RSS (KiB) on stderr's last line
DIAGNOSE = ("import resource, sys; from phasescope.cli.main import main\n"
            "try:\n    rc = main(['diagnose', sys.argv[1], '--run', 'gpu-rate-0'])\n"
            "finally:\n    print('maxrss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
            "sys.exit(rc or 0)")


def api_url(line: str) -> str:
    """The read API's URL from the agent's "listening" line (it binds port 0 itself: no port picked here)."""
    m = re.search(r"read API on (http://[^;\s]+)", line)
    if not m:
        raise RuntimeError(f"no read API in the agent's line: {line}")
    return m.group(1).rstrip("/")


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/api/v1/health", timeout=10) as r:
        return json.loads(r.read())


def run(args: argparse.Namespace) -> dict:
    folder = tempfile.mkdtemp(prefix="ps-gpurate-", dir="/tmp")
    db, sock = os.path.join(folder, "rate.duckdb"), f"unix:{folder}/a.sock"
    cmd = [sys.executable, "-m", "phasescope.cli", "agent", "--db", db, "--listen", sock, "--api", "127.0.0.1:0",
           "--no-metrics", "--no-retention", "--fold-interval-s", str(args.fold_interval_s)]
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = agent.stdout.readline()
    if "listening" not in line:
        raise SystemExit(f"the agent did not start: {line}{agent.stdout.read()}")
    url = api_url(line)
    proc = psutil.Process(agent.pid)
    out: mp.Queue = mp.Queue()
    seconds = args.minutes * 60
    per = args.tokens_per_s / args.producers
    producers = [mp.Process(target=produce, args=(sock, f"gpu-rate-{i}", args.batch, per, seconds, args.output_tokens,
                                                  args.steps_per_frame, i + 1, out)) for i in range(args.producers)]
    t0 = time.monotonic()
    for p in producers:
        p.start()
    samples: list[dict] = []
    rss_peak = 0
    first_unfolded = None  # live fold off: when rows started to wait (the lag is then their age)
    while any(p.is_alive() for p in producers) or time.monotonic() - t0 < seconds:
        time.sleep(1.0)
        try:
            h = health(url)
        except OSError:
            continue
        rss = proc.memory_info().rss
        rss_peak = max(rss_peak, rss)
        now = time.monotonic() - t0
        if args.fold_interval_s > 0:  # the age now of the oldest event not folded (between rounds too)
            lag = time.time() - h["fold_complete_unix_s"] if h.get("fold_complete_unix_s") else now
        else:
            first_unfolded = 0.0 if first_unfolded is None else first_unfolded
            lag = now - first_unfolded
        samples.append({"t_s": now, "rows": h["rows_written_total"], "lag_s": lag, "rss_mib": rss / 2**20,
                        "behind_rows": h.get("fold_behind_rows"), "fold_failures": h.get("fold_failures_total", 0)})
        if args.verbose:
            print(samples[-1], flush=True)
    counts = [out.get(timeout=60) for _ in producers]
    for p in producers:
        p.join(30)
    elapsed = time.monotonic() - t0
    h = health(url)
    t_stop = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    agent.wait(600)
    close_s = time.monotonic() - t_stop
    log = agent.stdout.read()
    con = duckdb.connect(db, read_only=True)
    try:
        events, top = con.execute("SELECT count(*), coalesce(max(rowid), -1) FROM request_events").fetchone()
        st = con.execute("SELECT wm FROM derived_state WHERE name = 'request_events'").fetchone()
        stored_tokens = con.execute("SELECT coalesce(sum(tokens), 0) FROM request_events WHERE event = 'token'").fetchone()[0]
    finally:
        con.close()
    close_fold_ok = st is not None and st[0] >= top
    size = os.path.getsize(db) + (os.path.getsize(db + ".wal") if os.path.exists(db + ".wal") else 0)
    sent = sum(c["sent"] for c in counts)
    tokens = sum(c["tokens"] for c in counts)
    lags = [s["lag_s"] for s in samples[len(samples) // 10:]] or [0.0]  # past the first tenth (warm-up)
    res = {"tokens_per_s": stored_tokens / elapsed, "target_tokens_per_s": args.tokens_per_s, "minutes": elapsed / 60,
           "producers": args.producers, "batch": args.batch, "sent_records": sent,
           "dropped": sum(c["dropped"] for c in counts) + (sent - sum(c["delivered"] for c in counts)),
           "tokens_sent": tokens, "tokens_stored": int(stored_tokens), "producer_behind_max_s": max(c["behind_s"] for c in counts),
           "lag_p50_s": statistics.median(lags), "lag_max_s": max(lags), "rss_peak_mib": rss_peak / 2**20,
           "rss_base_mib": samples[0]["rss_mib"] if samples else None,
           # what the settings let the agent hold on top of its base: DuckDB's read memory (the fold's too) + the
           # ingest budget (defaults 512 + 32 MiB); the base is the agent's RSS at its first sample
           "memory_setting_mib": (samples[0]["rss_mib"] if samples else 0) + 512 + 32, "bytes_per_token": size / max(1, stored_tokens),
           "store_bytes": size, "store_tokens": int(stored_tokens), "request_events": events,
           "fold_interval_s": args.fold_interval_s, "fold_failures": h.get("fold_failures_total", 0),
           "close_s": close_s, "close_fold_ok": close_fold_ok}
    if args.diagnose:
        t = time.monotonic()
        d = subprocess.run([sys.executable, "-c", DIAGNOSE, db], capture_output=True, text=True)
        res["diagnose_s"] = time.monotonic() - t
        res["diagnose_rc"] = d.returncode
        res["diagnose_rss_mib"] = float(d.stderr.strip().splitlines()[-1].split()[-1]) / 1024  # its own peak, KiB
    res["samples"] = samples
    res["agent_log_tail"] = log[-2000:]
    if args.keep:
        res["db"] = db
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--tokens-per-s", type=float, default=80_000.0)
    ap.add_argument("--producers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=256, help="mean output length of a request")
    ap.add_argument("--steps-per-frame", type=int, default=8)
    ap.add_argument("--fold-interval-s", type=float, default=5.0, help="the agent's --fold-interval-s (0: no live fold)")
    ap.add_argument("--diagnose", action="store_true", help="time `phasescope diagnose` on the store at the end")
    ap.add_argument("--keep", action="store_true", help="keep the store (its path is in the JSON)")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--out", help="path prefix: the figures and samples as JSON, the table as markdown, beside it")
    args = ap.parse_args()
    res = run(args)
    t = Table(title=f"store at a GPU's rate: {args.producers} producers, batch {args.batch}, "
                    f"live fold every {args.fold_interval_s:g} s" if args.fold_interval_s else "live fold off")
    t.add_column("figure")
    t.add_column("value", justify="right")
    keys = ("tokens_per_s", "target_tokens_per_s", "minutes", "dropped", "producer_behind_max_s", "lag_p50_s",
            "lag_max_s", "rss_base_mib", "rss_peak_mib", "memory_setting_mib", "bytes_per_token", "store_tokens", "request_events",
            "fold_failures", "close_s", "close_fold_ok", "diagnose_s", "diagnose_rss_mib")
    for k in keys:
        if k in res:
            v = res[k]
            t.add_row(k, f"{v:,.2f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v))
    Console().print(t)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(res, f, indent=1)
        with open(args.out + ".md", "w") as f:
            Console(file=f, width=120, color_system=None).print(t)


if __name__ == "__main__":
    main()
