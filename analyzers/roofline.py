"""Rooflines: memory-bandwidth utilisation (MBU) of decode, FLOP utilisation (MFU) of prefill.

    decode  MBU = (weight_bytes / tp + kv_bytes_read) / step_s / peak_bytes_per_s
    prefill MFU = (2 * params * tokens + attention_flops) / step_s / peak_flops

Attention FLOPs of a prefill chunk of `t` new tokens over `c` cached ones:
4 * layers * heads * head_dim * t * (c + (t + 1) / 2)  (QK^T and PV, causal).
"""

from __future__ import annotations

from .geometry import ModelGeometry


def mbu(weight_bytes: float, kv_bytes_read: float, step_s: float, peak_bytes_per_s: float, tp: int = 1) -> float:
    """Share of peak memory bandwidth one decode step achieves (per rank)."""
    if step_s <= 0 or peak_bytes_per_s <= 0:
        raise ValueError("step_s and peak_bytes_per_s must be > 0")
    return (weight_bytes / tp + kv_bytes_read) / step_s / peak_bytes_per_s


def attention_flops(g: ModelGeometry, new_tokens: int, cached_tokens: int = 0) -> float:
    """Causal attention FLOPs of a prefill of `new_tokens` after `cached_tokens`."""
    return 4.0 * g.layers * g.heads * g.head_dim * new_tokens * (cached_tokens + (new_tokens + 1) / 2)


def mfu(params: float, tokens: int, step_s: float, peak_flops: float, attn_flops: float = 0.0, tp: int = 1) -> float:
    """Share of peak FLOP/s one prefill step achieves (per rank)."""
    if step_s <= 0 or peak_flops <= 0:
        raise ValueError("step_s and peak_flops must be > 0")
    return (2.0 * params * tokens + attn_flops) / tp / step_s / peak_flops


def decode_step_floor_s(weight_bytes: float, kv_bytes_read: float, peak_bytes_per_s: float, tp: int = 1) -> float:
    """The bandwidth-bound lower bound of one decode step."""
    return (weight_bytes / tp + kv_bytes_read) / peak_bytes_per_s
