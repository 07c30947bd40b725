"""Run labels of a vLLM engine: model geometry and the vLLM flags the analyzers name, read from its `VllmConfig`
once at attach (never on the hot path)."""

from __future__ import annotations

from typing import Any

from .common import RUNTIME

# run label -> (the VllmConfig part it is read from, its attribute); "hf": the model's HF text config
CONFIG_LABELS: dict[str, tuple[str, str]] = {
    "model_layers": ("hf", "num_hidden_layers"),
    "model_heads": ("hf", "num_attention_heads"),
    "model_kv_heads": ("hf", "num_key_value_heads"),  # else model_heads
    "model_head_dim": ("hf", "head_dim"),  # else hidden // heads
    "model_hidden": ("hf", "hidden_size"),
    "model_intermediate": ("hf", "intermediate_size"),
    "model_vocab": ("hf", "vocab_size"),
    "model_dtype": ("model_config", "dtype"),  # torch.float16 -> float16
    "max_model_len": ("model_config", "max_model_len"),
    "enforce_eager": ("model_config", "enforce_eager"),
    "max_num_batched_tokens": ("scheduler_config", "max_num_batched_tokens"),
    "max_num_seqs": ("scheduler_config", "max_num_seqs"),
    "enable_chunked_prefill": ("scheduler_config", "enable_chunked_prefill"),
    "async_scheduling": ("scheduler_config", "async_scheduling"),
    "block_size": ("cache_config", "block_size"),
    "page_size": ("cache_config", "block_size"),
    "enable_prefix_caching": ("cache_config", "enable_prefix_caching"),
    "kv_cache_dtype": ("cache_config", "cache_dtype"),
    "gpu_memory_utilization": ("cache_config", "gpu_memory_utilization"),
    "num_gpu_blocks": ("cache_config", "num_gpu_blocks"),
    "tp": ("parallel_config", "tensor_parallel_size"),
    "pp": ("parallel_config", "pipeline_parallel_size"),
    "dp": ("parallel_config", "data_parallel_size"),
}


def config_labels(vllm_config: Any) -> dict[str, str]:
    """Run labels from a `VllmConfig`: model geometry and the vLLM flags the analyzers name (CONFIG_LABELS);
    a label whose part or attribute is missing, None or empty is left out."""
    out: dict[str, str] = {"runtime": RUNTIME}
    try:
        import vllm

        out["vllm_version"] = str(vllm.__version__)
    except Exception:  # noqa: BLE001
        pass
    parts = {part: getattr(vllm_config, part, None)
             for part in ("model_config", "scheduler_config", "cache_config", "parallel_config")}
    mc = parts["model_config"]
    parts["hf"] = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    fields = {label: getattr(parts[part], attr, None) for label, (part, attr) in CONFIG_LABELS.items()}
    heads, hidden = fields["model_heads"], fields["model_hidden"]
    fields["model_kv_heads"] = fields["model_kv_heads"] or heads
    fields["model_head_dim"] = fields["model_head_dim"] or (hidden // heads if hidden and heads else None)
    if mc is not None:  # str() of a torch dtype, without its module
        fields["model_dtype"] = str(getattr(mc, "dtype", "")).replace("torch.", "") or None
    for k, v in fields.items():
        if v is not None and v != "":
            out[k] = str(v)[:96]
    return out


def engine_side_labels(vllm_config: Any) -> dict[str, str]:
    """`config_labels` of an EngineCore or worker process: without `dp` unless the model is MoE. vLLM runs a
    dense model's DP engines as independent DP=1 engines (vllm/v1/engine/core.py calls
    `ParallelConfig.reconfigure_for_independent_dp_rank` before it builds the engine), so their config says
    data_parallel_size 1 whatever the server's; the API server's stat logger labels the run's true `dp`
    (vllm_plugin.StatLogger), which the DP skew reads as the engines to expect (agent/read/dp.py)."""
    labels = config_labels(vllm_config)
    try:
        moe = bool(getattr(getattr(vllm_config, "model_config", None), "is_moe", False))
    except Exception:  # noqa: BLE001 - a model config that cannot say: not MoE
        moe = False
    if not moe:
        labels.pop("dp", None)
    return labels


def _model_name(vllm_config: Any) -> str:
    mc = getattr(vllm_config, "model_config", None)
    return str(getattr(mc, "served_model_name", None) or getattr(mc, "model", "") or "vllm")


def _ranks(vllm_config: Any) -> tuple[int, int, int]:
    """(tp_size, pp_size, dp_rank) of this engine."""
    pc = getattr(vllm_config, "parallel_config", None)
    # an independent (non-MoE) DP engine is reconfigured as DP=1; data_parallel_index keeps its index
    index = getattr(pc, "data_parallel_index", None)
    if index is None:
        index = getattr(pc, "data_parallel_rank", 0)
    return (int(getattr(pc, "tensor_parallel_size", 1) or 1), int(getattr(pc, "pipeline_parallel_size", 1) or 1),
            int(index or 0))


def _cpu_has_fp8_kv() -> bool:
    """vLLM's CPU attention takes an fp8 KV cache only on x86 with AVX-512 or AMX (cpu_attn `_get_attn_isa`:
    "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"); the same two checks."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_supported())


def block_size_rule(supported: Any) -> str:
    """vLLM's `get_supported_kernel_block_sizes()` as a label: [MultipleOf(32)] -> "m32", [16, 32] -> "16,32"."""
    parts = [f"m{int(s.base)}" if hasattr(s, "base") else str(int(s)) for s in supported]
    multiples = [p for p in parts if p.startswith("m")]
    return multiples[0] if multiples else ",".join(parts)
