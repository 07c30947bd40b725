"""The probe on a real (random-weight) HF Llama under `generate`, through a real sidecar and DuckDB."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from phasescope.agent import attach  # noqa: E402
from phasescope.agent.sidecar.store import Store  # noqa: E402


def _left_padded(rows: list[list[int]]):
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def _steps(sidecar, run_id):
    sidecar.stop()
    con = Store.open_readonly(sidecar.db_path)
    try:
        return con.execute(
            """SELECT step_id, phase, num_seqs, prefill_tokens, decode_tokens, context_tokens, host_ms, gpu_ms
               FROM steps JOIN sources USING (source_id) WHERE run_id = ? ORDER BY step_id""", [run_id]
        ).fetchall()
    finally:
        con.close()


def test_one_step_per_forward_with_phase_and_token_counts(tiny_llama, sidecar):
    rows = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [9, 9, 9, 9, 9]]  # 15 real tokens, width 7
    ids, mask = _left_padded(rows)
    new_tokens = 6
    forwards = []  # an independent count of forwards, by our own hook
    counter = tiny_llama.register_forward_pre_hook(lambda m, a, k: forwards.append(k["input_ids"].shape), with_kwargs=True)
    try:
        with attach(tiny_llama, agent=f"unix:{sidecar.bound[0].path}", runtime="hf-generate") as probe:
            out = tiny_llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                      do_sample=False, pad_token_id=0, eos_token_id=None)
            run_id = probe.run_id
        assert probe.dropped == 0 and probe.errors == 0
    finally:
        counter.remove()
    assert out.shape == (3, 7 + new_tokens)
    steps = _steps(sidecar, run_id)
    assert len(steps) == len(forwards) == new_tokens
    assert [s[0] for s in steps] == list(range(new_tokens))
    first = steps[0]
    assert first[1:6] == ("prefill", 3, 15, 0, 0)
    for k, s in enumerate(steps[1:], start=1):
        # decode step k: 3 new tokens over 15 prompt tokens + (k - 1) generated per row
        assert s[1:6] == ("decode", 3, 0, 3, 15 + 3 * (k - 1)), s
    assert all(s[6] > 0 for s in steps)  # host_ms
    assert all(s[7] != s[7] for s in steps)  # gpu_ms is NaN on CPU


def test_probe_does_not_change_tokens_and_detaches_cleanly(tiny_llama, sidecar):
    ids, mask = _left_padded([[3, 4, 5, 6], [7, 8]])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref = tiny_llama.generate(**kw)
    probe = attach(tiny_llama, agent=f"unix:{sidecar.bound[0].path}")
    with pytest.raises(ValueError, match="already attached"):
        attach(tiny_llama)
    got = tiny_llama.generate(**kw)
    probe.close()
    assert torch.equal(ref, got)
    assert not tiny_llama._forward_pre_hooks and not tiny_llama._forward_hooks
    probe2 = attach(tiny_llama, connect=False)  # attach again after close works
    probe2.close()


def test_hook_errors_never_reach_the_host(tiny_llama):
    probe = attach(tiny_llama, connect=False)
    try:
        probe._inspect = None  # break the probe: the pre-hook now raises inside
        ids = torch.tensor([[1, 2, 3]])
        out = tiny_llama.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert out.shape == (1, 5)
        assert probe.errors == 2  # one per forward
    finally:
        probe.close()


def test_bad_arguments_raise_at_construction(tiny_llama):
    with pytest.raises(TypeError):
        attach(object())
    with pytest.raises(ValueError):
        attach(tiny_llama, rank=2, world_size=2, connect=False)
    with pytest.raises(ValueError):
        attach(tiny_llama, agent="tcp:nohost", connect=False)
