"""KV capacity planner: bytes per token and per sequence, sequences that fit a budget.

    KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x dtype_bytes

With tensor parallelism each rank holds `kv_heads / tp` heads; when a model has
fewer KV heads than ranks, each head is replicated on `tp / kv_heads` ranks, so
a rank still holds one head and the total grows by that factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from .geometry import ModelGeometry, dtype_bytes

GIB = 1 << 30


def kv_bytes_per_token(g: ModelGeometry, kv_dtype: str = "bf16") -> float:
    """KV bytes one token takes across the whole model (all layers, all KV heads)."""
    return 2 * g.layers * g.kv_heads * g.head_dim * dtype_bytes(kv_dtype)


def kv_bytes_per_sequence(g: ModelGeometry, context_tokens: int, kv_dtype: str = "bf16") -> float:
    """KV bytes of one sequence of `context_tokens` tokens."""
    return kv_bytes_per_token(g, kv_dtype) * context_tokens


def check_tp(g: ModelGeometry, tp: int) -> None:
    """Raise ValueError unless `tp` ranks can hold the KV heads: `tp` divides kv_heads (each rank holds
    kv_heads / tp) or is a multiple of it (each head replicated tp / kv_heads times), as vLLM requires."""
    if tp < 1:
        raise ValueError("tp must be >= 1")
    if g.kv_heads % tp and tp % g.kv_heads:
        fits = sorted({d for d in range(1, g.kv_heads + 1) if g.kv_heads % d == 0} | {2 * g.kv_heads, 4 * g.kv_heads})
        raise ValueError(f"TP {tp} cannot split {g.kv_heads} KV heads (neither divides the other); "
                         f"use one of {', '.join(map(str, fits))}")


def kv_heads_per_rank(g: ModelGeometry, tp: int) -> int:
    """KV heads each of `tp` ranks holds (at least one: replication below kv_heads ranks)."""
    check_tp(g, tp)
    return max(1, math.ceil(g.kv_heads / tp))


def replication_factor(g: ModelGeometry, tp: int) -> float:
    """How many ranks hold each KV head (1 when tp <= kv_heads)."""
    return kv_heads_per_rank(g, tp) * tp / g.kv_heads


def kv_bytes_per_token_per_rank(g: ModelGeometry, tp: int, kv_dtype: str = "bf16") -> float:
    return 2 * g.layers * kv_heads_per_rank(g, tp) * g.head_dim * dtype_bytes(kv_dtype)


def max_sequences(g: ModelGeometry, context_tokens: int, budget_bytes_per_gpu: float, tp: int = 1,
                  kv_dtype: str = "bf16") -> int:
    """Concurrent sequences of `context_tokens` that fit a per-GPU KV budget at TP `tp`."""
    per_seq = kv_bytes_per_token_per_rank(g, tp, kv_dtype) * context_tokens
    return int(budget_bytes_per_gpu // per_seq) if per_seq > 0 else 0


@dataclass(frozen=True)
class PlanRow:
    tp: int
    kv_dtype: str
    bytes_per_token_per_rank: float
    bytes_per_sequence_per_rank: float
    replication: float  # ranks holding each KV head
    replication_bytes_per_sequence: float  # extra bytes per sequence across ranks that replication costs
    budget_bytes_per_gpu: float
    max_sequences: int
    weight_bytes_per_gpu: float | None


def default_budget(gpu_mem_bytes: float, weights_per_gpu: float | None, kv_fraction: float = 0.45,
                   activation_fraction: float = 0.20, margin: float = 0.05) -> float:
    """The KV budget of one GPU when none is given, bytes: what its share of the weights leaves (less the
    `margin`), split between activations and KV in the ratio of the 30/20/45/5 starting split (KV gets
    45/(45+20) of it), so it grows as TP spreads the weights. Without known weights: `kv_fraction` of memory."""
    if weights_per_gpu is None:
        return kv_fraction * gpu_mem_bytes
    left = gpu_mem_bytes * (1 - margin) - weights_per_gpu
    return max(0.0, left * kv_fraction / (kv_fraction + activation_fraction))


def plan(g: ModelGeometry, context_tokens: int, budget_bytes_per_gpu: float | None = None,
         tps: Iterable[int] = (1,), kv_dtypes: Iterable[str] = ("bf16",), gpu_mem_bytes: float | None = None,
         kv_fraction: float = 0.45, weights_known: bool = True) -> list[PlanRow]:
    """One row per (TP layout, KV dtype).

    Without an explicit per-GPU budget, the budget is `default_budget`: on each GPU, what its share of
    the weights (weights / TP) leaves, less a 5% margin, split between activations and KV as the 30/20/45/5
    starting split does (45:20). `weights_known`: False when the geometry lacks the MLP and vocabulary
    sizes (the weights are then not counted and the budget is `kv_fraction` of memory).
    """
    if context_tokens <= 0:
        raise ValueError("context_tokens must be > 0")
    if budget_bytes_per_gpu is not None and budget_bytes_per_gpu <= 0:
        raise ValueError("the KV budget must be > 0 bytes")
    rows = []
    for tp in tps:
        check_tp(g, tp)
        weights = g.weight_bytes / tp if g.params and weights_known else None
        budget = budget_bytes_per_gpu
        if budget is None:
            if gpu_mem_bytes is None:
                raise ValueError("give a KV budget or the GPU memory")
            budget = default_budget(gpu_mem_bytes, weights, kv_fraction)
        for dt in kv_dtypes:
            per_tok = kv_bytes_per_token_per_rank(g, tp, dt)
            per_seq = per_tok * context_tokens
            rep = replication_factor(g, tp)
            total_needed = kv_bytes_per_sequence(g, context_tokens, dt)
            rows.append(PlanRow(tp, dt, per_tok, per_seq, rep, per_seq * tp - total_needed, budget,
                                int(budget // per_seq) if per_seq else 0, weights))
    return rows
