"""The probe on CUDA: event timing, exact token counts by asynchronous readback, and no device sync.

Skipped without a GPU (CI has none); run on a GPU machine with `pytest tests/agent/test_probe_cuda.py`.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from phasescope.agent import attach  # noqa: E402
from phasescope.agent.records.events import PHASES, Step  # noqa: E402
from hang import HANG_S  # noqa: E402


@pytest.fixture(scope="module")
def cuda_llama(tiny_llama):
    import copy

    return copy.deepcopy(tiny_llama).to("cuda", torch.bfloat16)


def test_cuda_steps_are_event_timed_with_exact_counts(cuda_llama):
    ids = torch.tensor([[0, 0, 0, 0, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [0, 0, 9, 9, 9, 9, 9]], device="cuda")
    mask = (ids != 0).long()
    got: list[Step] = []
    with attach(cuda_llama, sink=lambda recs: got.extend(r for r in recs if type(r) is Step), gpu_budget=None) as probe:
        cuda_llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                            eos_token_id=None)
    assert probe.errors == 0 and probe.gpu_unsampled == 0
    got.sort(key=lambda s: s.step_id)
    assert [PHASES[s.phase] for s in got] == ["prefill"] + ["decode"] * 5
    assert (got[0].num_seqs, got[0].prefill_tokens) == (3, 15)
    assert [s.context_tokens for s in got[1:]] == [15 + 3 * k for k in range(5)]
    assert all(not math.isnan(s.gpu_ms) and s.gpu_ms > 0 for s in got)


def test_hooks_never_synchronize_the_device(cuda_llama):
    captured = {}

    def grab(m, a, k):
        captured.setdefault(k["input_ids"].shape[1], dict(k))

    h = cuda_llama.register_forward_pre_hook(grab, with_kwargs=True)
    ids = torch.tensor([[3, 4, 5, 6]], device="cuda")
    cuda_llama.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                        pad_token_id=0, eos_token_id=None)
    h.remove()
    probe = attach(cuda_llama, connect=False)
    try:
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises (and would be counted)
        try:
            for kw in captured.values():
                for _ in range(50):
                    probe._pre_hook(cuda_llama, (), kw)
                    probe._post_hook(cuda_llama, (), kw, None)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert probe.errors == 0
    finally:
        probe.close()


def test_continuous_batching_on_cuda_exact_counts_and_event_timing(cuda_llama):
    from transformers import GenerationConfig

    from phasescope.agent.probe.adapters.hf_cb import HFContinuousBatching, cb_config
    from phasescope.agent.records.events import KVSnapshot, PrefixCounters

    got: list = []
    probe = attach(cuda_llama, sink=got.extend, runtime="hf-cb", gpu_budget=None)
    adapter = HFContinuousBatching(probe).instrument_model(cuda_llama)
    system = list(range(2, 66))
    prompts = [system + [100 + i] * (5 + 7 * i) for i in range(6)]
    try:
        out = cuda_llama.generate_batch(
            inputs=prompts, generation_config=GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1),
            continuous_batching_config=cb_config(32, 64, 256),
            progress_bar=False)
    finally:
        adapter.detach()
        probe.close()
    assert len(out) == 6 and probe.errors == 0
    steps = [r for r in got if type(r) is Step]
    prefix = [r for r in got if type(r) is PrefixCounters][-1]
    assert steps and all(not math.isnan(s.gpu_ms) for s in steps)
    # packed counts read back asynchronously: every prompt token is prefilled or a prefix hit
    assert sum(s.prefill_tokens for s in steps) == sum(map(len, prompts)) - prefix.hit_tokens_total
    assert sum(s.decode_tokens for s in steps) == 6 * 7  # the first token of each comes from its prefill
    assert any(type(r) is KVSnapshot and r.used_pages > 0 for r in got)


def test_captures_of_a_probed_module_with_a_busy_poller_all_succeed():
    """Issue 9's failure: capture_end raised cudaErrorStreamCaptureInvalidated, then the RNG was broken."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
    x = torch.randn(8, 256, device="cuda")
    model(x)
    torch.cuda.synchronize()
    g0 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g0):
        out0 = model(x)
    g0.replay()
    torch.cuda.synchronize()
    ref = out0.clone()
    got: list[Step] = []
    probe = attach(model, sink=lambda recs: got.extend(r for r in recs if type(r) is Step), gpu_budget=None,
                   poll_interval_s=0.0002)
    try:
        for _ in range(10):
            for _ in range(20):
                model(x)  # the poller is busy with these when the capture begins
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = model(x)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ref)
        torch.randn(16, device="cuda").sum().item()  # the RNG state survived
        assert probe.flush(HANG_S)
    finally:
        probe.close()
    assert probe.errors == 0 and probe.captured == 10
    assert len(got) == 200 and all(not math.isnan(s.gpu_ms) for s in got)
