"""Run labels a probe sends by itself: model geometry, dtype, weight bytes, GPU, TP size.

Keys are the ones the analyzers read (`model_layers`, `model_kv_heads`, ...,
`gpu_name`, `gpu_mem_bytes`, `tp`); values are text. Computed once at attach.
"""

from __future__ import annotations

from typing import Any


def model_labels(model: Any, world_size: int = 1) -> dict[str, str]:
    """Labels from an HF-style model (`.config`) and its parameters; {} for what is unknown."""
    out: dict[str, str] = {"tp": str(world_size)}
    cfg = getattr(model, "config", None)
    if cfg is not None:
        get = getattr(cfg, "get_text_config", None)
        text = get() if callable(get) else cfg
        heads = getattr(text, "num_attention_heads", None)
        hidden = getattr(text, "hidden_size", None)
        fields = {
            "model_layers": getattr(text, "num_hidden_layers", None),
            "model_heads": heads,
            "model_kv_heads": getattr(text, "num_key_value_heads", None) or heads,
            "model_head_dim": getattr(text, "head_dim", None) or (hidden // heads if hidden and heads else None),
            "model_hidden": hidden,
            "model_intermediate": getattr(text, "intermediate_size", None),
            "model_vocab": getattr(text, "vocab_size", None),
        }
        out.update({k: str(v) for k, v in fields.items() if v is not None})
    try:
        params = list(model.parameters())
    except (AttributeError, TypeError):
        params = []
    if params:
        out["model_params"] = str(sum(p.numel() for p in params))
        out["weight_bytes"] = str(sum(p.numel() * p.element_size() for p in params))
        out["model_dtype"] = str(params[0].dtype).replace("torch.", "")
        device = params[0].device
        if device.type == "cuda":
            import torch

            props = torch.cuda.get_device_properties(device)
            out["gpu_name"] = props.name
            out["gpu_mem_bytes"] = str(props.total_memory)
    return out
