"""KV planner and geometry: exact figures of the KV arithmetic (docs/definitions.md; docs/tuning.md)."""

from __future__ import annotations

import json

import pytest

from phasescope.analyzers.geometry import ModelGeometry, dtype_bytes, geometry_from_config, load_config
from phasescope.analyzers.kvplan import (
    GIB, kv_bytes_per_sequence, kv_bytes_per_token, kv_bytes_per_token_per_rank, max_sequences, plan,
    replication_factor,
)

G28 = ModelGeometry(layers=28, heads=28, kv_heads=8, head_dim=128)

LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
             "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
             "vocab_size": 32000, "torch_dtype": "float16", "tie_word_embeddings": False}


def test_gqa_sequence_at_2048_tokens_bf16():
    # 2 x 28 x 8 x 128 x 2048 x 2 (the source text's 1.17 GB is the 40-head figure's mistake)
    assert kv_bytes_per_sequence(G28, 2048, "bf16") == 234_881_024
    assert kv_bytes_per_sequence(G28, 2048, "bf16") * 64 == 15_032_385_536  # ~15 GB for 64 sequences


def test_mha_40_heads_4096_tokens():
    g = ModelGeometry(layers=28, heads=40, kv_heads=40, head_dim=128)
    assert kv_bytes_per_sequence(g, 4096, "bfloat16") == 2_348_810_240  # 2.35 GB


def test_quantized_kv_and_gqa_factor():
    assert kv_bytes_per_token(G28, "fp8") * 2 == kv_bytes_per_token(G28, "bf16")
    assert kv_bytes_per_token(G28, "int4") * 4 == kv_bytes_per_token(G28, "bf16")
    mha = ModelGeometry(layers=28, heads=32, kv_heads=32, head_dim=128)
    gqa = ModelGeometry(layers=28, heads=32, kv_heads=8, head_dim=128)
    assert kv_bytes_per_token(gqa) * 4 == kv_bytes_per_token(mha)
    assert dtype_bytes("torch.bfloat16") == 2
    with pytest.raises(ValueError):
        dtype_bytes("fp12")


def test_tp_split_and_replication():
    assert kv_bytes_per_token_per_rank(G28, 2) == kv_bytes_per_token(G28) / 2
    assert replication_factor(G28, 8) == 1
    assert replication_factor(G28, 16) == 2  # 8 KV heads on 16 ranks: each head on 2 ranks
    assert kv_bytes_per_token_per_rank(G28, 16) == kv_bytes_per_token(G28) / 8


def test_max_sequences_for_a_budget():
    # 40 GiB / 234,881,024 B = 182.86 -> 182 sequences of 2048 tokens at TP 1, bf16
    assert max_sequences(G28, 2048, 40 * GIB, tp=1, kv_dtype="bf16") == 182
    assert max_sequences(G28, 2048, 40 * GIB, tp=1, kv_dtype="fp8") == 365
    assert max_sequences(G28, 2048, 40 * GIB, tp=2, kv_dtype="bf16") == 365
    rows = plan(G28, 2048, 40 * GIB, tps=(1, 2, 4, 8, 16), kv_dtypes=("bf16", "fp8"))
    assert [(r.tp, r.kv_dtype, r.max_sequences) for r in rows[:4]] == [
        (1, "bf16", 182), (1, "fp8", 365), (2, "bf16", 365), (2, "fp8", 731)]
    last = rows[-2]  # tp 16, bf16: replicated, no better than tp 8
    assert (last.tp, last.replication, last.max_sequences) == (16, 2.0, rows[-4].max_sequences)
    assert last.replication_bytes_per_sequence == kv_bytes_per_sequence(G28, 2048)


def test_llama2_7b_config(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(LLAMA2_7B))
    g = load_config(str(p))
    assert (g.layers, g.heads, g.kv_heads, g.head_dim, g.dtype) == (32, 32, 32, 128, "float16")
    assert g.params == 6_738_415_616  # the published Llama-2-7B parameter count
    assert g.weight_bytes == 2 * 6_738_415_616


def test_live_model_config(tiny_llama):
    g = geometry_from_config(tiny_llama)  # a model: its .config
    assert (g.layers, g.heads, g.kv_heads, g.head_dim, g.hidden) == (2, 4, 2, 16, 64)
    assert g.params == sum(p.numel() for p in tiny_llama.parameters())


def test_default_budget_subtracts_each_ranks_weights():
    """plan-kv without --budget-gib: what each GPU's share of the weights leaves (less 5%), 45:20 between KV and
    activations; it read 33.5 GiB at TP 1 and TP 8 alike for Llama-3-8B on an H100 (issue 23)."""
    from phasescope.analyzers.geometry import ModelGeometry
    from phasescope.analyzers.gpus import lookup
    from phasescope.analyzers.kvplan import default_budget

    llama3_8b = ModelGeometry(layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=14336,
                              vocab=128256, dtype="bfloat16")
    mem = lookup("H100-SXM").mem_bytes
    rows = {r.tp: r for r in plan(llama3_8b, 8192, tps=(1, 8), gpu_mem_bytes=mem)}
    w = llama3_8b.weight_bytes
    for tp in (1, 8):
        assert rows[tp].weight_bytes_per_gpu == w / tp
        assert rows[tp].budget_bytes_per_gpu == pytest.approx((mem * 0.95 - w / tp) * 45 / 65, rel=1e-12)
    assert rows[8].budget_bytes_per_gpu - rows[1].budget_bytes_per_gpu == pytest.approx(w * 7 / 8 * 45 / 65)  # 9.7 GB
    assert default_budget(mem, None) == 0.45 * mem  # weights unknown: the starting split's 45%
    with pytest.raises(ValueError, match="TP 3 cannot split 8 KV heads"):
        plan(llama3_8b, 8192, 40 * GIB, tps=(3,))


# --- edges and messages (issue 31: each survivor of the kvplan mutation run, killed by a value) ---

def test_check_tp_refuses_zero_and_names_every_tp_that_fits():
    from phasescope.analyzers.kvplan import check_tp

    with pytest.raises(ValueError, match="tp must be >= 1"):
        check_tp(G28, 0)
    check_tp(G28, 1)  # one rank holds every head
    # the divisors of 8 KV heads, and 2x / 4x replication, in order
    with pytest.raises(ValueError) as e:
        check_tp(G28, 3)
    assert str(e.value) == "TP 3 cannot split 8 KV heads (neither divides the other); use one of 1, 2, 4, 8, 16, 32"
    with pytest.raises(ValueError) as e:
        check_tp(ModelGeometry(layers=2, heads=6, kv_heads=6, head_dim=64), 4)
    assert str(e.value).endswith("use one of 1, 2, 3, 6, 12, 24")


def test_replication_is_a_float_and_max_sequences_defaults_to_one_rank():
    assert isinstance(replication_factor(G28, 16), float) and isinstance(replication_factor(G28, 8), float)
    assert max_sequences(G28, 2048, 40 * GIB) == 182  # tp defaults to 1
    assert max_sequences(G28, 0, 40 * GIB) == 0  # no tokens per sequence: no sequence is sized, none counted
    assert max_sequences(G28, -1, 40 * GIB) == 0  # nor a negative count of them
    one = ModelGeometry(layers=1, heads=1, kv_heads=1, head_dim=1)  # int4: 2 x 1 x 1 x 1 x 0.5 = 1 byte a token
    assert max_sequences(one, 1, 10, kv_dtype="int4") == 10


def test_plan_rows_are_frozen_and_default_to_one_rank():
    import dataclasses

    (row,) = plan(G28, 2048, 40 * GIB)  # tps defaults to (1,)
    assert (row.tp, row.max_sequences) == (1, 182)
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.tp = 2  # type: ignore[misc]


@pytest.mark.parametrize("context, budget, ok", [(0, 40 * GIB, False), (-1, 40 * GIB, False), (1, 40 * GIB, True),
                                                 (2048, 0, False), (2048, -5, False), (2048, 1, True),
                                                 (2048, 0.5, True)])
def test_plan_refuses_a_context_or_budget_at_or_below_zero(context, budget, ok):
    if ok:
        (row,) = plan(G28, context, budget)
        assert row.max_sequences == int(budget // (kv_bytes_per_token(G28) * context))
    else:
        with pytest.raises(ValueError, match="must be > 0"):
            plan(G28, context, budget)


def test_weights_per_gpu_are_exact_and_absent_when_not_known():
    g = ModelGeometry(layers=28, heads=28, kv_heads=8, head_dim=128, params=1001.0, dtype="bfloat16")
    (row,) = plan(g, 2048, 40 * GIB, tps=(4,))
    assert row.weight_bytes_per_gpu == 2002 / 4 == 500.5  # true division: a floor would say 500
    (row,) = plan(G28, 2048, 40 * GIB, weights_known=False)
    assert row.weight_bytes_per_gpu is None


def test_default_budget_is_zero_when_the_weights_leave_nothing():
    from phasescope.analyzers.kvplan import default_budget

    assert default_budget(80 * GIB, 79 * GIB) == 0.0  # 95% of 80 GiB < 79 GiB of weights
    assert default_budget(80 * GIB, 0.0) == pytest.approx(80 * GIB * 0.95 * 45 / 65, rel=1e-12)
