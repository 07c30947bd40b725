"""The sidecar's live fold of the derived tables (agent/sidecar/folding.py, issue 54).

A real `phasescope agent` process fed faster than one slice folds: it folds during the run, slice after slice,
its RSS stays within its memory settings over its base, and the fold at close leaves nothing behind. A fold that
fails is a stored health record that diagnose names, and its recovery another.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import psutil
import pytest

from phasescope.agent.records import events as ev
from phasescope.agent.records.address import parse_address
from phasescope.agent.probe.sender import Sender
from phasescope.agent.sidecar import Sidecar

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_rate import api_url, health, produce  # noqa: E402  (the benchmark's replay of the vLLM adapter's records)


@pytest.mark.timeout(300)
def test_an_agent_fed_faster_than_a_slice_folds_during_the_run_within_its_memory(short_tmp):
    db, sock = os.path.join(short_tmp, "s.duckdb"), f"unix:{short_tmp}/a.sock"
    slice_rows, read_mib, budget_mib = 2000, 64, 8
    agent = subprocess.Popen([sys.executable, "-m", "phasescope.cli", "agent", "--db", db, "--listen", sock, "--api",
                              "127.0.0.1:0", "--no-metrics", "--no-retention", "--fold-interval-s", "0.3",
                              "--fold-slice-rows", str(slice_rows), "--read-memory-mib", str(read_mib),
                              "--memory-budget-mib", str(budget_mib)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = agent.stdout.readline()
        assert "listening" in line
        url = api_url(line)
        proc = psutil.Process(agent.pid)
        base = proc.memory_info().rss
        out: mp.Queue = mp.Queue()
        # one vLLM server at batch 64, 8k tokens/s for 8 s: ~1.2k request events in every 0.3 s round's wait
        p = mp.Process(target=produce, args=(sock, "live-fold", 64, 8000.0, 8.0, 48, 4, 1, out))
        p.start()
        peak, during = base, []
        while p.is_alive():
            time.sleep(0.25)
            peak = max(peak, proc.memory_info().rss)
            during.append(health(url))
        sent = out.get(timeout=30)
        p.join(30)
        # folded while records still arrived, in more slices than rounds could explain with one slice each
        mid = during[len(during) // 2]
        assert mid["fold_events_total"] > 0 and mid["rows_written_total"] < during[-1]["rows_written_total"]
        last = during[-1]
        assert last["fold_slices_total"] >= 10 and last["fold_events_total"] >= 10 * slice_rows // 2, last
        assert last["fold_failures_total"] == 0, last["fold_last_error"]
        assert sent["dropped"] == 0 and sent["delivered"] == sent["sent"]
        # within its settings over its base: DuckDB's read memory (the fold's) and the ingest budget, with 48 MiB
        # for the rest (the writer's own 48 MB pool, a transaction's columns)
        assert peak - base <= (read_mib + budget_mib + 48) * 2**20, (peak - base) / 2**20
    finally:
        agent.terminate()
        agent.wait(120)
    con = duckdb.connect(db, read_only=True)
    try:  # the fold at close finished: nothing left past the watermark; every token is in its request row
        top = con.execute("SELECT max(rowid) FROM request_events").fetchone()[0]
        assert con.execute("SELECT wm FROM derived_state WHERE name = 'request_events'").fetchone()[0] == top
        made = con.execute("SELECT sum(tokens) FROM request_events WHERE event = 'token'").fetchone()[0]
        assert con.execute("SELECT sum(output_tokens) FROM request_rows").fetchone()[0] == made == sent["tokens"]
        assert con.execute("SELECT count(*) FROM sidecar_health").fetchone()[0] == 0
    finally:
        con.close()


def test_a_failed_fold_is_a_health_record_diagnose_names_and_so_is_its_recovery(short_tmp, monkeypatch):
    from phasescope.agent.sidecar import folding
    from phasescope.analyzers.telemetry import telemetry_degraded

    real = folding.derived.refresh
    failing = {"on": True}

    def refresh(con, max_rows=None):
        if failing["on"]:
            raise duckdb.OutOfMemoryException("Out of Memory Error: could not allocate (injected)")
        return real(con, max_rows)

    monkeypatch.setattr(folding.derived, "refresh", refresh)
    sc = Sidecar(os.path.join(short_tmp, "s.duckdb"), listen=[f"unix:{short_tmp}/a.sock"], batch_interval_s=0.05,
                 fold_interval_s=0.05).start()
    try:
        hello = ev.Hello(time.monotonic_ns(), time.time_ns() - time.monotonic_ns(), os.getpid(), 0, 1, "run-f", "m", "vllm")
        sender = Sender(parse_address(str(sc.bound[0])), lambda: ev.encode_frame([hello]))
        t = time.monotonic_ns()
        assert sender.send(ev.encode_frame([ev.RequestEvent(t, 0, ev.REQ_ARRIVAL, "a", 8, 0),
                                            ev.RequestEvent(t + 1000, 0, ev.REQ_TOKEN, "a", 1, 0),
                                            ev.Step(t, 0, 0, 1, 1, 0, 1, 8, 0.5, float("nan"))]))
        sender.close()

        def health_rows():
            with sc.store.reading() as con:
                return con.execute("SELECT ok, detail FROM sidecar_health ORDER BY ts_ns").fetchall()

        assert sc.wait_rows(lambda: len(health_rows()) >= 1, 30)
        ok, detail = health_rows()[0]
        assert not ok and "OutOfMemoryException" in detail and "injected" in detail
        assert sc.stats.fold_failures_total >= 1 and "injected" in sc.stats.fold_last_error
        # more failing rounds (waited for, not slept: a loaded host may run few in a fixed time): one record a
        # minute at most, not one per round
        assert sc.wait_rows(lambda: sc.stats.fold_failures_total > 2, 30)
        assert len(health_rows()) == 1 and sc.stats.fold_failures_total > 1
        with sc.store.reading() as con:
            [f] = [f for f in telemetry_degraded(con, "run-f") if f.id == "telemetry-store-fold-failed"]
            assert f.severity == "warning" and f.evidence["failures"] == 1 and "injected" in f.evidence["last_detail"]
        failing["on"] = False
        assert sc.wait_rows(lambda: len(health_rows()) == 2, 30)
        assert health_rows()[1] == (True, "caught up")
        with sc.store.reading() as con:
            [f] = [f for f in telemetry_degraded(con, "run-f") if f.id == "telemetry-store-fold-failed"]
            assert f.severity == "info" and f.evidence["ok_at_end"]
            # every figure stayed exact meanwhile, and is now folded
            assert con.execute("SELECT output_tokens FROM requests WHERE run_id = 'run-f'").fetchall() == [(1,)]
    finally:
        sc.stop()


def test_a_slice_past_the_read_time_limit_halves_the_next_and_a_completed_round_doubles_it_back(monkeypatch):
    """A loaded host: a slice that outlasts the store's read time limit is interrupted (duckdb.InterruptException).
    The fold says so (not a bare failure), folds half as much per slice next round, down to MIN_SLICE_ROWS, and
    grows back after rounds that complete; an interrupt while the sidecar closes is no failure at all."""
    import contextlib
    import threading

    from phasescope.agent.sidecar import folding
    from phasescope.agent.sidecar.stats import SidecarStats

    asked: list[int] = []
    interrupt = {"on": True}

    def refresh(con, max_rows=None):
        asked.append(max_rows)
        if interrupt["on"]:
            if interrupt["on"] == "closing":
                fold._stop.set()  # the sidecar's close: stop, then interrupt the reads in flight
            raise duckdb.InterruptException("INTERRUPT Error: Interrupted!")
        return 0

    class Store:
        con = duckdb.connect()
        con.execute("CREATE TABLE request_events (x INT); CREATE TABLE sidecar_health (ts BIGINT, c VARCHAR, "
                    "ok BOOLEAN, detail VARCHAR, behind BIGINT, lag DOUBLE)")

        @contextlib.contextmanager
        def reading(self):
            yield self.con

        def cursor(self):
            return self.con.cursor()

    monkeypatch.setattr(folding.derived, "refresh", refresh)
    monkeypatch.setattr(folding.derived, "state", lambda con: None)
    stats = SidecarStats()
    fold = folding.LiveFold(Store(), stats, threading.Lock(), interval_s=5, slice_rows=8000, budget_s=3)
    for _ in range(4):
        fold.round()
    assert asked == [8000, 4000, 2000, 1000] and fold.cur_slice == folding.MIN_SLICE_ROWS == 1000
    assert stats.fold_failures_total == 4
    (detail,) = Store.con.execute("SELECT detail FROM sidecar_health").fetchone()
    assert "read time limit" in detail and "slices now 4000" in detail
    interrupt["on"] = False
    fold.round()
    fold.round()
    assert asked[-2:] == [1000, 2000] and fold.cur_slice == 4000
    interrupt["on"] = "closing"  # the sidecar closing interrupts its reads: not counted, the slice kept
    fold.round()
    assert stats.fold_failures_total == 4 and fold.cur_slice == 4000
