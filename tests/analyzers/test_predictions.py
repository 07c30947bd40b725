"""Predictions stated by findings, and the keep / revert verdict of a re-run (analyzers/predictions.py)."""

from __future__ import annotations

import math
import statistics

import pytest

from phasescope.analyzers.findings import Finding
from phasescope.analyzers.predictions import (Prediction, predict, t95, verdict, welch_interval,
                                              why_not_predicted)


def _finding(fid: str, **e) -> Finding:
    return Finding(id=fid, title="t", severity="warning", evidence={"query": "SELECT 1", **e}, suggestion="s",
                   expected_effect="x", reference="r", run_id="run1")


def _pred(current: float = 10.0, predicted: float = 6.0) -> Prediction:
    return Prediction("itl-spikes-prefill", "run1", "itl_p99_ms", current, predicted, predicted - 1, predicted + 1,
                      {"max_batch_tokens": 256}, "hf-cb", 0.25)


def test_welch_interval_matches_the_textbook_formula():
    a, b = [10.0, 11.0, 9.5, 10.5], [7.0, 6.5, 7.5]
    effect, lo, hi = welch_interval(a, b)
    va, vb = statistics.variance(a) / 4, statistics.variance(b) / 3
    df = (va + vb) ** 2 / (va ** 2 / 3 + vb ** 2 / 2)
    half = t95(df) * math.sqrt(va + vb)
    assert effect == pytest.approx(statistics.mean(b) - statistics.mean(a))
    assert (lo, hi) == (pytest.approx(effect - half), pytest.approx(effect + half))
    assert t95(1) == 12.706 and t95(30) == 2.042 and t95(31) == 1.96 and t95(4.9) == 2.776  # df rounded down


def test_welch_needs_two_runs_per_arm():
    with pytest.raises(ValueError):
        welch_interval([1.0], [2.0, 3.0])


def test_verdict_keep_when_it_helped_as_predicted():
    v = verdict(_pred(10.0, 6.0), [10.0, 10.2, 9.8], [6.2, 6.0, 5.8])  # effect -4.0, predicted -4.0
    assert v.verdict == "keep" and v.effect_high < 0 and v.error == pytest.approx(0.0, abs=1e-9)


def test_verdict_keep_but_mispredicted_just_past_the_tolerance():
    # measured effect -4.0; predicted -4.0 * (1 +- 0.19) keeps, +- 0.21 does not
    base, new = [10.0, 10.2, 9.8], [6.2, 6.0, 5.8]
    assert verdict(_pred(10.0, 10.0 - 4.0 * 1.19), base, new).verdict == "keep"
    assert verdict(_pred(10.0, 10.0 - 4.0 * 0.81), base, new).verdict == "keep"
    assert verdict(_pred(10.0, 10.0 - 4.0 * 1.21), base, new).verdict == "keep-but-mispredicted"
    assert verdict(_pred(10.0, 10.0 - 4.0 * 0.79), base, new).verdict == "keep-but-mispredicted"


def test_verdict_revert_on_no_gain_and_on_harm():
    noisy = verdict(_pred(), [10.0, 12.0, 8.0], [9.0, 11.5, 8.5])  # interval spans 0
    assert noisy.effect_low < 0 < noisy.effect_high and noisy.verdict == "revert"
    worse = verdict(_pred(), [10.0, 10.1, 9.9], [12.0, 12.1, 11.9])
    assert worse.effect_low > 0 and worse.verdict == "revert"
    same = verdict(_pred(), [10.0, 10.0], [10.0, 10.0])
    assert (same.effect, same.error, same.verdict) == (0.0, None, "revert")


def test_chunk_prediction_names_the_runtime_knob():
    f = _finding("itl-spikes-prefill", itl_p99_ms=40.0, predicted_itl_p99_ms=12.0, suggested_chunk_tokens=256,
                 chunked_prefill=False)
    hf = predict(f, {"runtime": "cb"})
    assert (hf.metric, hf.current, hf.predicted, hf.change) == ("itl_p99_ms", 40.0, 12.0, {"max_batch_tokens": 256})
    assert hf.low < hf.predicted < hf.high and hf.predicted_effect == -28.0
    vllm = predict(f, {"runtime": "vllm"})
    assert vllm.change == {"--max-num-batched-tokens": 256, "--enable-chunked-prefill": True}


def test_page_prediction_keeps_the_cache_memory_and_applies_the_models_effect():
    f = _finding("kv-internal-fragmentation", page_size=256, suggested_page_size=32, internal_fragmentation_mean=0.80,
                 predicted_waste_current=0.78, predicted_waste_suggested=0.10)
    p = predict(f, {"runtime": "cb", "num_pages": "64"})
    assert p.change == {"page_size": 32, "num_pages": 512}  # 64 x 256 tokens = 512 x 32
    assert p.current == 0.80 and p.predicted == pytest.approx(0.80 - 0.68)
    assert predict(f, {"runtime": "vllm"}).change == {"--block-size": 32}
    same = _finding("kv-internal-fragmentation", page_size=32, suggested_page_size=32, internal_fragmentation_mean=0.2,
                    predicted_waste_current=0.2, predicted_waste_suggested=0.2)
    assert predict(same, {"runtime": "vllm"}) is None  # nothing smaller to change to


def test_findings_without_a_number_say_why():
    assert predict(_finding("ttft-queueing"), {}) is None
    assert "capacity" in why_not_predicted("ttft-queueing")
    assert why_not_predicted("no-such-rule") == "this finding names a direction, not a number"


def test_the_predicted_effect_is_relative_to_the_rerun_baseline():
    # recorded 10 -> 6 (-40%); this machine's baseline runs measure 20: expected -8, measured -8 -> keep, error 0
    v = verdict(_pred(10.0, 6.0), [20.0, 20.2, 19.8], [12.1, 11.9, 12.0])
    assert v.expected == pytest.approx(-8.0) and v.error == pytest.approx(0.0, abs=1e-9) and v.verdict == "keep"
    # the absolute prediction (-4) would have been off by 50%
    assert verdict(_pred(10.0, 6.0), [20.0, 20.2, 19.8], [16.1, 15.9, 16.0]).verdict == "keep-but-mispredicted"


def test_the_sequence_cap_predicts_no_preemption():
    f = _finding("kv-near-cap", max_seqs_without_preemption=3, preemptions=17)
    p = predict(f, {"runtime": "cb"})
    assert (p.metric, p.current, p.predicted, p.change) == ("preemptions", 17.0, 0.0, {"max_requests_per_batch": 3})
    assert predict(f, {"runtime": "vllm"}).change == {"--max-num-seqs": 3}
    # a p95 sequence longer than the whole cache: no cap helps, no prediction
    assert predict(_finding("kv-near-cap", max_seqs_without_preemption=0, preemptions=17), {}) is None


def test_the_smaller_page_predicts_the_missed_prompt_tokens_it_serves():
    f = _finding("prefix-miss-sub-page", page_size_tokens=64, suggested_page_size_tokens=32, missed_tokens=1408,
                 smaller_page_saved_tokens=480)
    p = predict(f, {"runtime": "vllm"})
    assert (p.metric, p.current, p.predicted, p.change) == ("prefix_missed_tokens", 1408.0, 928.0, {"--block-size": 32})
    assert p.low < 928.0 < p.high
    # HF: the same cache memory in pages of the suggested size
    assert predict(f, {"runtime": "cb", "num_pages": "64"}).change == {"page_size": 32, "num_pages": 128}
    # no size the runtime takes is smaller (vllm-cpu at 32): the finding says lengthen the prefix, no number
    assert predict(_finding("prefix-miss-sub-page", page_size_tokens=32, suggested_page_size_tokens=None,
                            missed_tokens=900, smaller_page_saved_tokens=0), {"runtime": "vllm"}) is None
