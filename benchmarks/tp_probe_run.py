"""The probe on real tensor-parallel ranks: HF `tp_plan="auto"` over NCCL, one probe per rank.

Start a sidecar, then torchrun this script; every rank attaches a probe with the same
run id, and the sidecar stores per-rank steps (same step ids, CUDA-event times), which
`rank_steps` and the `tp-straggler` rule read.

    phasescope agent --db tp.duckdb --listen unix:/tmp/ps-tp.sock --no-metrics --no-api &
    torchrun --nproc_per_node 2 benchmarks/tp_probe_run.py --agent unix:/tmp/ps-tp.sock
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from phasescope.agent import attach


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agent", required=True)
    ap.add_argument("--model-dir", default="/tmp/phasescope-tp-model")
    ap.add_argument("--run-id", default="tp-run")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    done = os.path.join(args.model_dir, "ready")
    if rank == 0 and not os.path.exists(done):  # random weights, saved once so every rank loads its shard
        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                          num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096,
                          pad_token_id=0, eos_token_id=None)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(args.model_dir)
        open(done, "w").close()
    while not os.path.exists(done):
        time.sleep(0.5)
    model = LlamaForCausalLM.from_pretrained(args.model_dir, tp_plan="auto", dtype=torch.bfloat16).eval()
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 32000, (8, 384), generator=g).to(device)
    with torch.inference_mode():
        model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)  # warm-up
        probe = attach(model, address=args.agent, rank=rank, world_size=world, run_id=args.run_id, runtime="hf-tp")
        for _ in range(3):
            model.generate(input_ids=ids, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
                           eos_token_id=None)
        probe.close()
    print(f"rank {rank}: {probe.steps} steps, {probe.dropped} dropped, {probe.errors} errors", flush=True)


if __name__ == "__main__":
    main()
