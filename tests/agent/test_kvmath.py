"""Page and prefix arithmetic on hand-made page tables (exact values)."""

import pytest

from phasescope.agent.records import kvmath as k


def test_empty_cache():
    s = k.page_stats(16, 8, {}, {}, free_pages=range(8))
    assert (s.used_pages, s.free_pages, s.live_tokens, s.largest_free_run, s.num_seqs) == (0, 8, 0, 8, 0)
    assert k.block_usage(s.used_pages, s.total_pages) == 0.0
    assert k.internal_fragmentation(s.live_tokens, s.used_pages, 16) == 0.0  # nothing used: no slack
    assert k.external_fragmentation(s.largest_free_run, s.free_pages) == 0.0  # one contiguous run


def test_zero_sized_cache_and_bad_page_size():
    s = k.page_stats(16, 0, {}, {}, free_pages=[])
    assert k.block_usage(s.used_pages, 0) == 0.0 and k.token_usage(0, 0, 16) == 0.0
    with pytest.raises(ValueError):
        k.page_stats(0, 8, {}, {}, free_pages=[])


def test_one_page_per_request():
    tables = {"a": [0], "b": [1], "c": [2]}
    s = k.page_stats(16, 8, tables, {"a": 1, "b": 16, "c": 9}, free_pages=[3, 4, 5, 6, 7])
    assert (s.used_pages, s.live_tokens, s.num_seqs) == (3, 26, 3)
    assert k.internal_fragmentation(s.live_tokens, s.used_pages, 16) == pytest.approx(1 - 26 / 48)
    assert k.token_usage(s.live_tokens, s.total_pages, 16) == pytest.approx(26 / 128)
    assert k.block_usage(3, 8) == 3 / 8


def test_full_cache_has_no_free_pages_and_no_external_fragmentation():
    tables = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}
    s = k.page_stats(4, 8, tables, {"a": 16, "b": 13}, free_pages=[])
    assert (s.used_pages, s.free_pages, s.largest_free_run, s.live_tokens) == (8, 0, 0, 29)
    assert k.block_usage(8, 8) == 1.0
    assert k.external_fragmentation(0, 0) == 0.0
    assert k.internal_fragmentation(29, 8, 4) == pytest.approx(1 - 29 / 32)


def test_scattered_free_pages():
    s = k.page_stats(8, 10, {"a": [1, 4, 7]}, {"a": 20}, free_pages=[0, 2, 3, 5, 6, 8, 9])
    assert s.largest_free_run == 2 and s.free_pages == 7
    assert k.external_fragmentation(s.largest_free_run, s.free_pages) == pytest.approx(1 - 2 / 7)
    assert s.live_tokens == 8 + 8 + 4


def test_shared_prefix_pages_are_counted_once():
    # two requests share pages 0 and 1 (a 2-page prefix), then own one page each
    tables = {"a": [0, 1, 2], "b": [0, 1, 3]}
    s = k.page_stats(16, 6, tables, {"a": 40, "b": 33}, free_pages=[4, 5], cached_pages=[])
    assert (s.used_pages, s.shared_pages, s.shared_refs) == (4, 2, 4)
    assert s.live_tokens == 32 + 8 + 1
    assert k.internal_fragmentation(s.live_tokens, s.used_pages, 16) == pytest.approx(1 - 41 / 64)


def test_cached_pages_and_largest_run_ignores_duplicates():
    s = k.page_stats(16, 6, {}, {}, free_pages=[5, 4, 4, 0], cached_pages=[1, 2])
    assert (s.cached_pages, s.largest_free_run) == (2, 2)
    assert k.largest_run([]) == 0 and k.largest_run([7]) == 1 and k.largest_run([3, 1, 2, 9, 10]) == 3


def test_rates_hit_rate_imbalance_and_what_if():
    assert k.rate(30, 2.0) == 15.0 and k.rate(5, 0) == 0.0
    assert k.hit_rate(64, 256) == 0.25 and k.hit_rate(0, 0) is None
    assert k.kv_imbalance([100, 100, 100, 140]) == pytest.approx(140 / 110 - 1)
    assert k.kv_imbalance([]) == 0.0 and k.kv_imbalance([0, 0]) == 0.0
    # 17, 33 and 1 tokens: 16-token pages hold them in 2+3+1 = 6 pages (96 slots),
    # 8-token pages in 3+5+1 = 9 pages (72 slots)
    assert k.predicted_waste([17, 33, 1], 16) == pytest.approx(1 - 51 / 96)
    assert k.predicted_waste([17, 33, 1], 8) == pytest.approx(1 - 51 / 72)


def test_fast_accounting_equals_the_reference_when_shared_pages_are_full():
    tables = {"a": [0, 1, 2], "b": [0, 1, 3], "c": [0, 1], "d": [7]}
    tokens = {"a": 40, "b": 33, "c": 32, "d": 3}
    free = [4, 5, 8, 9, 10]
    ref = k.page_stats(16, 12, tables, tokens, free_pages=free, cached_pages=[6])
    fast = k.page_stats_fast(16, 12, [(len(t), tokens[r]) for r, t in tables.items()], {0: 3, 1: 3},
                             free_pages=len(free), cached_pages=1, largest_free_run=k.largest_run(free))
    assert fast == ref
    assert (fast.used_pages, fast.live_tokens, fast.shared_pages, fast.shared_refs) == (5, 32 + 8 + 1 + 3, 2, 6)


def test_numpy_and_python_largest_run_agree():
    import random

    rng = random.Random(1)
    for n in (0, 1, 5, 500):
        ids = rng.sample(range(2 * n + 1), n)
        assert k.largest_run(ids) == k._largest_run_py(ids)


def test_rates_just_past_their_guards():
    """The guards are "something happened", not "more than one": windows under a second, one queried
    token, a mean KV under one byte all give real values; a negative window is no window."""
    assert k.rate(5, 0.5) == 10.0 and k.rate(10, -1.0) == 0.0
    assert k.hit_rate(1, 1) == 1.0 and k.hit_rate(0, 1) == 0.0
    assert k.kv_imbalance([0, 1]) == 1.0  # mean 0.5: max / mean - 1


def test_largest_run_without_numpy(monkeypatch):
    """The sidecar does not need numpy: without it the pure-Python run length answers."""
    import sys

    monkeypatch.setitem(sys.modules, "numpy", None)  # `import numpy` raises ImportError
    calls = []
    real = k._largest_run_py
    monkeypatch.setattr(k, "_largest_run_py", lambda ids: calls.append(1) or real(ids))
    assert k.largest_run([3, 1, 2, 9, 10]) == 3 and calls == [1]


def test_page_stats_bounds_and_pages_past_the_tokens():
    for page, total in ((-16, 8), (0, 8), (16, -1)):
        with pytest.raises(ValueError):
            k.page_stats(page, total, {}, {}, free_pages=[])
    one = k.page_stats(1, 4, {"a": [0, 1]}, {"a": 2}, free_pages=[2, 3])  # pages of one token are valid
    assert (one.used_pages, one.live_tokens) == (2, 2)
    # "a" holds 3 pages for 20 tokens (its last page is reserved ahead, empty); "b" has no token count yet
    s = k.page_stats(16, 8, {"a": [0, 1, 2], "b": [3]}, {"a": 20}, free_pages=[4, 5, 6, 7])
    assert (s.used_pages, s.live_tokens, s.num_seqs) == (4, 20, 2)


def test_arithmetic_that_floor_division_or_a_wrong_sign_would_change():
    assert k.rate(5, 2.0) == 2.5 and k.hit_rate(1, -1) is None
    assert k.kv_imbalance([1, 2]) == pytest.approx(2 / 1.5 - 1)  # a mean of 1.5, not 1
    assert k.predicted_waste([16, 32], 16) == 0.0  # exact multiples fill their pages: 1 + 2 pages
    assert k.largest_run({5, 6, 9}) == 2 and k.largest_run(iter([3, 1, 2])) == 3  # any iterable of ids
