"""`same`: two nested results (dicts, lists, tuples, scalars) equal, floats to a relative tolerance.

What the read-equality tests (tests/analyzers/test_read_equality.py, test_diag_reads.py) compare a rewritten
read's result with the previous SQL's by. Integers and strings are equal; floats are equal to `rel` relative
(sums added in another order); NaN equals NaN; None equals only None.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

REL = 1e-12


def same(got: Any, want: Any, path: str = "", *, key_order: bool = True, rel: float = REL) -> None:
    """Assert `got` equals `want`; `path` names the place in the message. `key_order`: a dict's keys also in the
    same order (else the same set of keys)."""
    if isinstance(want, float) or isinstance(got, float):
        if want is None or got is None or (isinstance(want, float) and math.isnan(want)):
            assert got == want or (got != got and want != want), path
        else:
            assert got == pytest.approx(want, rel=rel, abs=1e-300), path
    elif isinstance(want, dict):
        if key_order:
            assert list(got) == list(want), path
        else:
            assert set(got) == set(want), path
        for k in want:
            same(got[k], want[k], f"{path}/{k}", key_order=key_order, rel=rel)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{path}[{i}]", key_order=key_order, rel=rel)
    else:
        assert got == want, path
