"""The adapters' one base (adapters/base.py): guard, observe, around, kv_record, and the free-run scan the
vLLM snapshot shares with kvmath; all three adapters stand on it."""

from __future__ import annotations

import random

import pytest

from phasescope.agent.probe.adapters import base, hf_cb, hf_generate, vllm
from phasescope.agent.records.events import KVSnapshot
from phasescope.agent.records.kvmath import PageStats, largest_gap, largest_run


def test_guard_hands_errors_over_and_never_raises():
    seen = []
    run = base.guard(lambda x: 1 / x, seen.append)
    assert run(2) is None and seen == []
    run(0)
    assert len(seen) == 1 and isinstance(seen[0], ZeroDivisionError)


def test_observe_replaces_args_observes_results_and_swallows_hook_errors():
    calls, errors = [], []

    def original(a, b=0):
        """doc"""
        calls.append((a, b))
        return a + b

    wrapped = base.observe(original, lambda r, *a, **k: calls.append(("after", r, a, k)), errors.append,
                           before=lambda a, **k: (a * 10,))
    assert wrapped(1, b=2) == 12 and calls == [(10, 2), ("after", 12, (10,), {"b": 2})]
    assert wrapped.__doc__ == "doc" and wrapped.__wrapped__ is original
    bad = base.observe(original, lambda *a, **k: 1 / 0, errors.append, before=lambda *a, **k: [][1])
    assert bad(3) == 3 and [type(e) for e in errors] == [IndexError, ZeroDivisionError]


def test_kv_record_is_the_snapshot_of_the_stats():
    stats = PageStats(32, 100, 40, 60, 5, 3, 7, 4, 1000, 17)
    rec = base.kv_record(5, 2, stats, 11, 9, 4096, "bfloat16-long-name")
    assert rec == KVSnapshot(5, 2, 32, 100, 40, 60, 5, 3, 7, 4, 1000, 17, 11, 9, 40 * 4096, "bfloat16-lon")


@pytest.mark.parametrize("seed", range(20))
def test_largest_gap_is_the_largest_free_run(seed):
    """vLLM's scan over used ids (block 0 null) equals kvmath.largest_run over the free ids."""
    rng = random.Random(seed)
    end = rng.randint(2, 300)
    used = {i for i in range(1, end) if rng.random() < rng.random()}
    free = [i for i in range(1, end) if i not in used]
    assert largest_gap(used, 0, end) == largest_run(free)


def test_every_adapter_stands_on_the_base():
    assert issubclass(hf_cb.HFContinuousBatching, base.RuntimeAdapter)
    assert issubclass(hf_generate.GenerateRequests, base.RuntimeAdapter)
    # the vLLM hooks keep their own self-timed wrapper (adapters/vllm/common.wrap: the budget meters it) and build
    # their snapshots from kept counts, into the same record
    from phasescope.agent.probe.adapters.vllm import kvaccount

    assert kvaccount.KVSnapshot is base.KVSnapshot
    with pytest.raises(TypeError, match="Probe returned by attach"):
        hf_generate.GenerateRequests(object(), ["r"], [1])  # type: ignore[arg-type]


def test_around_patches_the_instance_and_detach_restores_it():
    from phasescope.agent.probe.probe import Probe

    class Model:
        def register_forward_pre_hook(self, *a, **k):
            return self

        register_forward_hook = register_forward_pre_hook

        def remove(self):
            pass

        def parameters(self):
            return iter(())

    probe = Probe(Model(), connect=False, cuda_timing=False)
    try:
        class Thing:
            def f(self, x):
                return x + 1

        thing, other = Thing(), Thing()
        adapter = base.RuntimeAdapter(probe)
        adapter.around(thing, "f", lambda orig, x: orig(x) * 2)
        assert (thing.f(1), other.f(1)) == (4, 2)
        adapter.detach()
        assert thing.f(1) == 2 and "f" not in vars(thing)
    finally:
        probe.close()
