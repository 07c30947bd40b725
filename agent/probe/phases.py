"""Phase classification of one engine step: pure arithmetic on token counts.

Two input shapes are understood:
- padded batches (HF `generate`): batch size, new tokens per sequence, cached
  tokens per sequence and the number of real (unpadded) tokens;
- packed batches (continuous batching, vLLM): per-sequence query lengths and key
  lengths from `cu_seq_lens_q` / `cu_seq_lens_k`.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from ..records.events import PHASE_DECODE, PHASE_IDLE, PHASE_MIXED, PHASE_PREFILL


class StepShape(NamedTuple):
    """What one forward computes, in tokens."""

    phase: int
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    context_tokens: int


def classify_padded(batch: int, new_len: int, cache_len: int, real_tokens: int | None) -> StepShape:
    """A padded [batch, new_len] forward over a cache already holding `cache_len` columns.

    `real_tokens` is the number of ones in the attention mask (all columns, cached
    and new), or None when no mask was given (then every position is real).
    A forward adding more than one token per sequence is a prefill (first chunk,
    next chunk or verification of draft tokens); one token per sequence over a
    non-empty cache is a decode.
    """
    if batch <= 0 or new_len <= 0:
        return StepShape(PHASE_IDLE, 0, 0, 0, 0)
    total = (cache_len + new_len) * batch if real_tokens is None else real_tokens
    if cache_len == 0:
        return StepShape(PHASE_PREFILL, batch, total, 0, 0)
    new = batch * new_len
    context = max(total - new, 0)
    if new_len == 1:
        return StepShape(PHASE_DECODE, batch, 0, new, context)
    return StepShape(PHASE_PREFILL, batch, new, 0, context)


def classify_packed(cu_q: Sequence[int], cu_k: Sequence[int] | None) -> StepShape:
    """A packed forward: sequence i has q = cu_q[i+1]-cu_q[i] new tokens and k keys.

    A sequence with one new token over earlier keys (k > q == 1) is decoding;
    anything else (first or later prompt chunk) is prefilling. A step holding
    both is `mixed`. Without `cu_k`, q == 1 counts as decode.
    """
    n = len(cu_q) - 1
    prefill_tok = decode_tok = context = 0
    n_prefill = n_decode = 0
    for i in range(n):
        q = cu_q[i + 1] - cu_q[i]
        if q <= 0:
            continue
        k = cu_k[i + 1] - cu_k[i] if cu_k is not None else q + (1 if q == 1 else 0)
        cached = max(k - q, 0)
        context += cached
        if q == 1 and cached > 0:
            decode_tok += 1
            n_decode += 1
        else:
            prefill_tok += q
            n_prefill += 1
    seqs = n_prefill + n_decode
    if seqs == 0:
        phase = PHASE_IDLE
    elif n_prefill and n_decode:
        phase = PHASE_MIXED
    elif n_prefill:
        phase = PHASE_PREFILL
    else:
        phase = PHASE_DECODE
    return StepShape(phase, seqs, prefill_tok, decode_tok, context)


def phase_of(prefill_tokens: int, decode_tokens: int) -> int:
    """The phase of a step computing these token counts (a runtime adapter's batch)."""
    if prefill_tokens > 0:
        return PHASE_MIXED if decode_tokens > 0 else PHASE_PREFILL
    return PHASE_DECODE if decode_tokens > 0 else PHASE_IDLE
