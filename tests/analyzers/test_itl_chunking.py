"""The chunk-size prediction of `itl-spikes-prefill` against a second real run (issue 13 acceptance).

HF continuous batching on CPU serves one workload twice, at a per-step token budget of 2048 (prompts
prefilled whole) and at 256 (chunked). The first run's attribution and fit predict the p99 ITL at 256; the
second run measures it. The workload is closed-loop rounds: four short requests start decoding, and 40 ms
later a prompt of 1-1.5k tokens arrives and is prefilled next to them. Each round therefore stalls each
decoder once (whole) or once per chunk (chunked) however fast the machine is: the stalls are ~2% of the ITL
samples, so the p99 is a stall in both runs.

(An earlier version let the decoders run on a wall clock while five prompts arrived 1.2 s apart: on a fast
machine the decoders finished before most prompts came, the stalls fell below 1% of the samples and the
p99 became an ordinary decode gap - 20 ms "whole" against 70 ms chunked in one CI run, 431 ms alone.)

A shared 2-core machine slows single steps at random, so the check takes three pairs of runs (big, small,
big, small, ...) and compares the medians: the predicted saving of p99 ITL must be within 20% of the
measured one, widened by the noise measured in the same test (the spread of the three chunked runs' p99).
"""

from __future__ import annotations

import os
import statistics

import duckdb
import pytest

from phasescope.agent.read.queries import itl_attribution
from phasescope.analyzers.itl import predict_p99, prefill_fit

BIG, SMALL = 2048, 256
PAIRS = 3
ROUNDS, DECODERS, DECODE_TOKENS = 6, 4, 48  # per round: four short requests decode 48 tokens each
LONG_AFTER_S = 0.04  # the round's long prompt (1024-1536 tokens) arrives this long after its decoders


def workload() -> list:
    """Closed-loop rounds: each long prompt is prefilled while the same four requests are decoding."""
    import random

    from phasescope.cli.demo import DemoRequest

    rng = random.Random(13)
    system = [rng.randrange(2, 4096) for _ in range(32)]
    out = [DemoRequest("warm-up", [1] + system, 4, 0.0)]  # the engine's first steps are slow: before the rounds
    for k in range(ROUNDS):
        out += [DemoRequest(f"dec-{k}-{i}", [1] + system + [rng.randrange(2, 4096) for _ in range(16)],
                            DECODE_TOKENS, 0.0, wait_idle=i == 0) for i in range(DECODERS)]
        out.append(DemoRequest(f"long-{k}", [1] + [rng.randrange(2, 4096) for _ in range(rng.randint(1024, 1536))],
                               8, LONG_AFTER_S))
    return out


def record(path: str, budget: int) -> tuple[duckdb.DuckDBPyConnection, str]:
    from phasescope.cli.demo import DemoConfig, record_workload
    from builders.scenarios import reniced

    cfg = DemoConfig(device="cpu", page_size=32, num_pages=1024, max_batch_tokens=budget)
    with reniced(-20, 1):  # the engine ahead of the machine's other work, torch on one thread
        run = record_workload(path, cfg, workload())
    return duckdb.connect(path, read_only=True), run


@pytest.mark.slow
def test_predicted_saving_matches_runs_at_the_smaller_chunk(tmp_path):
    pairs = []
    for i in range(PAIRS):  # big, small, big, small, ...: each pair under the same machine load
        con_a, run_a = record(os.path.join(tmp_path, f"a{i}.duckdb"), BIG)
        con_b, run_b = record(os.path.join(tmp_path, f"b{i}.duckdb"), SMALL)
        a, b = itl_attribution(con_a, run_a), itl_attribution(con_b, run_b)
        fit = prefill_fit(con_a, run_a)
        predicted = predict_p99(con_a, run_a, SMALL, fit["ms_per_prefill_token"], fit["pure_decode_p50_ms"])
        pairs.append({"p99_a": a["itl_p99_ms"], "p99_b": b["itl_p99_ms"], "predicted_p99_b": predicted,
                      "predicted_saving": a["itl_p99_ms"] - predicted, "measured_saving": a["itl_p99_ms"] - b["itl_p99_ms"],
                      "share_a": a["tail_prefill_share"], "host_a": a["tail_host_share"],
                      "ms_per_prefill_token": fit["ms_per_prefill_token"],
                      "max_prefill_b": con_b.execute("SELECT max(prefill_tokens) FROM steps").fetchone()[0],
                      # whole prompts / chunks prefilled in a step that also decoded (each stalls the decoders)
                      "stalled_a": con_a.execute("SELECT count(*) FROM steps WHERE prefill_tokens >= 1000 "
                                                 "AND decode_tokens > 0").fetchone()[0],
                      "stalled_b": con_b.execute("SELECT count(*) FROM steps WHERE prefill_tokens >= 200 "
                                                 "AND decode_tokens > 0").fetchone()[0]})
        con_a.close()
        con_b.close()
    predicted = statistics.median(p["predicted_saving"] for p in pairs)
    measured = statistics.median(p["measured_saving"] for p in pairs)
    p99_a = statistics.median(p["p99_a"] for p in pairs)
    print(f"\n{pairs}\nmedian saving of p99 ITL at {SMALL} tokens: predicted {predicted:.1f} ms, measured {measured:.1f} ms "
          f"({(predicted - measured) / measured:+.0%}); median p99 at {BIG}: {p99_a:.1f} ms")
    assert all(p["max_prefill_b"] <= SMALL for p in pairs)  # the second runs did chunk
    # every first run's ITL tail is its whole prompts, apart from what the machine's load added in that run
    # (host stalls: gaps far over their step's compute): prefill holds at least half of the rest
    assert all(p["share_a"] >= 0.5 * (1 - p["host_a"]) for p in pairs), pairs
    # every long prompt was prefilled next to decoding requests: the chunked runs' stalls are the tail too
    assert all(p["stalled_a"] == ROUNDS and p["stalled_b"] >= 4 * ROUNDS for p in pairs), pairs
    assert measured > 0.3 * p99_a, pairs  # chunking removes most of the p99 (the prefills are the tail)
    # the part of the p99 ITL that chunking to SMALL removes: predicted from the first runs vs measured, within
    # 20% plus the noise of the measurement itself on this machine now: how far the same chunked run's p99 moved
    # across the pairs (a few ms on a quiet machine; more when other work takes the CPU)
    noise = max(p["p99_b"] for p in pairs) - min(p["p99_b"] for p in pairs)
    print(f"noise (spread of the {PAIRS} chunked p99s): {noise:.1f} ms")
    assert abs(predicted - measured) <= 0.2 * measured + noise, (pairs, noise)
