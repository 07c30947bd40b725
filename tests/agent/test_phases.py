"""Phase classification, on hand-made shapes."""

from phasescope.agent.records.events import PHASE_DECODE, PHASE_IDLE, PHASE_MIXED, PHASE_PREFILL
from phasescope.agent.probe.phases import StepShape, classify_packed, classify_padded


def test_padded_prefill_counts_only_real_tokens():
    # 2 rows of width 5, one left-padded by 2: 8 real tokens
    assert classify_padded(2, 5, 0, 8) == StepShape(PHASE_PREFILL, 2, 8, 0, 0)


def test_padded_decode_counts_context_without_padding():
    # mask is now [2, 6] with 10 ones: 2 new tokens, 8 cached real tokens
    assert classify_padded(2, 1, 5, 10) == StepShape(PHASE_DECODE, 2, 0, 2, 8)


def test_padded_without_mask_and_continuation_chunk():
    assert classify_padded(3, 1, 7, None) == StepShape(PHASE_DECODE, 3, 0, 3, 21)
    assert classify_padded(1, 4, 16, None) == StepShape(PHASE_PREFILL, 1, 4, 0, 16)
    assert classify_padded(0, 4, 0, None).phase == PHASE_IDLE


def test_packed_prefill_decode_and_mixed():
    assert classify_packed([0, 4, 10], [0, 4, 10]) == StepShape(PHASE_PREFILL, 2, 10, 0, 0)
    assert classify_packed([0, 1, 2], [0, 5, 12]) == StepShape(PHASE_DECODE, 2, 0, 2, 4 + 6)
    # one decoding sequence (k=9) and one prompt chunk of 6 over 32 cached tokens
    assert classify_packed([0, 1, 7], [0, 9, 47]) == StepShape(PHASE_MIXED, 2, 6, 1, 8 + 32)


def test_packed_one_token_prompt_is_prefill_and_empty_is_idle():
    assert classify_packed([0, 1], [0, 1]).phase == PHASE_PREFILL
    assert classify_packed([0], [0]).phase == PHASE_IDLE
