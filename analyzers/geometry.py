"""Model geometry from an HF `config.json`, a live model's config, or run labels.

Everything the KV planner and the rooflines need: layers, attention and KV
heads, head dim, hidden and MLP sizes, vocabulary, parameter count, dtype.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "float8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
    "int4": 0.5, "fp4": 0.5, "nvfp4": 0.5,
}


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a dtype name ("bf16", "torch.bfloat16", "fp8", "int4", ...)."""
    key = str(dtype).lower().replace("torch.", "").strip()
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]


@dataclass(frozen=True)
class ModelGeometry:
    """The shape of a decoder-only transformer (sizes in elements, not bytes)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int = 0
    intermediate: int = 0
    vocab: int = 0
    params: float = 0.0  # parameter count; estimated from the shapes when not given
    dtype: str = "bfloat16"  # weight dtype
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        if min(self.layers, self.heads, self.kv_heads, self.head_dim) <= 0:
            raise ValueError("layers, heads, kv_heads and head_dim must be > 0")
        if not self.params:
            object.__setattr__(self, "params", float(estimate_params(self)))

    @property
    def weight_bytes(self) -> float:
        """Bytes of the weights in their dtype."""
        return self.params * dtype_bytes(self.dtype)

    @property
    def gqa_factor(self) -> float:
        """Query heads per KV head (KV is this many times smaller than with MHA)."""
        return self.heads / self.kv_heads


def estimate_params(g: ModelGeometry) -> int:
    """Parameters of a Llama-style model: embeddings, attention, gated MLP, norms."""
    h, hd = g.hidden or g.heads * g.head_dim, g.head_dim
    attn = h * g.heads * hd + 2 * h * g.kv_heads * hd + g.heads * hd * h
    mlp = 3 * h * g.intermediate
    per_layer = attn + mlp + 2 * h
    embed = g.vocab * h * (1 if g.tied_embeddings else 2)
    return g.layers * per_layer + embed + h


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = cfg.get(n) if isinstance(cfg, Mapping) else getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def geometry_from_config(cfg: Any) -> ModelGeometry:
    """From an HF config: a dict (config.json), a `PretrainedConfig`, or a model (its `.config`)."""
    if not isinstance(cfg, Mapping) and hasattr(cfg, "config") and not hasattr(cfg, "num_hidden_layers"):
        cfg = cfg.config
    text = _get(cfg, "text_config")
    if text is not None and _get(cfg, "num_hidden_layers") is None:
        cfg = text
    layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _get(cfg, "num_attention_heads", "n_head")
    hidden = _get(cfg, "hidden_size", "n_embd", default=0)
    if layers is None or heads is None:
        raise ValueError("config lacks num_hidden_layers / num_attention_heads")
    kv_heads = _get(cfg, "num_key_value_heads", default=heads)
    head_dim = _get(cfg, "head_dim", default=None) or hidden // heads
    dtype = str(_get(cfg, "torch_dtype", "dtype", default="bfloat16")).replace("torch.", "")
    if dtype not in DTYPE_BYTES:
        dtype = "bfloat16"
    return ModelGeometry(
        layers=int(layers), heads=int(heads), kv_heads=int(kv_heads), head_dim=int(head_dim),
        hidden=int(hidden), intermediate=int(_get(cfg, "intermediate_size", "n_inner", default=0) or 0),
        vocab=int(_get(cfg, "vocab_size", default=0)), dtype=dtype,
        tied_embeddings=bool(_get(cfg, "tie_word_embeddings", default=False)),
    )


def load_config(path: str) -> ModelGeometry:
    """Geometry from an HF `config.json` file."""
    with open(path, encoding="utf-8") as f:
        return geometry_from_config(json.load(f))


def geometry_from_labels(info: Mapping[str, str]) -> ModelGeometry | None:
    """Geometry from run labels (`model_layers`, ...); None when they are missing."""
    try:
        return ModelGeometry(
            layers=int(info["model_layers"]), heads=int(info["model_heads"]),
            kv_heads=int(info["model_kv_heads"]), head_dim=int(info["model_head_dim"]),
            hidden=int(info.get("model_hidden", 0)), intermediate=int(info.get("model_intermediate", 0)),
            vocab=int(info.get("model_vocab", 0)), params=float(info.get("model_params", 0)),
            dtype=info.get("model_dtype", "bfloat16"),
            tied_embeddings=info.get("model_tied_embeddings", "False").lower() in ("1", "true"),
        )
    except (KeyError, ValueError):
        return None


def geometry_labels(g: ModelGeometry) -> dict[str, Any]:
    """The run labels that describe `g` (inverse of `geometry_from_labels`)."""
    return {"model_layers": g.layers, "model_heads": g.heads, "model_kv_heads": g.kv_heads,
            "model_head_dim": g.head_dim, "model_hidden": g.hidden, "model_intermediate": g.intermediate,
            "model_vocab": g.vocab, "model_params": int(g.params), "model_dtype": g.dtype,
            "model_tied_embeddings": g.tied_embeddings}
