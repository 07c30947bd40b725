"""Issue 25: what the probe's background work adds to a ~1 ms step that releases the GIL once (the shape
of a host sync), with a live sidecar process and a high record rate, and whether the probe's own account
of its cost agrees with the slowdown measured.

One run, interleaved blocks (order rotating), the same host loop in each:
- `off`: the bare step;
- `hooks`: inside `probe.step()` plus 9 request events per step (10 records a step, ~9,000 a second)
  on a probe without a transport (`connect=False`: each wake drops the ring, counted), so its
  background thread has nothing to encode or send;
- `live`: the same on a probe shipping to a live sidecar process (encode, send, acks).
`live` against `hooks` is what the background work adds; `live` against `off` is the probe's whole cost.
Each step is timed twice: its wall time, and its wall time less the host thread's wait for a CPU over the
step (its run-queue wait, from Linux schedstat read around the step, ~1.5 us a read outside the timed
span). The second is what the step takes with a core free for the host, the case the budget is about; on
a quiet machine the two agree (both printed). The verdicts use the second (issue 31): on 2 cores shared
with 4 spinners and 5 pytest workers the step waited 0.7-1.8 ms per step for a core and the wall figures
swung from block to block (hooks -> 7-68%, background's part -27% -> +44% over 6 runs; busy run 9 failed
on them) while the figures less the wait stayed within 0.3% (noise 0.16-0.27%, background's part
-0.3% -> +0.3%). Waiting for the GIL is not a run-queue wait: a background thread that holds the GIL
still shows as host time.
Per block: the median step, and the mean step with each step capped at CAP x the median `off` step (a
step the machine descheduled for 10 ms says nothing about the probe, while a wake's GIL hold, bounded
by one chunk's encode, stays inside the cap). Noise is measured in the same run: the typical deviation of
the `off` blocks from their median, per statistic, widens every bound.

Checked:
- the background thread adds at most THREADS_BOUND (+ noise) to the median step;
- the live probe's reported total (hooks + background CPU per step, ProbeHealth) agrees with the measured
  slowdown of the median step: it lies between the hooks' share and UNTIMED x the total share, widened by
  the noise (the background CPU can run beside a host waiting on its sync, so the total is an upper bound;
  the hooks run on the host's thread, so they are a lower one; UNTIMED covers the Python call around each
  span the probe times), and the hooks' measured share is at most UNTIMED x their reported share.
The capped mean is printed, not checked: less the run-queue wait its noise is small (0.1-0.5%), but it does
not see what it would check: a background spinning 0.3 ms with the GIL held per 0.5 ms wake (95% of a core)
moved it 0.35-0.64% in three runs, its spin falling inside the host's sync.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time

import pytest
import torch

from phasescope.agent import attach
from hang import HANG_S

pytestmark = pytest.mark.slow

BUSY_S = 0.0002  # host work holding the GIL, per step
SYNC_S = 0.0008  # then the GIL released (a sync)
EVENTS = 9  # request events per step: 10 records a step
ROUNDS, BLOCK = 9, 300
CAP = 4
THREADS_BOUND = 0.02  # the background thread may add at most 2% (+ noise) to the median 1 ms step
UNTIMED = 2.0  # the probe's measured host cost may be at most twice what it reports (+ noise)
IDS = [f"r{i}" for i in range(BLOCK)]


def _step() -> None:
    t_end = time.perf_counter() + BUSY_S
    while time.perf_counter() < t_end:
        pass
    time.sleep(SYNC_S)


class _Schedstat:
    """The calling thread's Linux schedstat, read without allocating a file object per step: (ns on a CPU, ns
    runnable without one); (0, 0) where the kernel has no schedstats (then nothing is taken off).
    Not the sidecar's `host.schedstat`, which opens the file per read: 14 us a read against 1.1 us here
    (measured), and two reads a step would widen the untimed gap between steps, where a background wake's
    GIL hold would fall unmeasured."""

    def __init__(self) -> None:
        try:
            self.fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        except OSError:
            self.fd = -1

    def read(self) -> tuple[int, int]:
        if self.fd < 0:
            return 0, 0
        cpu, wait = os.pread(self.fd, 64, 0).split()[:2]
        return int(cpu), int(wait)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)


def _block(probe, sched: _Schedstat) -> tuple[list[float], list[float]]:
    """Each step's wall time (s), and its wall time less the time the host thread waited for a CPU (s)."""
    wall, own = [], []
    for i in range(BLOCK):
        _, w0 = sched.read()
        t0 = time.perf_counter_ns()
        if probe is not None:
            with probe.step(decode_tokens=1, num_seqs=1):
                _step()
            rid, event = IDS[i], probe.request_event
            for k in range(EVENTS):
                event(rid, "token", tokens=k)
        else:
            _step()
        t1 = time.perf_counter_ns()
        _, w1 = sched.read()
        wall.append((t1 - t0) / 1e9)
        own.append((t1 - t0 - (w1 - w0)) / 1e9)
    return wall, own


@pytest.fixture()
def live_sidecar(short_tmp):
    db, sock = os.path.join(short_tmp, "t.duckdb"), os.path.join(short_tmp, "agent.sock")
    proc = subprocess.Popen([sys.executable, "-m", "phasescope.cli", "agent", "--db", db, "--listen",
                             f"unix:{sock}", "--no-api", "--no-metrics"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    assert "listening" in line, line
    yield sock
    proc.terminate()
    proc.wait(60)


def _stats(raw: dict[str, list[list[float]]]) -> dict[str, float]:
    """The run's figures from each block's steps (s): the median `off` step, the `off` blocks' noise, and the
    median over rounds of each condition's slowdown against another, for the block median and capped mean."""
    med = {c: [statistics.median(t) for t in blocks] for c, blocks in raw.items()}
    base = statistics.median(med["off"])
    cap = CAP * base
    mean = {c: [statistics.fmean(min(x, cap) for x in t) for t in blocks] for c, blocks in raw.items()}
    base_mean = statistics.median(mean["off"])

    def slowdown(stat: dict, a: str, b: str) -> float:
        return statistics.median([x / y - 1 for x, y in zip(stat[a], stat[b])])

    return {"base": base, "noise": statistics.median([abs(m / base - 1) for m in med["off"]]),
            "noise_mean": statistics.median([abs(m / base_mean - 1) for m in mean["off"]]),
            "hooks": slowdown(med, "hooks", "off"), "live": slowdown(med, "live", "off"),
            "threads": slowdown(med, "live", "hooks"), "hooks_mean": slowdown(mean, "hooks", "off"),
            "live_mean": slowdown(mean, "live", "off"), "threads_mean": slowdown(mean, "live", "hooks")}


def test_background_adds_little_to_the_median_step_and_the_reported_share_agrees(live_sidecar):
    live = attach(torch.nn.Identity(), address=f"unix:{live_sidecar}", run_id="threads")
    hooks = attach(torch.nn.Identity(), connect=False)
    probes = {"off": None, "hooks": hooks, "live": live}
    conds = list(probes)
    sched = _Schedstat()
    try:
        for p in (live, hooks):
            _block(p, sched)  # warm: connection, sampler, first wakes
        assert live.flush(HANG_S)
        cpu0, hooks0 = live.health().probe_cpu_s_total, live.sampler.hooks_ns()
        wall: dict[str, list[list[float]]] = {c: [] for c in conds}
        own: dict[str, list[list[float]]] = {c: [] for c in conds}
        for r in range(ROUNDS):
            for c in conds[r % 3:] + conds[:r % 3]:
                w, o = _block(probes[c], sched)
                wall[c].append(w)
                own[c].append(o)
        assert live.flush(HANG_S)
        time.sleep(3 * live.flush_interval_s)  # the wakes that shipped the last block are counted
        health = live.health()
        live_hooks_ns = live.sampler.hooks_ns() - hooks0
    finally:
        live.close()
        hooks.close()
        sched.close()
    assert health.dropped_total == 0 and health.errors_total == 0
    steps = ROUNDS * BLOCK
    sw, so = _stats(wall), _stats(own)
    base, noise = so["base"], so["noise"]
    hooks_share = live_hooks_ns / 1e9 / steps / base
    total_share = (health.probe_cpu_s_total - cpu0) / steps / base
    rq = {c: sum(sum(t) for t in wall[c]) - sum(sum(t) for t in own[c]) for c in conds}
    pct = lambda x: f"{100 * x:.2f}%"
    report = "; ".join(
        f"{name}: step {st['base'] * 1e3:.3f} ms, noise {pct(st['noise'])} (capped mean {pct(st['noise_mean'])}), "
        f"median step hooks {pct(st['hooks'])} live {pct(st['live'])} background's part {pct(st['threads'])}, "
        f"capped mean hooks {pct(st['hooks_mean'])} live {pct(st['live_mean'])} background's part {pct(st['threads_mean'])}"
        for name, st in (("wall", sw), ("own", so)))
    report += (f"; run-queue wait per step: " + ", ".join(f"{c} {rq[c] / steps * 1e6:.1f} us" for c in conds)
               + f"; reported: hooks {pct(hooks_share)}, "
               f"total {pct(total_share)}; wake cpu {live.cost.background_per_wake_ns() / 1e3:.0f} us over "
               f"{live.cost.wakes} wakes")
    print(report)
    assert so["threads"] <= THREADS_BOUND + 2 * noise, report
    # the reported total is an account of the probe's host time: it may miss the Python call around each timed
    # span, not the spans themselves (measured over reported hooks share, less the run-queue wait: 1.06-1.8 in 10
    # runs, quiet and beside 4 spinners and 5 pytest workers; with its request events left uncounted, 2.2-3.2,
    # failed in one of two runs: this catches a probe that misses most of its cost, not a small under-count).
    # Until issue 31 this factor was measured in the run, which let any under-count pass.
    assert so["hooks"] <= UNTIMED * hooks_share + 2 * noise, report
    assert hooks_share - 2 * noise <= so["live"] <= UNTIMED * total_share + 2 * noise, report
