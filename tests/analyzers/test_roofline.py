"""Rooflines and the GPU table."""

from __future__ import annotations

import math

import pytest

from phasescope.analyzers.geometry import ModelGeometry
from phasescope.analyzers.gpus import GPUS, lookup
from phasescope.analyzers.roofline import attention_flops, decode_step_floor_s, mbu, mfu


def test_mbu_databricks_example():
    # 7B parameters in fp16 = 14 GB read per token at batch 1; TPOT 14 ms on 2 TB/s -> 50%
    weight_bytes = 7e9 * 2
    assert math.isclose(mbu(weight_bytes, 0.0, 0.014, 2e12), 0.5, rel_tol=1e-12)
    assert math.isclose(decode_step_floor_s(weight_bytes, 0.0, 2e12), 0.007, rel_tol=1e-12)
    assert math.isclose(mbu(weight_bytes, 0.0, 0.007, 2e12, tp=2), 0.5, rel_tol=1e-12)


def test_mfu():
    # 2 x 7e9 x 1000 FLOPs in 0.1 s on 756 TFLOP/s
    assert math.isclose(mfu(7e9, 1000, 0.1, 756e12), 1.4e14 / 756e12, rel_tol=1e-12)
    g = ModelGeometry(layers=1, heads=1, kv_heads=1, head_dim=1)
    assert attention_flops(g, 2, 0) == 4 * 2 * 1.5  # QK^T and PV over a causal 2-token prefill
    with pytest.raises(ValueError):
        mbu(1, 0, 0, 1)


@pytest.mark.parametrize("nvml,key", [
    ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA H100 PCIe", "H100-PCIe"), ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-80GB", "A100-SXM-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A100 80GB PCIe", "A100-PCIe-80GB"), ("NVIDIA A10G", "A10G"), ("NVIDIA L4", "L4"),
    ("NVIDIA L40S", "L40S"), ("Tesla T4", "T4"), ("NVIDIA GeForce RTX 4090", "RTX-4090"), ("h100-sxm", "H100-SXM"),
])
def test_nvml_names(nvml, key):
    assert lookup(nvml) is GPUS[key]


def test_unknown_gpu():
    assert lookup("Radeon 9000") is None and lookup(None) is None
