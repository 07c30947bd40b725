"""Probe overhead and per-phase step times for HF `generate` on a random-weight Llama.

Prints a table: per-phase step times as the probe measured them (CUDA events on a
GPU, host time on CPU), end-to-end `generate` time without and with the probe
(alternating runs, medians and their ratio), and the probe's own cost per step
(the two hooks called in a tight loop on real decode-step arguments).

    python benchmarks/probe_overhead.py                       # CPU, tiny model
    python benchmarks/probe_overhead.py --device cuda --model 1b   # ~1.1B bf16 on a GPU

The probes ship to a real `phasescope agent` process (benchmarks/agent_proc.py); `--sink` hands the
records to an in-process list instead, which hides encode, send and acks (reported as such).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from phasescope.agent import attach

from agent_proc import AgentProcess, target
from phasescope.agent.records.events import PHASES, Step

MODELS = {
    # TinyLlama-1.1B geometry: 22 layers, 2048 hidden, 32 heads, 4 KV heads
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
    "tiny": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=4096),
}


def build(name: str, device: torch.device) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(**MODELS[name], max_position_embeddings=4096, pad_token_id=0, eos_token_id=None)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):  # initialise on the device: seconds instead of minutes for 1B
        model = LlamaForCausalLM(cfg)
    return model.to(dtype=dtype).eval()


def batch(device: torch.device, batch_size: int, vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(64, 512, (batch_size,), generator=g).tolist()
    width = max(lens)
    ids = torch.zeros((batch_size, width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        ids[i, width - n:] = torch.randint(2, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids.to(device), mask.to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the benchmark's own clock, never the probe's


def timed_generate(model, ids, mask, new_tokens, device) -> tuple[float, torch.Tensor]:
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    sync(device)
    return time.perf_counter() - t0, out


def hook_cost_us(model, ids, mask, device, iters: int) -> tuple[float, float]:
    """Median µs of (pre-hook + post-hook) on real decode-step kwargs; with and without CUDA timing."""
    captured = {}

    def grab(m, a, k):
        if k["input_ids"].shape[1] == 1 and "kw" not in captured:
            captured["kw"] = dict(k)

    h = model.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                       eos_token_id=None)
    h.remove()
    kw = captured["kw"]
    out = {}
    for timing in (True, False):
        probe = attach(model, connect=False, cuda_timing=timing, buffer_records=1 << 16)
        pre = next(iter(model._forward_pre_hooks.values()))
        post = next(iter(model._forward_hooks.values()))
        try:
            samples = []
            for _ in range(7):
                t0 = time.perf_counter_ns()
                for _ in range(iters):  # the registered hooks: compiler-disabled wrappers included
                    pre(model, (), kw)
                    post(model, (), kw, None)
                samples.append((time.perf_counter_ns() - t0) / iters / 1e3)
                probe.flush(10)
        finally:
            probe.close()
        out[timing] = statistics.median(samples)
    sync(device)
    return out[True], out[False]


class _Front(torch.nn.Module):
    """A thin module in front of the model: two of them let steps alternate probed/unprobed."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, **kw):
        return self.model(**kw)


def decode_loop_blocks(model, ids, mask, device, rounds: int, steps: int, agent=None) -> dict:
    """Decode steps of HF's forward in a plain greedy loop, alternating probed/unprobed step by step.

    On a shared VM the host's speed switches between regimes (step medians of 13 and 26 ms
    in one run), so whole runs, even interleaved blocks, carry that noise. Here consecutive
    steps alternate between two identical front modules, one probed, so both see the same
    regime; each block (a fresh prefill, then `steps` decode steps, each ending in the host
    sync a sampler needs) gives the ratio of its probed and unprobed step medians. The probed
    front sees every other step, so its sampler budgets half the real period: a conservative
    (higher) cost than a probe on every step would have.
    """
    from transformers import DynamicCache

    plain, probed = _Front(model), _Front(model)
    probe = attach(probed, **target(agent, lambda recs: None, "po-loop"))
    rows = []
    try:
        with torch.inference_mode():
            for r in range(rounds + 1):
                cache = DynamicCache()
                out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                m = mask
                on, off = [], []
                for i in range(steps):
                    front = probed if (i + r) % 2 == 0 else plain
                    m = torch.cat([m, torch.ones_like(tok)], 1)
                    t0 = time.perf_counter_ns()
                    out = front(input_ids=tok, attention_mask=m, past_key_values=out.past_key_values, use_cache=True)
                    tok = out.logits[:, -1].argmax(-1, keepdim=True)
                    tok.cpu()
                    (on if front is probed else off).append((time.perf_counter_ns() - t0) / 1e6)
                if r:  # the first block warms up
                    rows.append((statistics.median(off), statistics.median(on)))
    finally:
        probe.close()
    pairs = [b / a - 1 for a, b in rows]
    mean = statistics.fmean(pairs)
    half = _t975(len(pairs)) * statistics.stdev(pairs) / math.sqrt(len(pairs))
    off = [a for a, _ in rows]
    on = [b for _, b in rows]
    return dict(step_ms_off=statistics.median(off), step_ms_on=statistics.median(on),
                ratio=statistics.median(on) / statistics.median(off), pair_pct_mean=100 * mean,
                pair_pct_ci95_halfwidth=100 * half, rounds=rounds, steps_per_block=steps,
                block_medians_off=off, block_medians_on=on, probe_errors=probe.errors,
                gpu_sample_rate=probe.health().gpu_sample_rate)


def _t975(n: int) -> float:
    """Student t quantile 0.975 for n samples (n-1 degrees of freedom)."""
    table = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26, 11: 2.23, 12: 2.20,
             13: 2.18, 14: 2.16, 15: 2.14, 16: 2.13, 17: 2.12, 18: 2.11, 19: 2.10, 20: 2.09, 25: 2.06, 30: 2.05}
    return table.get(n, 1.96 if n > 30 else table[min(k for k in table if k >= n)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", choices=sorted(MODELS), default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="alternating with/without-probe rounds")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--sink", action="store_true",
                    help="records to an in-process list, not a real sidecar (hides encode, send and acks)")
    ap.add_argument("--loop-rounds", type=int, default=0,
                    help="also time decode steps in a plain loop, probe on/off in this many interleaved rounds")
    ap.add_argument("--cpus", help="pin this process to these CPUs (e.g. 2,3): less host-clock noise")
    args = ap.parse_args()
    if args.cpus:
        import os

        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    device = torch.device(args.device)
    name = args.model or ("1b" if device.type == "cuda" else "tiny")
    model = build(name, device)
    params = sum(p.numel() for p in model.parameters())
    ids, mask = batch(device, args.batch, model.config.vocab_size)
    timed_generate(model, ids, mask, 4, device)  # warm-up

    agent = None if args.sink else AgentProcess()
    base, probed, steps = [], [], []
    for r in range(args.rounds):
        for with_probe in ((False, True) if r % 2 == 0 else (True, False)):
            if with_probe:
                probe = attach(model, **target(agent, lambda recs: steps.extend(x for x in recs if type(x) is Step),
                                                f"po-gen-{r}"))
                try:
                    dt, out = timed_generate(model, ids, mask, args.new_tokens, device)
                finally:
                    probe.close()
                probed.append(dt)
                assert probe.errors == 0 and probe.dropped == 0, (probe.errors, probe.dropped)
            else:
                dt, ref = timed_generate(model, ids, mask, args.new_tokens, device)
                base.append(dt)
    # bf16 on a GPU need not be bit-reproducible run to run: compare against the spread of
    # the baseline itself before blaming the probe
    _, ref2 = timed_generate(model, ids, mask, args.new_tokens, device)
    baseline_deterministic = bool(torch.equal(ref, ref2))
    tokens_equal = bool(torch.equal(out, ref))

    with_t, without_t = hook_cost_us(model, ids, mask, device, iters=2000)
    lp = decode_loop_blocks(model, ids, mask, device, args.loop_rounds, args.new_tokens, agent) if args.loop_rounds \
        else None
    if agent is not None:  # the generate rounds' steps, as the store holds them
        steps = agent.steps("po-gen-")
        agent.close()
    by_phase: dict[str, list[Step]] = {}
    for s in steps:
        by_phase.setdefault(PHASES[s.phase], []).append(s)
    rows = []
    for phase, ss in sorted(by_phase.items()):
        gpu = [s.gpu_ms for s in ss if not math.isnan(s.gpu_ms)]
        rows.append(dict(phase=phase, steps=len(ss), tokens_per_step=statistics.median(
            [s.prefill_tokens + s.decode_tokens for s in ss]),
            gpu_ms_p50=statistics.median(gpu) if gpu else None, gpu_timed=len(gpu),
            host_ms_p50=statistics.median(s.host_ms for s in ss)))
    pairs = [p / b - 1 for p, b in zip(probed, base)]
    mean = statistics.fmean(pairs)
    half = (_t975(len(pairs)) * statistics.stdev(pairs) / math.sqrt(len(pairs))) if len(pairs) > 1 else math.inf
    res = dict(overhead_pct_mean=100 * mean, overhead_pct_ci95_halfwidth=100 * half, generate_s_each_without=base,
               generate_s_each_with=probed, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", model=name,
               params=params, batch=args.batch, new_tokens=args.new_tokens, rounds=args.rounds,
               generate_s_without=statistics.median(base), generate_s_with=statistics.median(probed),
               ratio=statistics.median(probed) / statistics.median(base),
               hook_us_per_step_with_cuda_events=with_t, hook_us_per_step_host_only=without_t, phases=rows,
               tokens_equal_with_probe=tokens_equal, baseline_deterministic=baseline_deterministic,
               transport="in-process sink (no encode, send, acks)" if args.sink else "real sidecar process")
    print(f"\n{res['device']} · {name} Llama ({params / 1e6:.1f} M params) · batch {args.batch} · "
          f"{args.new_tokens} new tokens · {args.rounds} alternating rounds · {res['transport']}")
    print(f"{'phase':8} {'steps':>6} {'tok/step':>9} {'gpu_ms p50':>11} {'timed':>6} {'host_ms p50':>12}")
    for r in rows:
        g = "-" if r["gpu_ms_p50"] is None else f"{r['gpu_ms_p50']:.3f}"
        print(f"{r['phase']:8} {r['steps']:>6} {r['tokens_per_step']:>9.0f} {g:>11} {r['gpu_timed']:>6} "
              f"{r['host_ms_p50']:>12.3f}")
    print(f"generate wall, median: without probe {res['generate_s_without'] * 1e3:.1f} ms, with probe "
          f"{res['generate_s_with'] * 1e3:.1f} ms, ratio {res['ratio']:.4f}")
    print(f"overhead (paired rounds): {100 * mean:+.3f}% +- {100 * half:.3f}% (95% interval, t, {len(pairs)} pairs)")
    print(f"probe cost per step (pre+post hooks, median): {with_t:.1f} us with CUDA events, "
          f"{without_t:.1f} us host-only")
    print(f"tokens with probe == without: {tokens_equal} (baseline run-to-run identical: {baseline_deterministic})")
    if lp is not None:
        res["decode_loop"] = lp
        print(f"decode loop, median step: without {lp['step_ms_off']:.3f} ms, with {lp['step_ms_on']:.3f} ms, "
              f"ratio {lp['ratio']:.4f}; paired blocks {lp['pair_pct_mean']:+.3f}% +- "
              f"{lp['pair_pct_ci95_halfwidth']:.3f}% (95%, {lp['rounds']} pairs of {lp['steps_per_block']} steps)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
