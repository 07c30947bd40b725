"""The derived tables' incremental fold (agent/records/derived.py STAGES) on stated events, in seconds.

The recorded-fixture fold tests (test_derived.py) take minutes; these state a small workload with every kind
of request life a runtime reports (reused ids, queued, cached prefixes, engine output stamps, preemption and
re-admission, client cancels, aborts, requests still running, events at one instant) and fold it in the
ways a sidecar meets it: in order, in chunks, out of order, late events for a key already folded, and the
oldest rows deleted by a retention roll. After every step the views must equal the reference views
(tests/reference_sql.py), which derive everything from the raw events at once.
"""

from __future__ import annotations

import random

import duckdb
import pytest

from phasescope.agent.records import derived
from phasescope.agent.records.events import REQUEST_EVENTS, Hello, RequestEvent
from phasescope.agent.sidecar.store import Store
from reference_sql import VIEWS
from test_derived import current, forget, reference

MS = 1_000_000
WALL = 1_764_720_000_000_000_000  # a probe's wall-minus-monotonic offset, ns (wall times of 2025-12)
E = {name: i for i, name in enumerate(REQUEST_EVENTS)}


def workload(seed: int, requests: int = 60, ids: int = 7, t0_ms: int = 0) -> list[RequestEvent]:
    """`requests` request lives over `ids` reused runtime ids (one life of an id ends before, or at the instant,
    its next starts),
    each a seeded mix of the cases above; times in ms from `t0_ms` on a 1 ms grid, so events often share an
    instant."""
    rng = random.Random(seed)
    free_at = [t0_ms] * ids
    out: list[RequestEvent] = []
    for k in range(requests):
        slot = rng.randrange(ids)
        rid = f"r{slot}"
        t = max(free_at[slot], t0_ms + k * 3) + rng.randrange(0, 4)

        def add(kind: str, tokens: int = 0, cached: int = 0) -> None:
            out.append(RequestEvent(t * MS, 0, E[kind], rid, tokens, cached))

        add("arrival", rng.randrange(1, 200))
        if rng.random() < 0.5:
            t += rng.randrange(0, 3)
            add("queued")
        life = rng.random()
        if life < 0.08:  # cancelled or aborted in the queue
            t += rng.randrange(1, 5)
            if rng.random() < 0.5:
                add("cancelled")
            add("aborted")
            free_at[slot] = t
            continue
        t += rng.randrange(0, 6)
        add("scheduled", 0, rng.choice((0, 0, 16, 32, 48)))
        produced = 0
        for g in range(rng.randrange(1, 7)):
            t += rng.randrange(1, 12)  # one token event of a request per receive instant (the reference's key)
            n = rng.choice((1, 1, 1, 2, 3))
            produced += n
            add("token", n, rng.choice((0, 0, 150, 900)))  # the engine's stamp this many us before receipt
            if g in (1, 3) and rng.random() < 0.25:  # preempted, re-admitted (cached part again), decodes on
                t += rng.randrange(0, 3)
                add("preempted")
                if rng.random() < 0.3:  # preempted again before its first step back
                    t += rng.randrange(1, 4)
                    add("scheduled", 0, 0)
                    add("preempted")
                t += rng.randrange(1, 8)
                add("scheduled", 0, rng.choice((0, 16)))
        if rng.random() < 0.1:  # an output with no new token (a runtime's last, empty one): no ITL gap
            t += rng.randrange(0, 2)
            add("token", 0, 0)
        if life < 0.78:
            add("finished", produced)  # at the last token's instant
        elif life < 0.88:
            t += rng.randrange(0, 3)
            add("cancelled")
            add("aborted")
        elif life < 0.94:
            t += 1
            add("aborted")  # the engine or server ended it
        # else: still running at the end of the run
        free_at[slot] = t  # the id's next life may arrive at this very instant
    return out


def gaps_from_the_log(con) -> list[tuple]:
    """Every ITL gap with its preemption flag, in Python from the reference request log (tests/reference_sql.py):
    (run, request, engine ns, previous token's engine ns, tokens, preempted). A gap holds a preemption when a
    `preempted` event lies after the previous token and at or before this one (engine stamps for tokens)."""
    rows = con.execute(f"WITH request_log AS ({VIEWS['request_log']}) SELECT run_id, request_id, ts_ns, event, tokens, "
                       "cached_tokens FROM request_log WHERE event IN ('token', 'preempted')").fetchall()
    per: dict[tuple, list] = {}
    for run, rid, ts, event, tokens, lead in rows:
        if event == "preempted":
            per.setdefault((run, rid), []).append((ts, 0, None))
        elif tokens > 0:
            per.setdefault((run, rid), []).append((ts - 1000 * lead, 1, tokens))
    out = []
    for (run, rid), evs in per.items():
        prev, pre = None, False
        for ts, is_token, tokens in sorted(evs):  # a preemption sorts before a token at its time
            if not is_token:
                pre = True
                continue
            if prev is not None:
                out.append((run, rid, ts, prev, tokens, pre))
            prev, pre = ts, False
    return sorted(out)


def stored_rows_hold_their_events(con) -> None:
    """Each stored request row's bookkeeping (what the next fold and a retention roll read) against its
    definition over the reference request log: events, first and last event, where the next gap starts (the
    last token with tokens, engine time), the last preemption; and every raw event held exactly once."""
    log = con.execute(f"WITH request_log AS ({VIEWS['request_log']}) SELECT run_id, request_id, ts_ns, event, tokens, "
                      "cached_tokens FROM request_log").fetchall()
    want: dict[tuple, list] = {}
    for run, rid, ts, event, tokens, lead in log:
        w = want.setdefault((run, rid), [0, None, None, None, None])
        w[0] += 1
        w[1] = ts if w[1] is None else min(w[1], ts)
        w[2] = ts if w[2] is None else max(w[2], ts)
        if event == "token" and tokens > 0:
            w[3] = ts - 1000 * lead if w[3] is None else max(w[3], ts - 1000 * lead)
        if event == "preempted":
            w[4] = ts if w[4] is None else max(w[4], ts)
    rows = con.execute("SELECT r.run_id, r.request_id, r.events, r.first_wall_ns - s.wall, r.last_ts, r.last_gap_ns, "
                       "r.last_preempted_ns FROM request_rows r JOIN (SELECT run_id, any_value(wall_minus_mono_ns) "
                       "AS wall FROM sources GROUP BY run_id) s USING (run_id)").fetchall()
    got = {(run, rid): list(rest) for run, rid, *rest in rows}
    assert got == {k: w for k, w in want.items() if k in got}
    held, raw = con.execute("SELECT (SELECT sum(events) FROM request_rows), (SELECT count(*) FROM request_events)").fetchone()
    assert held == raw


def _store(tmp_path, name: str = "s.duckdb", run: str = "run") -> tuple[Store, int]:
    store = Store(str(tmp_path / name))
    return store, store.register_source(Hello(1, WALL, 1, 0, 1, run, "m", "synthetic"))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_folded_in_order_in_chunks_equals_the_reference(tmp_path, seed):
    events = workload(seed)
    store, sid = _store(tmp_path)
    con = store.cursor()
    step = len(events) // 5 + 1
    for i in range(0, len(events), step):
        store.append([(sid, events[i:i + step])])
        if i // step % 2:
            derived.refresh(con)
        assert current(con) == reference(con), f"after {i + step} of {len(events)} events"
    derived.refresh(con)
    want = reference(con)
    assert current(con) == want and len(want[0]) == 60
    forget(con)  # nothing folded: the views derive every row at read time
    assert current(con) == want
    store.close()


@pytest.mark.parametrize("seed", [11, 12])
def test_two_runs_on_the_same_ids_folded_after_every_few_events(tmp_path, seed):
    """Two runs whose runtimes reuse the same ids, their events interleaved in chunks of 30 and folded in after
    each: most requests straddle a refresh (their stored row is extended by the next chunk's events)."""
    store, sid = _store(tmp_path)
    other = store.register_source(Hello(1, WALL + 7_000_000, 2, 0, 1, "run-b", "m", "synthetic"))
    a, b = workload(seed), workload(seed + 100)
    con = store.cursor()
    for n, i in enumerate(range(0, max(len(a), len(b)), 30)):
        store.append([(sid, a[i:i + 30]), (other, b[i:i + 30])])
        derived.refresh(con)
        stored_rows_hold_their_events(con)
        if n % 6 == 5:
            assert current(con) == reference(con), f"after {i + 30} events of each run"
    want = reference(con)
    assert current(con) == want and len(want[0]) == 120
    gaps = con.execute("SELECT run_id, request_id, ts_ns, prev_ns, tokens, preempted FROM itl").fetchall()
    assert sorted(gaps) == gaps_from_the_log(con) and any(g[-1] for g in gaps)
    store.close()


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_folded_out_of_order_equals_the_reference(tmp_path, seed):
    """Events arrive shuffled (a late event for a key already folded in recomputes that key)."""
    events = workload(seed)
    shuffled = events[:]
    random.Random(seed).shuffle(shuffled)
    store, sid = _store(tmp_path)
    con = store.cursor()
    step = len(shuffled) // 7 + 1
    for i in range(0, len(shuffled), step):
        store.append([(sid, shuffled[i:i + step])])
        derived.refresh(con)
        assert current(con) == reference(con), f"after {i + step} of {len(shuffled)} events"
    gaps = con.execute("SELECT run_id, request_id, ts_ns, prev_ns, tokens, preempted FROM itl").fetchall()
    assert sorted(gaps) == gaps_from_the_log(con)
    store.close()


def test_a_late_event_of_an_old_request_and_a_retention_roll(tmp_path):
    """Everything folded, then one late token of the first request and the oldest third of the events
    deleted (what a retention roll does): each refresh leaves the views equal to the reference."""
    events = workload(7)
    first = events[0].request_id
    late = next(e for e in events if e.request_id == first and e.event == E["token"])
    events.remove(late)
    store, sid = _store(tmp_path)
    con = store.cursor()
    store.append([(sid, events)])
    derived.refresh(con)
    store.append([(sid, [late])])
    assert current(con) == reference(con)
    derived.refresh(con)
    assert current(con) == reference(con)
    cut = sorted(e.ts_ns for e in events)[len(events) // 3]
    con.execute("DELETE FROM request_events WHERE ts_ns < ?", [cut])
    derived.refresh(con)
    want = reference(con)
    assert current(con) == want and 0 < len(want[0]) < 60
    # a second roll while new lives of the same ids arrive: the keys it recomputes take new events too
    end_ms = max(e.ts_ns for e in events) // MS + 10
    store.append([(sid, workload(8, requests=20, t0_ms=end_ms))])
    con.execute("DELETE FROM request_events WHERE ts_ns < ?", [sorted(e.ts_ns for e in events)[2 * len(events) // 3]])
    with pytest.raises(duckdb.Error, match="deleted from request_events"):  # loud until a refresh folds it in
        current(con)
    derived.refresh(con)
    want = reference(con)
    assert current(con) == want and len(want[0]) > 20
    store.close()


@pytest.mark.parametrize("seed,shuffle", [(21, False), (22, True), (23, True)])
def test_folded_in_slices_equals_the_reference_after_every_slice(tmp_path, seed, shuffle):
    """What the sidecar's live fold does (`refresh(con, max_rows)`): everything appended at once, then folded a
    few rows at a time; in between, the views (stored rows plus the rest as delta) equal the reference, the
    watermark moves by at most the slice, and late keys recomputed in a slice take none of the rows past it
    (or the next slice would count them twice). A retention roll between slices folds its deletion in."""
    events = workload(seed)
    if shuffle:
        random.Random(seed).shuffle(events)
    store, sid = _store(tmp_path)
    con = store.cursor()
    store.append([(sid, events)])
    with pytest.raises(ValueError, match="max_rows"):
        derived.refresh(con, max_rows=0)
    wm, slices = -1, 0
    while True:
        got = derived.refresh(con, max_rows=37)
        new_wm = derived.state(con)[0]
        held = con.execute(f"SELECT count(*) FROM request_events WHERE rowid > {wm} AND rowid <= {new_wm}").fetchone()[0]
        assert 0 <= got <= 37 and held == got and current(con) == reference(con), f"slice {slices}"
        wm, slices = new_wm, slices + 1
        if slices == 4:  # a retention roll: the oldest quarter of the events by time
            con.execute("DELETE FROM request_events WHERE ts_ns < ?", [sorted(e.ts_ns for e in events)[len(events) // 4]])
            derived.refresh(con, max_rows=37)
            wm = derived.state(con)[0]
            assert current(con) == reference(con)
        if not got and slices > 4:
            break
    assert slices >= len(events) * 3 // 4 // 37
    stored_rows_hold_their_events(con)
    assert current(con) == reference(con)
    store.close()


class _LateCount:
    """A connection that counts the late keys each fold finds (temp table `late`, made by STAGES)."""

    def __init__(self, con) -> None:
        self.con, self.late = con, []

    def execute(self, sql, *a):
        out = self.con.execute(sql, *a)
        if sql.startswith("CREATE OR REPLACE TEMP TABLE late AS"):
            self.late.append(self.con.execute("SELECT count(*) FROM temp.late").fetchone()[0])
        return out

    def __getattr__(self, name):
        return getattr(self.con, name)


@pytest.mark.parametrize("end", ["finished", "aborted", "cancelled"])
def test_an_end_at_the_last_tokens_instant_in_the_next_slice_continues_in_order(tmp_path, end):
    """A runtime stamps a request's end with its last token's time; a slice boundary between the two must not
    make the key late (a late key is refolded from all its raw rows: O(history) per slice, issue 54), and the
    views still equal the reference. A new event other than an end at that instant, or an end at the instant the
    stored request arrived, is still late."""
    store, sid = _store(tmp_path)
    con = _LateCount(store.cursor())
    head = [RequestEvent(0, 0, E["arrival"], "a", 10, 0), RequestEvent(1 * MS, 0, E["scheduled"], "a", 0, 0),
            RequestEvent(5 * MS, 0, E["token"], "a", 1, 0), RequestEvent(9 * MS, 0, E["token"], "a", 1, 0)]
    store.append([(sid, head)])
    derived.refresh(con)
    store.append([(sid, [RequestEvent(9 * MS, 0, E[end], "a", 2, 0)])])
    derived.refresh(con)
    assert con.late[-1] == 0 and current(con) == reference(con)
    # a token at that instant is not an end: late (a token sorts with the stored one; refolded, still exact)
    store.append([(sid, [RequestEvent(12 * MS, 0, E["token"], "a", 1, 0)])])
    derived.refresh(con)
    store.append([(sid, [RequestEvent(12 * MS, 0, E["preempted"], "a", 0, 0)])])
    derived.refresh(con)
    assert con.late[-1] == 1 and current(con) == reference(con)
    # a reused id arriving at an instant, then an end at that instant: the end belongs to the life before (an
    # arrival sorts after an end of its time), so it is late
    store.append([(sid, [RequestEvent(20 * MS, 0, E["arrival"], "a", 5, 0)])])
    derived.refresh(con)
    store.append([(sid, [RequestEvent(20 * MS, 0, E[end], "a", 0, 0)])])
    derived.refresh(con)
    assert con.late[-1] == 1 and current(con) == reference(con)
    store.close()
