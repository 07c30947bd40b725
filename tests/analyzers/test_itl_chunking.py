"""The chunk-size prediction of `itl-spikes-prefill` against a second real run (issue 13 acceptance).

HF continuous batching on CPU serves one workload twice: four requests decode through the run while five
prompts of 1-1.5k tokens arrive, at a per-step token budget of 2048 (prompts prefilled whole) and at 256
(chunked). The first run's attribution and fit predict the p99 ITL at 256; the second run measures it.

A shared 2-core machine slows single steps at random, and the p99 of the chunked run rests on its few slowest
chunk steps, so the check takes three pairs of runs (big, small, big, small, ...) and compares the medians:
the predicted saving of p99 ITL must be within 20% of the measured one. Whether chunking pays at all depends
on the machine (under load whole prefills are slow and chunking removes most of the p99; idle, HF-CB's chunk
steps cost more than the whole prompt did): when it does not, the prediction must not promise a saving.
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
DECODERS, DECODE_TOKENS = 4, 320  # short prompts that decode through the whole run
PROMPTS, PROMPT_EVERY_S = 5, 1.2  # long prompts of 1024-1536 tokens, one every 1.2 s from 0.5 s on


def workload() -> list:
    """Every long prompt is prefilled next to the same decoders, so each run's ITL tail is its prefills."""
    import random

    from phasescope.agent.demo import DemoRequest

    rng = random.Random(13)
    system = [rng.randrange(2, 4096) for _ in range(32)]
    out = [DemoRequest(f"dec-{i}", [1] + system + [rng.randrange(2, 4096) for _ in range(16)], DECODE_TOKENS,
                       0.05 * i) for i in range(DECODERS)]
    out += [DemoRequest(f"long-{i}", [1] + [rng.randrange(2, 4096) for _ in range(rng.randint(1024, 1536))], 8,
                        0.5 + PROMPT_EVERY_S * i) for i in range(PROMPTS)]
    return out


def record(path: str, budget: int) -> tuple[duckdb.DuckDBPyConnection, str]:
    from phasescope.agent.demo import DemoConfig, record_workload
    from phasescope.agent.scenarios import reniced

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
                      "share_a": a["tail_prefill_share"], "ms_per_prefill_token": fit["ms_per_prefill_token"],
                      "max_prefill_b": con_b.execute("SELECT max(prefill_tokens) FROM steps").fetchone()[0]})
        con_a.close()
        con_b.close()
    predicted = statistics.median(p["predicted_saving"] for p in pairs)
    measured = statistics.median(p["measured_saving"] for p in pairs)
    p99_a = statistics.median(p["p99_a"] for p in pairs)
    print(f"\n{pairs}\nmedian saving of p99 ITL at {SMALL} tokens: predicted {predicted:.1f} ms, measured {measured:.1f} ms "
          f"({(predicted - measured) / measured:+.0%}); median p99 at {BIG}: {p99_a:.1f} ms")
    assert all(p["max_prefill_b"] <= SMALL for p in pairs)  # the second runs did chunk
    # every first run's ITL tail is its whole prompts: the attribution names prefill
    assert all(p["share_a"] >= 0.5 for p in pairs), pairs
    if measured > 0.3 * p99_a:  # chunking removed a large part of the p99 on this machine
        # the part of the p99 ITL that chunking to SMALL removes: predicted from the first runs vs measured
        assert abs(predicted - measured) <= 0.2 * measured, pairs
    else:
        # On an idle machine a whole prompt prefills in ~15 ms here while HF-CB's chunk steps cost more per
        # token (measured in CI: p99 20 ms whole, 70 ms chunked): chunking does not pay. The prediction must
        # then not promise the saving the second runs do not show.
        assert predicted <= 0.3 * p99_a, pairs
        assert predicted <= measured + 0.2 * abs(measured), pairs  # no rosier than what was measured
