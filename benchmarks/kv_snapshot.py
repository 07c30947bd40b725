"""Cost of one paged-KV snapshot (µs), at 1k and 64k pages, against a decode step.

Two measurements:
- synthetic: the adapter's accounting (`page_stats_fast`, plus the O(free) largest-run
  scan that runs every snapshot up to 4096 pages and every 16th above) on page tables
  shaped like a busy server (90% of pages used, 32 pages per sequence, 2-page shared prefix);
- real: `hf_page_stats` on a live HF `PagedAttentionCache` of 1024 pages under
  continuous batching (random-weight Llama, CPU), next to that run's decode step time.

    python benchmarks/kv_snapshot.py
"""

from __future__ import annotations

import random
import statistics
import time

from phasescope.agent.records.kvmath import largest_run, page_stats_fast


def median_us(fn, n: int = 50) -> float:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        xs.append(time.perf_counter_ns() - t0)
    return statistics.median(xs) / 1e3


def synthetic(total: int) -> tuple[float, float]:
    rng = random.Random(0)
    pages = list(range(total))
    rng.shuffle(pages)
    per_seq = 32
    seqs = int(total * 0.9) // per_seq
    tables = [(per_seq, per_seq * 16 - rng.randrange(16)) for _ in range(seqs)]
    shared = {pages[0]: seqs, pages[1]: seqs}
    free = pages[seqs * per_seq:]

    def counts():
        page_stats_fast(16, total, tables, shared, len(free), 0, 0)

    def scan():
        largest_run(list(free))

    return median_us(counts), median_us(scan)


def real_hf(num_blocks: int = 1024) -> tuple[float, float, int]:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from phasescope.agent import attach
    from phasescope.agent.probe.adapters.hf_cb import HFContinuousBatching, hf_page_stats
    from phasescope.agent.records.events import PHASE_DECODE, Step

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      pad_token_id=0, eos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    steps: list[Step] = []
    probe = attach(model, sink=lambda recs: steps.extend(r for r in recs if type(r) is Step))
    adapter = HFContinuousBatching(probe).instrument_model(model)
    timings: list[float] = []
    gc = GenerationConfig(max_new_tokens=48, do_sample=False, eos_token_id=-1)
    cbc = ContinuousBatchingConfig(num_blocks=num_blocks, page_size=32, max_batch_tokens=2048)
    manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)

    def measure(m, a):
        bp = manager.batch_processor
        t0 = time.perf_counter_ns()
        hf_page_stats(bp.cache, bp.scheduler.active_requests)
        timings.append((time.perf_counter_ns() - t0) / 1e3)

    hook = model.register_forward_pre_hook(measure)
    manager.start()
    rng = random.Random(0)
    system = [rng.randrange(2, 512) for _ in range(96)]
    for i in range(48):
        manager.add_request(system + [rng.randrange(2, 512) for _ in range(rng.randint(100, 600))], max_new_tokens=48)
    done = 0
    while done < 48:
        r = manager.get_result(timeout=60)
        if r is None:
            break
        done += r.is_finished()
    manager.stop(block=True, timeout=30)
    hook.remove()
    adapter.detach()
    probe.close()
    decode = [s.host_ms * 1e3 for s in steps if s.phase == PHASE_DECODE]
    return statistics.median(timings), statistics.median(decode), num_blocks


def main() -> None:
    print(f"{'case':44} {'pages':>6} {'median us':>10}")
    for total in (1024, 65536):
        counts, scan = synthetic(total)
        per_snapshot = counts + (scan if total <= 4096 else scan / 16)
        print(f"{'synthetic: counts (every snapshot)':44} {total:>6} {counts:>10.1f}")
        print(f"{'synthetic: largest free run scan':44} {total:>6} {scan:>10.1f}")
        print(f"{'synthetic: amortised per snapshot':44} {total:>6} {per_snapshot:>10.1f}")
    snap, decode, blocks = real_hf()
    print(f"{'real HF PagedAttentionCache: hf_page_stats':44} {blocks:>6} {snap:>10.1f}")
    print(f"{'  (that run: decode step, host time)':44} {'':>6} {decode:>10.1f}")
    print(f"snapshot / decode step = {snap / decode:.2%}")


if __name__ == "__main__":
    main()
