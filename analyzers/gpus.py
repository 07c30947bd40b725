"""Peak figures of common GPUs (overridable) and matching of NVML device names.

Bandwidth in bytes/s; dense tensor-core FLOP/s (no sparsity) per dtype; memory in bytes.
Vendor datasheet figures; override with `GpuSpec(...)` or `--gpu-bw/--gpu-flops`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GB = 1e9
GIB = 1 << 30


@dataclass(frozen=True)
class GpuSpec:
    name: str
    mem_bw_bytes_s: float
    bf16_flops: float
    fp8_flops: float
    mem_bytes: float

    def flops(self, dtype: str = "bf16") -> float:
        return self.fp8_flops if dtype in ("fp8", "int8", "float8") and self.fp8_flops else self.bf16_flops


GPUS: dict[str, GpuSpec] = {s.name: s for s in (
    GpuSpec("B200", 8.0e12, 2.25e15, 4.5e15, 180 * GB),
    GpuSpec("H200", 4.8e12, 989e12, 1979e12, 141 * GB),
    GpuSpec("H100-SXM", 3.35e12, 989e12, 1979e12, 80 * GB),
    GpuSpec("H100-PCIe", 2.0e12, 756e12, 1513e12, 80 * GB),
    GpuSpec("A100-SXM-80GB", 2.039e12, 312e12, 0, 80 * GB),
    GpuSpec("A100-PCIe-80GB", 1.935e12, 312e12, 0, 80 * GB),
    GpuSpec("A100-40GB", 1.555e12, 312e12, 0, 40 * GB),
    GpuSpec("L40S", 864e9, 362e12, 733e12, 48 * GB),
    GpuSpec("L4", 300e9, 121e12, 242e12, 24 * GB),
    GpuSpec("A10G", 600e9, 70e12, 0, 24 * GB),
    GpuSpec("A10", 600e9, 125e12, 0, 24 * GB),
    GpuSpec("RTX-4090", 1.008e12, 165e12, 330e12, 24 * GB),
    GpuSpec("V100", 900e9, 125e12, 0, 32 * GB),
    GpuSpec("T4", 320e9, 65e12, 0, 16 * GB),
)}

# NVML name patterns -> table key (first match wins)
_NVML = [
    (r"H200", "H200"), (r"B200", "B200"),
    (r"H100.*PCIe", "H100-PCIe"), (r"H100", "H100-SXM"),
    (r"A100.*(PCIE.*80|80.*PCIE)", "A100-PCIe-80GB"), (r"A100.*80", "A100-SXM-80GB"), (r"A100", "A100-40GB"),
    (r"L40S", "L40S"), (r"\bL4\b", "L4"), (r"A10G", "A10G"), (r"\bA10\b", "A10"),
    (r"4090", "RTX-4090"), (r"V100", "V100"), (r"\bT4\b", "T4"),
]


def lookup(name: str | None) -> GpuSpec | None:
    """The spec for a table key ("H100-SXM") or an NVML name ("NVIDIA H100 80GB HBM3"); None if unknown."""
    if not name:
        return None
    if name in GPUS:
        return GPUS[name]
    for key, spec in GPUS.items():
        if key.lower() == name.lower():
            return spec
    for pattern, key in _NVML:
        if re.search(pattern, name, re.IGNORECASE):
            return GPUS[key]
    return None


def nvml_name(index: int = 0) -> str | None:
    """The NVML name of GPU `index`, or None without NVML / a GPU (never raises)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))
            return name.decode() if isinstance(name, bytes) else str(name)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None
