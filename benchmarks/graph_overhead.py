"""The probe next to CUDA graphs (issue 9): capture safety, cost on a ~1 ms replayed decode, torch.compile.

(a) captures: a probed module, its poller busy with events of eager forwards queued just
    before, captured with `torch.cuda.graph` (global capture mode) N times: every capture must
    succeed, replay bit-identical to an unprobed capture, the CUDA RNG usable afterwards, zero
    probe errors, and no step recorded for the captured forwards.
(b) cost: a 1.1B-size (TinyLlama geometry) bf16 decode step with a static KV cache captured
    into one graph (~1 ms). A loop replays it and syncs per step (a sampler needs the token),
    timed per step. Conditions, interleaved in rounds (order alternating): no probe; probe
    attached to the module whose forward replays the graph (module hooks); the runtime timing
    its replay with `probe.step(...)` (no module). Medians per block, ratio and us/step.
    Then accuracy: every step recorded with host time; with every step timed (budget off), the
    probe's GPU time against events recorded around the same replay by this script.
    And the fixed cost: the two registered hooks (compiler-disabled wrappers included) called
    in a tight loop with sampling at 0, and the cost of the capture check.
(c) torch.compile(mode="reduce-overhead") of a probed module: warnings, steps recorded.

    python benchmarks/graph_overhead.py --json benchmarks/results/graph_overhead_h200.json
    python benchmarks/graph_overhead.py --dry      # CPU: checks the script's shapes only

In (b) the probes ship to a real `phasescope agent` process (benchmarks/agent_proc.py) and the step
counts and GPU times are read back from its store; `--sink` hands records to an in-process list, which
hides encode, send and acks (the results files up to issue 25 were measured so).
benchmarks/sidecar_overhead.py measures (b) from attach() and in steady state, sink apart.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from phasescope.agent import attach
from phasescope.agent.records.events import PHASE_DECODE, Step
from phasescope.agent.probe.phases import StepShape

from agent_proc import AgentProcess, target

GEOMETRY = dict(hidden=2048, inter=5632, layers=22, heads=32, kv_heads=4, head_dim=64, vocab=32000)


class DecodeStack(torch.nn.Module):
    """One decode step of a Llama-geometry model over a static KV cache of `ctx` tokens."""

    def __init__(self, batch: int, ctx: int, layers: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        g = GEOMETRY
        h, kvh, hd = g["hidden"], g["kv_heads"], g["head_dim"]
        self.n_layers = layers

        def w(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape, device=device, dtype=dtype) * 0.02, requires_grad=False)

        self.qkv = torch.nn.ParameterList([w(h, h + 2 * kvh * hd) for _ in range(layers)])
        self.o = torch.nn.ParameterList([w(h, h) for _ in range(layers)])
        self.gate_up = torch.nn.ParameterList([w(h, 2 * g["inter"]) for _ in range(layers)])
        self.down = torch.nn.ParameterList([w(g["inter"], h) for _ in range(layers)])
        self.head = w(h, g["vocab"])
        self.k = [torch.randn(batch, kvh, ctx, hd, device=device, dtype=dtype) for _ in range(layers)]
        self.v = [torch.randn(batch, kvh, ctx, hd, device=device, dtype=dtype) for _ in range(layers)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = GEOMETRY
        b = x.shape[0]
        for i in range(self.n_layers):
            hs = F.rms_norm(x, (g["hidden"],))
            qkv = hs @ self.qkv[i]
            q, k, v = qkv.split([g["hidden"], g["kv_heads"] * g["head_dim"], g["kv_heads"] * g["head_dim"]], -1)
            q = q.view(b, 1, g["heads"], g["head_dim"]).transpose(1, 2)
            keys = torch.cat([self.k[i], k.view(b, 1, g["kv_heads"], g["head_dim"]).transpose(1, 2)], 2)
            vals = torch.cat([self.v[i], v.view(b, 1, g["kv_heads"], g["head_dim"]).transpose(1, 2)], 2)
            a = F.scaled_dot_product_attention(q, keys, vals, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(b, 1, g["hidden"]) @ self.o[i]
            gu = F.rms_norm(x, (g["hidden"],)) @ self.gate_up[i]
            gate, up = gu.chunk(2, -1)
            x = x + (F.silu(gate) * up) @ self.down[i]
        return (F.rms_norm(x, (g["hidden"],)) @ self.head).argmax(-1)


class GraphRunner(torch.nn.Module):
    """A runtime's decode: the forward copies the input in and replays the captured step."""

    def __init__(self, stack: DecodeStack, x: torch.Tensor, dry: bool) -> None:
        super().__init__()
        self.stack, self.dry = stack, dry
        self.static_x = x.clone()
        self.graph = None
        if not dry:
            for _ in range(3):  # warm up on a side stream, as torch.cuda.graph's docs ask
                stack(self.static_x)
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.static_out = stack(self.static_x)

    ref_events: tuple | None = None  # (start, end): the script's own events around copy + replay

    def twin(self) -> "GraphRunner":
        """Another module object over the same captured graph (a probe per object, one graph)."""
        m = GraphRunner.__new__(GraphRunner)
        torch.nn.Module.__init__(m)
        m.stack, m.dry, m.static_x, m.graph = self.stack, self.dry, self.static_x, self.graph
        if not self.dry:
            m.static_out = self.static_out
        return m

    def replay(self, x: torch.Tensor) -> torch.Tensor:
        if self.dry:
            return self.stack(x)
        ev = self.ref_events
        if ev is not None:
            ev[0].record()
        self.static_x.copy_(x)
        self.graph.replay()
        if ev is not None:
            ev[1].record()
        return self.static_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.replay(x)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def ci95(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% interval (t distribution)."""
    from statistics import NormalDist

    n = len(xs)
    m = statistics.fmean(xs)
    if n < 2:
        return m, math.inf
    t = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26, 11: 2.23, 12: 2.20,
         13: 2.18, 14: 2.16, 15: 2.14, 16: 2.13, 17: 2.12, 18: 2.11, 19: 2.10, 20: 2.09}.get(n, NormalDist().inv_cdf(0.975))
    return m, t * statistics.stdev(xs) / math.sqrt(n)


# --- (a) captures ------------------------------------------------------------------------------

def captures(n: int, device: torch.device, dtype: torch.dtype, dry: bool) -> dict:
    torch.manual_seed(0)
    model = DecodeStack(4, 256, 2, device, dtype)
    x = torch.randn(4, 1, GEOMETRY["hidden"], device=device, dtype=dtype)
    if dry:
        return dict(captures=0, skipped="dry run")

    def capture_once(m: torch.nn.Module) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):  # capture_error_mode="global", the default
            out = m(x)
        return g, out

    model(x)
    torch.cuda.synchronize()
    g0, out0 = capture_once(model)
    g0.replay()
    torch.cuda.synchronize()
    ref = out0.clone()

    steps: list[Step] = []
    probe = attach(model, sink=lambda recs: steps.extend(r for r in recs if type(r) is Step), gpu_budget=None,
                   poll_interval_s=0.0002, flush_interval_s=0.01)
    ok = identical = 0
    errors: list[str] = []
    try:
        for _ in range(50):  # eager forwards first: the poller has work
            model(x)
        for i in range(n):
            for _ in range(20):  # queued just before the capture: the poller is mid-work when it begins
                model(x)
            try:
                g, out = capture_once(model)
                g.replay()
                torch.cuda.synchronize()
                ok += 1
                identical += int(torch.equal(out, ref))
            except Exception as exc:  # noqa: BLE001 - the failure is the measurement
                errors.append(repr(exc)[:200])
        rng_ok = True
        try:
            torch.randn(1024, device=device).sum().item()
        except Exception as exc:  # noqa: BLE001
            rng_ok, errors = False, errors + [repr(exc)[:200]]
        probe.flush(10)
    finally:
        probe.close()
    eager = 50 + 20 * n
    return dict(captures=n, succeeded=ok, bit_identical=identical, rng_usable_after=rng_ok,
                probe_errors=probe.errors, captured_forwards=probe.captured, steps_recorded=len(steps),
                eager_forwards=eager, gpu_timed=sum(1 for s in steps if not math.isnan(s.gpu_ms)),
                errors=errors[:3])


# --- (b) cost of a replayed ~1 ms decode ---------------------------------------------------------

def replay_cost(batch: int, rounds: int, block: int, device: torch.device, dtype: torch.dtype, dry: bool,
                agent: AgentProcess | None = None) -> dict:
    torch.manual_seed(0)
    layers = 2 if dry else GEOMETRY["layers"]
    stack = DecodeStack(batch, 16 if dry else 512, layers, device, dtype)
    x = torch.randn(batch, 1, GEOMETRY["hidden"], device=device, dtype=dtype)
    off = GraphRunner(stack, x, dry)
    twin = off.twin

    hooked, noop = twin(), twin()
    # what any pair of hooks costs (nn.Module's hook dispatch + two compiler-disabled calls), probe or not
    nothing = torch.compiler.disable(lambda *a: None)
    noop.register_forward_pre_hook(nothing, with_kwargs=True)
    noop.register_forward_hook(nothing, with_kwargs=True, always_call=True)
    ctx = 512 * batch
    sink: list[Step] = []
    keep = lambda recs: sink.extend(r for r in recs if type(r) is Step)  # noqa: E731
    dev_opt = "cuda" if device.type == "cuda" else None
    p_mod = attach(hooked, device=dev_opt, **target(agent, keep, f"go-{batch}-mod"))
    p_api = attach(torch.nn.Identity(), device=dev_opt, **target(agent, keep, f"go-{batch}-api"))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def run(cond: str, n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            if cond == "off":
                tok = off(x)
            elif cond == "noop-hooks":
                tok = noop(x)
            elif cond == "module":
                p_mod.next_shape = StepShape(PHASE_DECODE, batch, 0, batch, ctx)  # the runtime adapter's batch
                tok = hooked(x)
            else:
                with p_api.step(PHASE_DECODE, batch, 0, batch, ctx):
                    tok = off.replay(x)
            tok.cpu()  # the sampler needs the token: a host sync per step
            times.append((time.perf_counter_ns() - t0) / 1e3)
        return times

    conds = ["off", "noop-hooks", "module", "api"]
    for cond in conds:
        run(cond, 50)  # warm-up
    p_mod.flush(10)
    p_api.flush(10)
    sink.clear()
    recorded_before = p_mod.steps + p_api.steps
    blocks: dict[str, list[float]] = {c: [] for c in conds}
    every: dict[str, list[float]] = {c: [] for c in conds}
    for r in range(rounds):
        order = conds if r % 2 == 0 else conds[::-1]
        for cond in order:
            t = run(cond, block)
            every[cond] += t
            blocks[cond].append(med(t))
    steps_run = 2 * rounds * block
    sm = p_mod.sampler
    est = dict(untimed_hook_us=sm.untimed_ns / max(sm.untimed_n, 1) / 1e3,
               timed_hook_us=sm.timed_ns / max(sm.timed_n, 1) / 1e3, poll_us=sm.poll_ns / max(sm.poll_n, 1) / 1e3,
               period_us=sm.est_period_us[PHASE_DECODE], rates=list(sm.rates), extra_us=sm.est_extra_us)
    pct = {c: [statistics.quantiles(every[c], n=10)[i] / 1e3 for i in (0, 4, 8)] for c in conds}
    p_mod.flush(10)
    p_api.flush(10)
    rate_mod, rate_api = p_mod.health().gpu_sample_rate, p_api.health().gpu_sample_rate
    s_mod = p_mod.sampler
    recorded = p_mod.steps + p_api.steps - recorded_before
    records = len(sink)

    # accuracy: every step timed, against events this script records around the same replay
    p_mod.sampler.budget = None
    p_mod.sampler.rates[:] = [1.0] * 4
    sink.clear()
    first = p_mod.steps
    ref: list[float] = []
    if device.type == "cuda":
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        hooked.ref_events = (e0, e1)
        for _ in range(300):
            p_mod.next_shape = StepShape(PHASE_DECODE, batch, 0, batch, ctx)
            tok = hooked(x)
            tok.cpu()
            ref.append(e0.elapsed_time(e1))
        hooked.ref_events = None
    p_mod.flush(10)
    deferred = None
    if agent is None:
        got = {s.step_id - first: s.gpu_ms for s in sink if s.step_id >= first}
        rel = [abs(got[i] - ref[i]) / ref[i] for i in range(len(ref)) if i in got and not math.isnan(got[i])]
    else:  # read back from the store once the agent has stopped (main)
        deferred, rel = (first, ref, recorded_before), []

    # fixed cost of an untimed step: the registered hooks (compiler-disabled wrappers) in a loop
    pre = next(iter(hooked._forward_pre_hooks.values()))
    post = next(iter(hooked._forward_hooks.values()))
    p_mod.sampler.budget, p_mod.sampler.min_rate = 1e-12, 1e-12
    p_mod.sampler.rates[:] = [0.0] * 4
    fixed = []
    shape = StepShape(PHASE_DECODE, batch, 0, batch, ctx)
    for _ in range(7):
        t0 = time.perf_counter_ns()
        for _ in range(2000):
            p_mod.next_shape = shape
            pre(hooked, (x,), {})
            post(hooked, (x,), {}, None)
        fixed.append((time.perf_counter_ns() - t0) / 2000 / 1e3)
        p_mod.flush(10)
    noop_pre = torch.compiler.disable(lambda m, a, k: None)
    noop = []
    for _ in range(7):
        t0 = time.perf_counter_ns()
        for _ in range(2000):
            noop_pre(hooked, (x,), {})
            noop_pre(hooked, (x,), {})
        noop.append((time.perf_counter_ns() - t0) / 2000 / 1e3)
    cap = []
    if device.type == "cuda":
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(2000):
                torch.cuda.is_current_stream_capturing()
            cap.append((time.perf_counter_ns() - t0) / 2000 / 1e3)
    errors = p_mod.errors + p_api.errors
    p_mod.close()
    p_api.close()
    off_ms = med(blocks["off"]) / 1e3
    res = dict(batch=batch, rounds=rounds, block_steps=block, step_ms_off=off_ms, sampler=est,
               step_ms_p10_p50_p90=pct, step_ms_noop_hooks=med(blocks["noop-hooks"]) / 1e3,
               step_ms_module=med(blocks["module"]) / 1e3, step_ms_api=med(blocks["api"]) / 1e3)
    for cond in ("noop-hooks", "module", "api"):
        pair = [a / b - 1 for a, b in zip(blocks[cond], blocks["off"])]
        m, hw = ci95(pair)
        res[f"overhead_{cond}_pct"] = 100 * (med(blocks[cond]) / med(blocks["off"]) - 1)
        res[f"overhead_{cond}_us"] = med(blocks[cond]) - med(blocks["off"])
        res[f"overhead_{cond}_pct_mean_ci95"] = (100 * m, 100 * hw)
    res.update(steps_run=steps_run, steps_recorded=recorded, step_records=records if agent is None else None,
               transport="in-process sink (no encode, send, acks)" if agent is None else "real sidecar process",
               sample_rate_module=rate_mod, sample_rate_api=rate_api,
               sampler_untimed_us=s_mod.est_untimed_us, sampler_extra_us=s_mod.est_extra_us,
               sampler_period_us=s_mod.est_period_us[PHASE_DECODE],
               gpu_vs_ref_rel_p50=med(rel), gpu_vs_ref_rel_max=max(rel) if rel else math.nan,
               gpu_compared=len(rel), fixed_hook_us=med(fixed), noop_disabled_hook_pair_us=med(noop),
               capture_check_us=med(cap), probe_errors=errors, _deferred=deferred)
    return res


def from_store(agent: AgentProcess, res: dict) -> None:
    """Fill a replay result's step count and GPU-vs-reference errors from the stopped agent's store."""
    first, ref, recorded_before = res.pop("_deferred")
    batch = res["batch"]
    mod, api = agent.steps(f"go-{batch}-mod"), agent.steps(f"go-{batch}-api")
    # the rounds' steps: those after the warm-up, before the accuracy pass
    res["step_records"] = sum(1 for s in mod if s.step_id < first) + len(api) - recorded_before
    got = {s.step_id - first: s.gpu_ms for s in mod if s.step_id >= first}
    rel = [abs(got[i] - ref[i]) / ref[i] for i in range(len(ref)) if i in got and not math.isnan(got[i])]
    res.update(gpu_vs_ref_rel_p50=med(rel), gpu_vs_ref_rel_max=max(rel) if rel else math.nan, gpu_compared=len(rel))


# --- (c) torch.compile(mode="reduce-overhead") -------------------------------------------------

def compiled(device: torch.device, dtype: torch.dtype, calls: int, dry: bool) -> dict:
    if dry:
        return dict(skipped="dry run")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).to(
        device, dtype)
    steps: list[Step] = []
    probe = attach(model, sink=lambda recs: steps.extend(r for r in recs if type(r) is Step), gpu_budget=None)
    fn = torch.compile(model, mode="reduce-overhead")
    x = torch.randn(8, 1024, device=device, dtype=dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.inference_mode():
            for _ in range(calls):
                fn(x).sum().item()
    probe.flush(10)
    probe.close()
    msgs = [f"{w.category.__name__}: {str(w.message)[:160]}" for w in caught]
    ours = [m for m in msgs if "phasescope" in m or "time." in m or "perf_counter" in m or "monotonic" in m]
    return dict(calls=calls, steps_recorded=len(steps), gpu_timed=sum(1 for s in steps if not math.isnan(s.gpu_ms)),
                captured_forwards=probe.captured, probe_errors=probe.errors, phasescope_warnings=ours,
                other_warnings=msgs[:5])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--captures", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--block", type=int, default=300, help="steps per condition per round")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--dry", action="store_true", help="CPU, tiny: check the script runs")
    ap.add_argument("--json")
    ap.add_argument("--sink", action="store_true",
                    help="records to an in-process list, not a real sidecar (hides encode, send and acks)")
    args = ap.parse_args()
    dry = args.dry or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    res = dict(device="cpu (dry)" if dry else torch.cuda.get_device_name(), torch=torch.__version__)
    res["captures"] = captures(args.captures, device, dtype, dry)
    agent = None if args.sink else AgentProcess()
    res["replay"] = [replay_cost(int(b), 2 if dry else args.rounds, 20 if dry else args.block, device, dtype, dry,
                                 agent) for b in args.batches.split(",")]
    if agent is not None:
        for r in res["replay"]:
            from_store(agent, r)
        agent.close()
    else:
        for r in res["replay"]:
            r.pop("_deferred")
    res["compile"] = compiled(device, dtype, 30, dry)

    c = res["captures"]
    print(f"\n{res['device']} · torch {res['torch']}")
    if "succeeded" in c:
        print(f"(a) captures of a probed module, poller busy: {c['succeeded']}/{c['captures']} succeeded, "
              f"{c['bit_identical']} bit-identical to the unprobed capture, RNG usable after: "
              f"{c['rng_usable_after']}, probe errors {c['probe_errors']}, captured forwards "
              f"{c['captured_forwards']} (not steps), steps {c['steps_recorded']}/{c['eager_forwards']} eager")
    print("(b) ~1 ms replayed decode, host sync per step; medians of per-block medians; "
          f"{args.rounds} interleaved rounds x {args.block} steps")
    print(f"{'batch':>5} {'off ms':>8} {'module ms':>10} {'overhead':>9} {'us':>6} {'api ms':>8} {'overhead':>9} "
          f"{'us':>6} {'rate':>6} {'gpu err p50/max':>16} {'fixed us':>9} {'capchk us':>9}")
    for r in res["replay"]:
        print(f"{r['batch']:>5} {r['step_ms_off']:>8.4f} {r['step_ms_module']:>10.4f} "
              f"{r['overhead_module_pct']:>8.3f}% {r['overhead_module_us']:>6.1f} {r['step_ms_api']:>8.4f} "
              f"{r['overhead_api_pct']:>8.3f}% {r['overhead_api_us']:>6.1f} {r['sample_rate_module']:>6.3f} "
              f"{100 * r['gpu_vs_ref_rel_p50']:>7.3f}/{100 * r['gpu_vs_ref_rel_max']:.3f}% "
              f"{r['fixed_hook_us']:>9.2f} {r['capture_check_us']:>9.2f}")
        print(f"      steps run {r['steps_run']}, recorded {r['steps_recorded']} ({r['step_records']} Step records); "
              f"probe errors {r['probe_errors']}; sampler: untimed {r['sampler_untimed_us']} us, extra "
              f"{r['sampler_extra_us']} us, period {r['sampler_period_us']} us; mean overhead module "
              f"{r['overhead_module_pct_mean_ci95'][0]:.3f} +- {r['overhead_module_pct_mean_ci95'][1]:.3f}%")
        print(f"      no-op hook pair (no probe): {r['overhead_noop-hooks_pct']:.3f}% {r['overhead_noop-hooks_us']:.1f} us;"
              f" during the rounds: {json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r['sampler'].items()})}")
        print(f"      step ms p10/p50/p90: " + ", ".join(f"{c} {'/'.join(f'{v:.4f}' for v in q)}"
                                                    for c, q in r['step_ms_p10_p50_p90'].items()))
    cc = res["compile"]
    if "calls" in cc:
        print(f"(c) torch.compile(mode='reduce-overhead'): {cc['steps_recorded']}/{cc['calls']} calls recorded, "
              f"{cc['gpu_timed']} GPU-timed, phasescope warnings {cc['phasescope_warnings']}, probe errors "
              f"{cc['probe_errors']}, captured forwards {cc['captured_forwards']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)


if __name__ == "__main__":
    main()
