"""Named queries (agent/read/queries.py) return the exact figures users read, from stated records.

Each store here is written from records whose values are chosen so that a wrong formula gives a
different number (e.g. a hit rate of hit / (queried + hit) instead of hit / queried).
"""

from __future__ import annotations

import os
from fractions import Fraction

import duckdb
import pytest

from phasescope.agent.records import events as ev
from phasescope.agent.read.queries import prefix_summary
from builders.scenarios import DATA_DIR, load
from phasescope.agent.sidecar.store import Store

T0 = 1_000_000_000


def _prefix_store(path: str) -> None:
    """Run "r1": two ranks with monotonic counters from 0; run "r2": one rank that must not leak into r1."""
    store = Store(path)
    try:
        def src(run: str, rank: int) -> int:
            return store.register_source(ev.Hello(T0, 0, 100 + rank, rank, 2, run, "m", "module"))

        a, b, other = src("r1", 0), src("r1", 1), src("r2", 0)
        store.append([
            # (queried, hit, recomputed, evicted) totals; the last row of each source is its run total
            (a, [ev.PrefixCounters(T0 + i, 0, q, h, r, e) for i, (q, h, r, e) in
                 enumerate([(0, 0, 0, 0), (100, 20, 0, 1), (400, 100, 7, 3)])]),
            (b, [ev.PrefixCounters(T0 + i, 1, q, h, r, e) for i, (q, h, r, e) in
                 enumerate([(50, 10, 0, 0), (200, 150, 5, 2)])]),
            (other, [ev.PrefixCounters(T0, 0, 1000, 1000, 0, 0)]),
            (a, [ev.RequestEvent(T0, 0, ev.REQ_PREEMPTED, "x", 0, 0), ev.RequestEvent(T0 + 1, 0, ev.REQ_PREEMPTED, "y", 0, 0)]),
            (other, [ev.RequestEvent(T0, 0, ev.REQ_PREEMPTED, "z", 0, 0)]),
        ])
    finally:
        store.close()


def test_prefix_summary_hit_rate_is_hit_over_queried_per_run(tmp_path):
    path = str(tmp_path / "p.duckdb")
    _prefix_store(path)
    con = duckdb.connect(path, read_only=True)
    try:
        s = prefix_summary(con, "r1")
        # hit rate = Δhit / Δqueried summed over the run's sources: (100 + 150) / (400 + 200) = 5/12
        assert s["hit_rate"] == pytest.approx(250 / 600, rel=1e-15)
        assert Fraction(s["hit_tokens"], s["queried_tokens"]) == Fraction(5, 12)
        assert s == {"queried_tokens": 600, "hit_tokens": 250, "hit_rate": s["hit_rate"], "recomputed_tokens": 12,
                     "evicted_blocks": 5, "preemptions": 2}
        # the other run: every queried token hit, exactly 1.0 (hit / (queried + hit) would say 0.5)
        assert prefix_summary(con, "r2")["hit_rate"] == 1.0
        # the whole file: (250 + 1000) / (600 + 1000)
        everything = prefix_summary(con)
        assert everything["hit_rate"] == pytest.approx(1250 / 1600, rel=1e-15)
        assert everything["preemptions"] == 3
        assert prefix_summary(con, "no-such-run") == {"queried_tokens": None, "hit_tokens": None, "hit_rate": None,
                                                      "recomputed_tokens": None, "evicted_blocks": None,
                                                      "preemptions": 0}
    finally:
        con.close()


def test_prefix_summary_hit_rate_with_nothing_queried_is_none(tmp_path):
    path = str(tmp_path / "z.duckdb")
    store = Store(path)
    try:
        sid = store.register_source(ev.Hello(T0, 0, 1, 0, 1, "z", "m", "module"))
        store.append([(sid, [ev.PrefixCounters(T0, 0, 0, 0, 0, 0)])])
    finally:
        store.close()
    con = duckdb.connect(path, read_only=True)
    try:
        s = prefix_summary(con, "z")
        assert (s["queried_tokens"], s["hit_tokens"], s["hit_rate"]) == (0, 0, None)
    finally:
        con.close()


@pytest.mark.parametrize("name", ["prefix-miss-vllm", "healthy", "reused-ids", "kv-pressure"])
def test_prefix_summary_on_fixtures_matches_the_raw_counters(name, tmp_path):
    """On recorded runs: the last counter row of each source, summed, recomputed in Python from the raw rows."""
    path = str(tmp_path / "f.duckdb")
    run_id = load(os.path.join(DATA_DIR, name), path)
    con = duckdb.connect(path, read_only=True)
    try:
        rows = con.execute("""SELECT source_id, p.ts_ns, queried_tokens_total, hit_tokens_total
                              FROM prefix_counters p JOIN sources USING (source_id) WHERE run_id = ?
                              ORDER BY source_id, p.ts_ns""", [run_id]).fetchall()
        last: dict[int, tuple[int, int]] = {}
        for sid, _, q, h in rows:
            last[sid] = (q, h)  # monotonic: the latest row is the total
        queried = sum(q for q, _ in last.values())
        hit = sum(h for _, h in last.values())
        s = prefix_summary(con, run_id)
        assert (s["queried_tokens"], s["hit_tokens"]) == (queried, hit)
        assert queried > 0 and 0 < hit < queried  # the fixture tells hit / queried from hit / (queried + hit)
        assert s["hit_rate"] == pytest.approx(hit / queried, rel=1e-15)
    finally:
        con.close()
