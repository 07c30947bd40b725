"""shadow.py: instance attributes read, set and removed without materializing the instance's __dict__."""

from __future__ import annotations

import gc
import sys

import pytest

from phasescope.agent.probe.adapters.base import RuntimeAdapter
from phasescope.agent.probe.shadow import MISSING, own, restore


class Pool:
    def __init__(self) -> None:
        self.free = 3
        self.name = "pool"

    def take(self) -> int:
        return self.free


def materialized(obj: object) -> bool:
    return any(type(r) is dict for r in gc.get_referents(obj))


needs_inline_values = pytest.mark.skipif(sys.version_info[:2] not in ((3, 11), (3, 12)),
                                         reason="inline instance values as in CPython 3.11/3.12")


def test_own_tells_a_shadowing_instance_attribute_from_the_classs_method():
    p = Pool()
    assert own(p, "take") is MISSING and own(p, "absent") is MISSING
    wrapper = lambda: 7  # noqa: E731
    p.take = wrapper
    assert own(p, "take") is wrapper and p.take() == 7
    restore(p, "take", MISSING)
    assert own(p, "take") is MISSING and p.take() == 3
    p.take = p.take  # a bound method of the class's own function: the same calls as the class's
    assert own(p, "take") is MISSING
    p.take = wrapper
    restore(p, "take", p.take)  # a prior instance attribute goes back as it was
    assert p.take is wrapper
    assert own(p, "free") == 3  # a data attribute is the instance's own


@needs_inline_values
def test_none_of_it_materializes_the_instance_dict():
    p = Pool()
    assert not materialized(p)
    prior = own(p, "take")
    p.take = lambda: 1
    own(p, "take")
    restore(p, "take", prior)
    assert not materialized(p)
    p.__dict__  # the control: the detector sees a materialized dict
    assert materialized(p)


@needs_inline_values
def test_an_adapters_patch_and_detach_keep_the_host_object_on_the_fast_path():
    import torch

    from phasescope.agent.probe.probe import Probe

    probe = Probe(torch.nn.Linear(1, 1), connect=False, cuda_timing=False)
    try:
        adapter = RuntimeAdapter(probe)
        p = Pool()
        adapter.around(p, "take", lambda original, *a: original(*a) + 1)
        assert p.take() == 4 and not materialized(p)
        adapter.detach()
        assert p.take() == 3 and own(p, "take") is MISSING and not materialized(p)
    finally:
        probe.close()
