"""Probe + continuous-batching adapter overhead on HF `generate_batch` (CPU or CUDA).

Alternates runs without and with the probe and `HFContinuousBatching` (KV snapshot
every step) over the same prompts, and prints median wall times, their ratio, and
the per-step step time the probe measured.

    python benchmarks/cb_overhead.py                 # CPU
    python benchmarks/cb_overhead.py --device cuda   # a GPU (bf16)

The probe ships to a real `phasescope agent` process (benchmarks/agent_proc.py); `--sink` hands the records
to an in-process list instead, which hides encode, send and acks.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from phasescope.agent import attach
from phasescope.agent.probe.adapters.hf_cb import HFContinuousBatching, cb_config
from phasescope.agent.records.events import PHASES, KVSnapshot, Step

from agent_proc import AgentProcess, target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json")
    ap.add_argument("--sink", action="store_true",
                    help="records to an in-process list, not a real sidecar (hides encode, send and acks)")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=4096, pad_token_id=0, eos_token_id=None)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    rng = random.Random(0)
    system = [rng.randrange(2, 4096) for _ in range(96)]
    prompts = [system + [rng.randrange(2, 4096) for _ in range(rng.randint(16, 400))] for _ in range(args.requests)]
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1)
    cbc = cb_config(32, 512, 512)

    agent = None if args.sink else AgentProcess()

    def run(with_probe: bool, sink: list, run_id: str = "") -> tuple[float, dict]:
        probe = adapter = None
        if with_probe:
            probe = attach(model, runtime="hf-cb", **target(agent, sink.extend, run_id))
            adapter = HFContinuousBatching(probe).instrument_model(model)
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cbc,
                                   progress_bar=False)
        dt = time.perf_counter() - t0
        if adapter is not None:
            adapter.detach()
            probe.close()
            assert probe.errors == 0 and probe.dropped == 0, (probe.errors, probe.dropped)
        return dt, {k: v.generated_tokens for k, v in out.items()}

    run(False, [])  # warm-up
    base, probed, records = [], [], []
    for r in range(args.rounds):
        for with_probe in ((False, True) if r % 2 == 0 else (True, False)):
            sink: list = []
            dt, toks = run(with_probe, sink, f"cb-{r}")
            (probed if with_probe else base).append(dt)
            if with_probe:
                records, probed_toks = sink, toks
            else:
                base_toks = toks
    if agent is None:
        steps = [x for x in records if type(x) is Step]
        snaps = [x for x in records if type(x) is KVSnapshot]
    else:  # the last probed round's records, as the store holds them
        last = f"cb-{args.rounds - 1}"
        steps = agent.steps(last)
        import duckdb

        with duckdb.connect(agent.db, read_only=True) as con:
            snaps = con.execute("SELECT count(*) FROM kv_snapshots JOIN sources USING (source_id) WHERE run_id = ?",
                                [last]).fetchone()[0] * [None]
        agent.close()
    by_phase: dict[str, list[Step]] = {}
    for s in steps:
        by_phase.setdefault(PHASES[s.phase], []).append(s)
    res = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               requests=args.requests, new_tokens=args.new_tokens, rounds=args.rounds,
               without_s=statistics.median(base), with_s=statistics.median(probed),
               ratio=statistics.median(probed) / statistics.median(base), steps=len(steps), kv_snapshots=len(snaps),
               same_tokens=probed_toks == base_toks,
               transport="in-process sink (no encode, send, acks)" if args.sink else "real sidecar process",
               phases={p: dict(steps=len(v), gpu_ms_p50=statistics.median(
                   [s.gpu_ms for s in v if not math.isnan(s.gpu_ms)] or [math.nan]),
                   host_ms_p50=statistics.median(s.host_ms for s in v)) for p, v in by_phase.items()})
    print(f"\n{res['device']} · generate_batch of {args.requests} requests x {args.new_tokens} tokens · "
          f"{args.rounds} alternating rounds")
    print(f"without probe {res['without_s'] * 1e3:.1f} ms · with probe + adapter {res['with_s'] * 1e3:.1f} ms · "
          f"ratio {res['ratio']:.4f} · same tokens: {res['same_tokens']}")
    print(f"{res['steps']} steps, {res['kv_snapshots']} KV snapshots (one per step)")
    for p, v in res["phases"].items():
        print(f"  {p:8} {v['steps']:>5} steps  gpu p50 {v['gpu_ms_p50']:.3f} ms  host p50 {v['host_ms_p50']:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
