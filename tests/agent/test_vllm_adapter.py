"""The vLLM adapter's pure parts and guards (no vLLM needed): token split per step,
phase, guarded wrappers, the one-shot class catcher, the plugin switched off without
PHASESCOPE_AGENT. The real-vLLM checks are in test_vllm_integration.py."""

from __future__ import annotations

import pytest

from phasescope.agent.records.events import PHASE_DECODE, PHASE_IDLE, PHASE_MIXED, PHASE_PREFILL
from phasescope.agent.probe.adapters import vllm as adapter
from phasescope.agent.probe.adapters import vllm_plugin


@pytest.mark.parametrize("start,n,prompt,tokens,expected", [
    (0, 240, 240, 240, (240, 0)),  # whole prompt
    (192, 48, 240, 240, (48, 0)),  # the rest of a prompt after a prefix hit
    (0, 128, 240, 240, (128, 0)),  # first chunk of a chunked prefill
    (240, 1, 240, 241, (0, 1)),  # decode of the first output token
    (250, 1, 240, 251, (0, 1)),  # later decode
    (192, 64, 240, 256, (63, 1)),  # resumed after preemption: 63 recomputed, then the latest token decodes
])
def test_split_tokens(start, n, prompt, tokens, expected):
    assert adapter.split_tokens(start, n, prompt, tokens) == expected


def test_step_shape_phases_and_counts():
    assert adapter.step_shape([]) == (PHASE_IDLE, 0, 0, 0, 0)
    assert adapter.step_shape([(240, 0, 0), (48, 0, 192)]) == (PHASE_PREFILL, 2, 288, 0, 192)
    assert adapter.step_shape([(0, 1, 240), (0, 1, 250)]) == (PHASE_DECODE, 2, 0, 2, 490)
    assert adapter.step_shape([(100, 0, 0), (0, 1, 240)]) == (PHASE_MIXED, 2, 100, 1, 240)


class _Target:
    def __init__(self):
        self.calls = []

    def work(self, x, *, y=0):
        self.calls.append((x, y))
        return x + y


class _Probe:
    def __init__(self):
        self.errors = 0

    def _error(self, exc):
        self.errors += 1


def test_wrap_never_raises_into_the_host_and_returns_its_result():
    t, p = _Target(), _Probe()
    seen = []

    def boom(*a, **k):
        raise RuntimeError("adapter bug")

    assert adapter.wrap(t, "work", lambda r, *a, **k: seen.append(r), lambda: p, before=boom)
    assert t.work(2, y=3) == 5 and seen == [5] and p.errors == 1
    adapter.wrap(t, "work", boom, lambda: p)
    assert t.work(1) == 1 and p.errors == 3  # both layers of wrappers failed, the host did not notice
    assert t.calls == [(2, 3), (1, 0)]


def test_wrap_before_may_replace_the_arguments():
    class Pool:
        def free(self, blocks):
            return sum(blocks)

    pool, p, seen = Pool(), _Probe(), []
    # vLLM passes iterators: `before` copies them so the host and the hook both see every item
    adapter.wrap(pool, "free", lambda r, blocks: seen.append(list(blocks)), lambda: p,
                 before=lambda blocks: (list(blocks),))
    assert pool.free(iter([1, 2])) == 3 and seen == [[1, 2]] and p.errors == 0


def test_missing_internals_are_counted_not_raised():
    before = adapter.failures().get("no_such_method", 0)
    assert not adapter.wrap(_Target(), "no_such_method", lambda *a, **k: None, lambda: None)
    assert adapter.failures()["no_such_method"] == before + 1


def test_catch_first_wraps_once_then_puts_the_class_back():
    class Engine:
        def __init__(self, n):
            self.n = n

    original = Engine.__dict__["__init__"]
    caught = []
    adapter._catch_first(Engine, "__init__", lambda inst: caught.append(inst.n) or "hooks")
    assert Engine.__dict__["__init__"] is not original
    a = Engine(1)
    assert caught == [1] and Engine.__dict__["__init__"] is original
    Engine(2)
    assert caught == [1] and a.n == 1


def test_plugin_is_off_without_phasescope_agent(monkeypatch):
    monkeypatch.delenv("PHASESCOPE_AGENT", raising=False)
    assert not vllm_plugin.enabled()
    vllm_plugin.register()  # no-op, no vLLM import needed
    logger = vllm_plugin.StatLogger(vllm_config=None, engine_index=0)
    assert logger.probe is None
    logger.record(None, None)  # inert


def test_config_labels_from_a_config_shaped_object():
    class NS:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    cfg = NS(model_config=NS(hf_text_config=NS(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               hidden_size=128, intermediate_size=256, vocab_size=1024),
                             dtype="torch.float16", max_model_len=1024, enforce_eager=False),
             scheduler_config=NS(max_num_batched_tokens=512, max_num_seqs=8, enable_chunked_prefill=True,
                                 async_scheduling=False),
             cache_config=NS(block_size=16, enable_prefix_caching=True, cache_dtype="auto",
                             gpu_memory_utilization=0.9, num_gpu_blocks=None),
             parallel_config=NS(tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=1))
    labels = adapter.config_labels(cfg)
    assert labels["runtime"] == "vllm"
    assert (labels["model_layers"], labels["model_kv_heads"], labels["model_head_dim"]) == ("2", "2", "32")
    assert (labels["max_num_batched_tokens"], labels["max_num_seqs"], labels["block_size"], labels["tp"]) == (
        "512", "8", "16", "2")
    assert labels["model_dtype"] == "float16" and "num_gpu_blocks" not in labels
