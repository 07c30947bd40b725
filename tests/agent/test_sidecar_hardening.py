"""The sidecar as an attacker and a busy server see it: acknowledged delivery through SIGKILLs, poison
isolation, bounded memory under half-sent frames and slow senders, private socket folder and DB file,
the read API's Host check and parameter validation, the TCP token."""

from __future__ import annotations

import collections
import json
import math
import os
import re
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from phasescope.agent.records import events as ev
from phasescope.agent.records.address import check_private_folder, make_private_folder, parse_address
from phasescope.agent.probe.sender import Sender, connect
from phasescope.agent.sidecar import Sidecar
from phasescope.agent.sidecar.connio import LOOKAHEAD_BYTES
from phasescope.agent.sidecar.limits import SidecarLimits
from phasescope.agent.sidecar.store import Store
from hang import HANG_S, HTTP_S

NAN = float("nan")


def _hello_frame(run="good"):
    return lambda: ev.encode_frame([ev.Hello(time.monotonic_ns(), 0, os.getpid(), 0, 1, run, "m", "module"),
                                    ev.RunLabel(1, "k", "v")])


def _steps(start, n, **over):
    base = dict(phase=ev.PHASE_DECODE, host_ms=0.5, gpu_ms=NAN, step_id=None)
    base.update(over)
    return [ev.Step(start + i, base["step_id"] if base["step_id"] is not None else start + i, 0, base["phase"], 1, 0,
                    1, start + i, base["host_ms"], base["gpu_ms"]) for i in range(n)]


class Streamer:
    """A probe stand-in: streams Step frames through the real Sender; what the window refuses is dropped
    (counted), as the probe's ring does."""

    def __init__(self, addr, frame_records=500, pause_s=0.002, run="good", wait=False, **kw):
        """`wait`: a frame the sender cannot take now is offered again (as a probe whose ring is big enough
        does), so the step ids sent are contiguous; else it is dropped and counted in `not_sent`."""
        self.sender = Sender(parse_address(addr), _hello_frame(run), backoff_max_s=0.2, **kw)
        self.frame_records, self.pause_s, self.wait = frame_records, pause_s, wait
        self.not_sent = 0
        self.next_id = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            frame = ev.encode_frame(_steps(self.next_id, self.frame_records))
            while not self.sender.send(frame):
                if not self.wait:
                    self.not_sent += self.frame_records
                    break
                if self._stop.wait(0.01):
                    return
            self.next_id += self.frame_records
            time.sleep(self.pause_s)

    def stop(self):
        self._stop.set()
        self._thread.join(10)
        self.sender.close()
        return self.sender


def _start_agent(db, sock, *extra):
    proc = subprocess.Popen(
        [sys.executable, "-m", "phasescope.cli", "agent", "--db", db, "--listen", f"unix:{sock}",
         "--checkpoint-s", "0.5", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    line = proc.stdout.readline()
    assert "listening" in line, line
    return proc, line


def _count_steps(db):
    con = Store.open_readonly(db)
    try:
        return con.execute("SELECT count(*) FROM steps").fetchone()[0]
    finally:
        con.close()


@pytest.mark.slow
def test_twenty_sigkills_while_two_probes_stream_nothing_lost_nothing_twice(short_tmp):
    """At-least-once delivery, exactly-once storage: frames in flight at each kill are sent again after
    the reconnect, and the store keeps each once (step ids contiguous, no duplicate, 0 lost)."""
    db, sock = os.path.join(short_tmp, "k.duckdb"), os.path.join(short_tmp, "agent.sock")
    agent, _ = _start_agent(db, sock, "--no-metrics", "--no-api")
    streams = [Streamer(f"unix:{sock}", run=f"p{i}", wait=True).start() for i in range(2)]
    resent_at_kill = []
    try:
        for _ in range(20):
            deadline = time.monotonic() + HANG_S
            start = [s.sender.delivered for s in streams]
            while any(s.sender.delivered < d + 1000 for s, d in zip(streams, start)) \
                    and time.monotonic() < deadline:
                time.sleep(0.02)  # some of it committed and acknowledged by this agent
            time.sleep(0.05)
            resent_at_kill.append(sum(s.sender.in_flight for s in streams))
            agent.send_signal(signal.SIGKILL)
            agent.wait(10)
            agent, _ = _start_agent(db, sock, "--no-metrics", "--no-api")
        deadline = time.monotonic() + HANG_S
        while any(s.sender.connects < 21 for s in streams) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        senders = [s.stop() for s in streams]
        agent.send_signal(signal.SIGTERM)
        agent.wait(HANG_S)
    con = Store.open_readonly(db)
    try:
        per_run = {r: (n, lo, hi, d) for r, n, lo, hi, d in con.execute(
            "SELECT run_id, count(*), min(step_id), max(step_id), count(DISTINCT step_id) "
            "FROM steps JOIN sources USING (source_id) GROUP BY run_id").fetchall()}
    finally:
        con.close()
    for i, (s, sender) in enumerate(zip(streams, senders)):
        print(f"p{i}: sent={sender.sent} delivered={sender.delivered} resent={sender.resent} lost={sender.lost} "
              f"stored={per_run.get(f'p{i}')}")
        assert sender.connects >= 21
        assert (sender.lost, sender.in_flight, sender.rejected) == (0, 0, 0)
        assert sender.sent == sender.delivered == s.next_id
        # every step id sent, each once: contiguous, no gap, no duplicate
        assert per_run[f"p{i}"] == (s.next_id, 0, s.next_id - 1, s.next_id)
    print(f"records in flight at the kills: {resent_at_kill}")
    assert sum(s.resent for s in senders) > 0  # kills did interrupt frames in flight: they were sent again


def test_acks_count_delivered_and_close_waits_for_them(sidecar):
    sender = Sender(parse_address(str(sidecar.bound[0])), _hello_frame())
    for k in range(20):
        assert sender.send(ev.encode_frame(_steps(k * 100, 100)))
    sender.close()
    assert (sender.sent, sender.delivered, sender.lost, sender.in_flight) == (2000, 2000, 0, 0)
    assert sidecar.wait_rows(lambda: sidecar.stats.rows_written_total >= 2000)


def test_poison_records_are_rejected_by_reason_and_the_rest_of_the_frame_kept(sidecar):
    good = _steps(0, 10)
    bad = [
        *_steps(100, 3, phase=9),  # bad_enum
        *_steps(200, 2, step_id=2**64 - 1),  # out_of_range (BIGINT)
        *_steps(300, 2, host_ms=math.inf),  # not_finite
        *_steps(400, 1, host_ms=NAN),  # not_finite: host time is always measured
        *_steps(500, 4, host_ms=-1.0),  # negative
        ev.Step(-5, 1, 0, 1, 1, 0, 1, 0, 0.5, NAN),  # out_of_range: negative timestamp
    ]
    ok_req = ev.RequestEvent(1, 0, ev.REQ_ARRIVAL, "req-1", 5, 0)
    payload, n = ev.encode_records(good + bad + [ok_req])
    # a request id that is not UTF-8, written byte by byte into the frame
    rec = bytearray(ev.encode_records([ev.RequestEvent(2, 0, ev.REQ_ARRIVAL, "x" * 32, 5, 0)])[0])
    rec[1 + 8 + 2 + 1: 1 + 8 + 2 + 1 + 2] = b"\xff\xfe"
    frame = ev.HEADER.pack(ev.MAGIC, 1, 0, n + 1, len(payload) + len(rec)) + payload + bytes(rec)
    sender = Sender(parse_address(str(sidecar.bound[0])), _hello_frame())
    assert sender.send(frame)
    sender.close()
    assert (sender.delivered, sender.rejected, sender.lost) == (11, 14, 0)
    assert sidecar.stats.records_rejected_total == {"bad_enum": 3, "out_of_range": 3, "not_finite": 3,
                                                    "negative": 4, "bad_utf8": 1}
    sidecar.stop()
    con = Store.open_readonly(sidecar.db_path)
    assert con.execute("SELECT count(*), min(step_id), max(step_id) FROM steps").fetchone() == (10, 0, 9)
    assert con.execute("SELECT request_id FROM request_events").fetchall() == [("req-1",)]
    con.close()


def test_a_batch_that_fails_in_the_store_is_retried_in_halves(sidecar, monkeypatch):
    import duckdb
    import numpy as np

    from phasescope.agent.sidecar import store as store_mod

    real = store_mod._insert

    def insert(con, table, cols, select):  # the store refuses any insert holding step 777 (a value it cannot take)
        if table == "steps" and (np.asarray(cols["step_id"]) == 777).any():
            raise duckdb.ConversionException("Conversion Error: step 777")
        real(con, table, cols, select)

    monkeypatch.setattr(store_mod, "_insert", insert)
    frame = ev.encode_frame(_steps(0, 1000))
    sender = Sender(parse_address(str(sidecar.bound[0])), _hello_frame())
    assert sender.send(frame)
    sender.close()
    assert (sender.delivered, sender.rejected, sender.lost) == (999, 1, 0)
    assert sidecar.stats.records_rejected_total == {"write_error": 1}
    assert sidecar.stats.write_retries_total == 1
    sidecar.stop()
    con = Store.open_readonly(sidecar.db_path)
    assert con.execute("SELECT count(*), count(*) FILTER (WHERE step_id = 777) FROM steps").fetchone() == (999, 0)
    con.close()


def _rss(proc):
    return psutil.Process(proc.pid).memory_info().rss


def _get(url, host=None, timeout=HTTP_S):
    req = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.slow
def test_flood_of_malformed_frames_and_poison_while_a_good_probe_streams(short_tmp):
    db, sock = os.path.join(short_tmp, "p.duckdb"), os.path.join(short_tmp, "agent.sock")
    agent, line = _start_agent(db, sock, "--metrics-addr", "127.0.0.1:0", "--api", "127.0.0.1:0")
    metrics_url = re.search(r"metrics on (\S+/metrics)", line).group(1)
    api_url = re.search(r"read API on (http://\S+?)(;|$)", line.strip()).group(1)
    good = Streamer(f"unix:{sock}", frame_records=200, pause_s=0.005).start()
    statuses, bad_frames, poison = [], 0, 0
    rss0 = _rss(agent)
    peak = rss0

    def scrape():
        while not stop.is_set():
            statuses.append(_get(metrics_url)[0])
            time.sleep(0.1)

    stop = threading.Event()
    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    try:
        hello = ev.encode_frame([ev.Hello(1, 0, 1, 0, 1, "evil", "evil", "module")])
        for k in range(2000):  # malformed frames: each closes its connection
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock)
            garbage = [os.urandom(64), hello + b"PS\x01\x00" + os.urandom(40),
                       hello + ev.HEADER.pack(ev.MAGIC, 1, 0, 1, 10) + b"\xc8" * 10][k % 3]
            try:
                s.sendall(garbage)
                s.shutdown(socket.SHUT_WR)
                s.recv(1)
            except OSError:
                pass
            s.close()
            bad_frames += 1
            if k % 200 == 0:
                peak = max(peak, _rss(agent))
        poisoners = [Sender(parse_address(f"unix:{sock}"), _hello_frame("evil")) for _ in range(4)]
        for k in range(100):  # poison records mixed with fine ones, over several connections
            recs = (_steps(0, 20, phase=7) + _steps(0, 20, host_ms=-3.0) + _steps(0, 20, step_id=2**63)
                    + _steps(0, 20, host_ms=math.inf) + _steps(0, 20)
                    + [ev.KVSnapshot(1, 0, 0, 10, 20, 0, 0, 0, 0, 1, 50, 0, 0, 0, 10, "bf16")])  # page 0
            for p in poisoners:
                while not p.ready():
                    time.sleep(0.01)
                p.send(ev.encode_frame(recs))
                poison += 80
            if k % 10 == 0:
                peak = max(peak, _rss(agent))
        for p in poisoners:
            p.close()
        time.sleep(0.5)
    finally:
        stop.set()
        scraper.join(10)
        sender = good.stop()
        status, body = _get(api_url + "/api/v1/health")
        health = json.loads(body)
        agent.send_signal(signal.SIGTERM)
        agent.wait(HANG_S)
    print(f"flood: bad frames={bad_frames} poison={poison} rss0={rss0 >> 20} MiB peak={peak >> 20} MiB "
          f"scrapes={len(statuses)} good delivered={sender.delivered}")
    assert bad_frames + poison >= 10_000
    assert set(statuses) == {200} and len(statuses) > 10  # /metrics answered throughout
    assert health["bad_frames_total"] >= bad_frames
    assert health["records_rejected_total"] == {"bad_enum": 4 * 100 * 20, "negative": 4 * 100 * 20,
                                                "out_of_range": 4 * 100 * 20, "not_finite": 4 * 100 * 20}
    assert peak - rss0 < 150 * 2**20, (rss0, peak)
    con = Store.open_readonly(db)
    try:
        good_rows = con.execute("SELECT count(*) FROM steps t JOIN sources s USING (source_id) "
                                "WHERE s.run_id = 'good'").fetchone()[0]
        good_ids = con.execute("SELECT count(DISTINCT step_id) FROM steps t JOIN sources s USING (source_id) "
                               "WHERE s.run_id = 'good'").fetchone()[0]
    finally:
        con.close()
    assert sender.lost == 0 and sender.rejected == 0
    assert sender.delivered == sender.sent == good_rows == good_ids  # the good stream, complete


def _bad_frames(hello: bytes) -> dict[str, list[bytes]]:
    """One bad frame of every kind the decoder knows, as the chunks a hostile client sends (then it closes)."""
    H, M = ev.HEADER, ev.MAGIC
    v2_hello = ev.frame_v2(hello, 0, [ev.Session(7, "")])
    return {
        "random": [os.urandom(64)],
        "bad_magic": [b"XX" + H.pack(M, 1, 0, 1, 10)[2:] + b"\x00" * 10],
        "unknown_version": [H.pack(M, 99, 0, 1, 10) + b"\x00" * 10],
        "over_max_frame": [H.pack(M, 1, 0, 1, ev.MAX_FRAME_BYTES + 100), b"\x01" * 4096],
        "count_past_length": [H.pack(M, 1, 0, 500, 10) + b"\x00" * 10],
        "truncated_header": [H.pack(M, 1, 0, 1, 10)[:7]],
        "v2_without_session": [ev.frame_v2(hello, 0)],
        "v2_session_twice": [v2_hello, ev.frame_v2(hello, 1, [ev.Session(8, "")])],
        "garbage_after_hello": [hello, H.pack(M, 1, 0, 1, 10) + b"\xc8" * 10],
        "first_frame_too_big": [H.pack(M, 1, 0, 1, 200 << 10), b"\x02" * (64 << 10)],
        "gib_announced": [hello, H.pack(M, 1, 0, 1000, 1 << 30), b"\x03" * (64 << 10)],
        "max_announced_after_hello": [hello, H.pack(M, 1, 0, 1000, ev.MAX_FRAME_BYTES), b"\x04" * (64 << 10)],
    }


@pytest.mark.slow
def test_flood_of_every_bad_frame_kind_keeps_memory_within_64_mib_with_the_collector_off(short_tmp):
    """Issue 52: thousands of short connections, 4 at a time over the unix socket and loopback TCP, each one bad
    frame of every kind above (1 GiB and 1 MiB announcements followed by 64 KiB among them), and 5 connections
    that announce 1 MiB frames after their hello and stall with 64 KiB sent: the agent, run with the cyclic
    collector off, stays within its own baseline + 64 MiB, and a legitimate probe beside it loses nothing."""
    db, sock = os.path.join(short_tmp, "m.duckdb"), os.path.join(short_tmp, "agent.sock")
    agent = subprocess.Popen(
        [sys.executable, "-c", "import gc, sys; gc.disable(); from phasescope.cli.main import main; "
         "sys.exit(main(sys.argv[1:]))", "agent", "--db", db, "--listen", f"unix:{sock}", "--listen",
         "tcp:127.0.0.1:0", "--no-metrics", "--no-api", "--no-retention", "--checkpoint-s", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = agent.stdout.readline()
    port = int(re.search(r"tcp:127\.0\.0\.1:(\d+)", line).group(1))
    good = Streamer(f"unix:{sock}", frame_records=200, pause_s=0.005, wait=True).start()
    time.sleep(1.0)  # the good probe connected and streaming: its share of memory is in the baseline
    rss0 = _rss(agent)
    peak, stop, sent = [rss0], threading.Event(), collections.Counter()

    def sample():
        while not stop.is_set():
            peak.append(_rss(agent))
            time.sleep(0.02)

    hello = ev.encode_frame([ev.Hello(1, 0, 1, 0, 1, "evil", "evil", "module")])
    kinds = _bad_frames(hello)
    names = sorted(kinds)

    def client(worker):
        for k in range(750):
            name = names[(worker + k) % len(names)]
            fam, addr = (socket.AF_UNIX, sock) if k % 2 else (socket.AF_INET, ("127.0.0.1", port))
            s = socket.socket(fam)
            try:
                s.connect(addr)
                for chunk in kinds[name]:
                    s.sendall(chunk)
                s.shutdown(socket.SHUT_WR)
                s.settimeout(5)
                s.recv(1)
            except OSError:
                pass
            finally:
                s.close()
            sent[name] += 1

    stallers = []
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for _ in range(5):  # held open while the flood runs: half-sent maximum frames of verified connections
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock)
            s.setblocking(False)
            for chunk in kinds["max_announced_after_hello"]:
                try:
                    s.send(chunk)
                except BlockingIOError:
                    pass
            stallers.append(s)
        workers = [threading.Thread(target=client, args=(w,), daemon=True) for w in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(HANG_S)
    finally:
        for s in stallers:
            s.close()
        stop.set()
        sampler.join(10)
        sender = good.stop()
        agent.send_signal(signal.SIGTERM)
        agent.wait(HANG_S)
    top = max(peak)
    print(f"bad-frame flood: {sum(sent.values())} connections {dict(sent)}; rss0={rss0 >> 20} MiB "
          f"peak={top >> 20} MiB (+{(top - rss0) / 2**20:.1f}); good sent={sender.sent} delivered={sender.delivered}")
    assert sum(sent.values()) == 3000 and set(sent) == set(names)
    assert top - rss0 <= 64 << 20, (rss0 >> 20, top >> 20)
    assert sender.lost == 0 and sender.delivered == sender.sent > 0 and good.not_sent == 0
    assert _count_steps(db) == sender.sent  # the legitimate probe's stream, whole


@pytest.mark.slow
def test_half_sent_maximum_frames_and_slow_senders_are_timed_out_with_bounded_memory(short_tmp):
    db, sock = os.path.join(short_tmp, "h.duckdb"), os.path.join(short_tmp, "agent.sock")
    agent, line = _start_agent(db, sock, "--no-metrics", "--api", "127.0.0.1:0", "--frame-timeout-s", "3",
                               "--idle-timeout-s", "30")
    api_url = re.search(r"read API on (http://\S+?)(;|$)", line.strip()).group(1)
    rss0 = _rss(agent)
    good = Streamer(f"unix:{sock}", frame_records=200, pause_s=0.01).start()
    hello = ev.encode_frame([ev.Hello(1, 0, 1, 0, 1, "half", "m", "module")])
    half = [ev.HEADER.pack(ev.MAGIC, 1, 0, 1000, ev.MAX_FRAME_BYTES), b"\x02" * (ev.MAX_FRAME_BYTES // 2)]
    conns, peak = [], rss0
    t_setup = time.monotonic()
    try:
        for k in range(200):
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock)
            s.setblocking(False)
            for chunk in (hello, *half):
                try:
                    s.send(chunk)  # as much as the socket takes; the rest never comes
                except BlockingIOError:
                    pass
            conns.append(s)
        slow = []
        for k in range(50):
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock)
            slow.append(s)
        t0 = time.monotonic()
        frame = hello
        i = 0
        health, early = {"timeouts_total": 0}, None
        # 1 byte per slow sender per 0.5 s, until all 250 are timed out (3 s frame deadline; a loaded machine
        # takes longer to notice: 4 spinners and 4 workers on 2 cores outlasted a 60 s bound here, so only a hang
        # ends the wait)
        def ended(h):  # timed out (frame or handshake deadline), or evicted from the unverified pool
            return h["timeouts_total"] + h.get("connections_closed_total", {}).get("evicted", 0)

        while time.monotonic() - t0 < HANG_S and ended(health) < 250:
            for s in slow:
                try:
                    s.send(frame[i: i + 1])
                except OSError:
                    pass
            i = (i + 1) % len(frame)
            peak = max(peak, _rss(agent))
            time.sleep(0.5)
            health = json.loads(_get(api_url + "/api/v1/health")[1])
            if early is None and time.monotonic() - t_setup < 1.9:  # no deadline (2 s handshake, 3 s frame)
                early = health["timeouts_total"]  # can have passed yet (a loaded machine may be too slow to see)
        waited = time.monotonic() - t0
    finally:
        for s in conns + slow:
            s.close()
        sender = good.stop()
        agent.send_signal(signal.SIGTERM)
        agent.wait(HANG_S)
    print(f"half-sent/slow: timeouts={health['timeouts_total']} closed={health['connections_closed_total']} "
          f"after {waited:.1f} s rss0={rss0 >> 20} MiB peak={peak >> 20} MiB")
    assert ended(health) >= 250, waited  # every half-sent frame and every slow sender ended
    assert early in (0, None) and waited >= 2  # none before its deadline
    # the sidecar holds what its limits say: the partial-frame budget (16 MiB), a 64 KiB look-ahead per open
    # connection (250), and the good probe's stream (its stored bytes, plus 40 MiB for DuckDB's caches and the
    # decoder: 16-19 MiB measured with the good probe alone). Before 2026-12-03 a lost connection still took
    # the budget and a whole frame's buffer, left in a reference cycle: 67-156 MiB here (131 MiB in CI)
    stored = sum(os.path.getsize(f) for f in (db, db + ".wal") if os.path.exists(f))
    bound = SidecarLimits().partial_bytes + 250 * LOOKAHEAD_BYTES + (40 << 20) + stored
    assert peak - rss0 < bound, (rss0 >> 20, peak >> 20, stored >> 20, bound >> 20)
    assert sender.delivered == sender.sent - sender.lost and sender.delivered > 0
    assert sender.delivered == _count_steps(db)


def test_socket_folder_of_another_user_or_writable_by_others_is_refused(short_tmp):
    folder = os.path.join(short_tmp, "squat")
    os.mkdir(folder)
    os.chmod(folder, 0o777)
    assert "writable by other users" in check_private_folder(folder)
    other = 12345 if os.getuid() != 12345 else 12346
    # as root, really chown; otherwise judge the folder on behalf of another uid (the injected uid)
    if os.getuid() == 0:
        os.chown(folder, other, other)
        uid = None
    else:
        uid = other
    os.chmod(folder, 0o700)
    assert "owned by uid" in check_private_folder(folder, uid)
    sock = os.path.join(folder, "agent.sock")
    with pytest.raises(PermissionError, match="owned by uid"):
        if uid is None:  # the agent refuses to listen in it
            Sidecar(os.path.join(short_tmp, "s.duckdb"), listen=[f"unix:{sock}"]).start()
        else:
            make_private_folder(folder, uid)
    sender = Sender(parse_address(f"unix:{sock}"), _hello_frame(), folder_uid=uid)
    assert not sender.ready()  # the probe refuses to connect into it
    with pytest.raises(PermissionError, match="refusing"):
        connect(parse_address(f"unix:{sock}"), 1.0, uid)


def test_agent_takes_write_bits_off_its_own_folder_and_files_are_private(short_tmp):
    folder = os.path.join(short_tmp, "run")
    os.mkdir(folder)
    os.chmod(folder, 0o777)  # e.g. a Kubernetes emptyDir
    db = os.path.join(short_tmp, "s.duckdb")
    with Sidecar(db, listen=[f"unix:{folder}/agent.sock"], batch_interval_s=0.05) as sc:
        assert stat.S_IMODE(os.stat(folder).st_mode) & 0o022 == 0
        sender = Sender(parse_address(str(sc.bound[0])), _hello_frame())
        assert sender.send(ev.encode_frame(_steps(0, 10)))
        sender.close()
        assert sender.delivered == 10
        assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
        if os.path.exists(db + ".wal"):
            assert stat.S_IMODE(os.stat(db + ".wal").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600


def test_read_api_refuses_foreign_host_and_validates_parameters(short_tmp):
    db = os.path.join(short_tmp, "r.duckdb")
    with Sidecar(db, listen=[f"unix:{short_tmp}/a.sock"], read_api="127.0.0.1:0") as sc:
        url, port = sc.read_api.url, sc.read_api.port
        assert _get(url + "/api/v1/health")[0] == 200
        assert _get(url + "/api/v1/health", host=f"localhost:{port}")[0] == 200
        for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1:{port + 1}", f"127.0.0.1.evil.example:{port}"):
            status, body = _get(url + "/api/v1/query/runs", host=host)
            assert status == 403, host
        for q in ("rank_steps?max_rows=0", "step_sample?limit=-1", "step_timeline?bucket_s=nan",
                  "latency_histogram?bins=abc", "step_timeline?bucket_s=0", "runs?x=1",
                  "run_labels?run_id=" + "x" * 500):
            status, body = _get(url + "/api/v1/query/" + q)
            assert status == 400, (q, body)
            err = json.loads(body)["error"]
            assert "\n" not in err and "Error" not in err and "Traceback" not in err, err
        assert _get(url + "/api/v1/query/step_sample?limit=10")[0] == 200


def test_tcp_token_is_required_when_set(short_tmp):
    db = os.path.join(short_tmp, "t.duckdb")
    with Sidecar(db, listen=["tcp:127.0.0.1:0"], token="s3cret", batch_interval_s=0.05) as sc:
        addr = str(sc.bound[0])
        wrong = Sender(parse_address(addr), _hello_frame(), token="nope", timeout_s=1.0)
        assert not wrong.ready()
        v1 = socket.create_connection((sc.bound[0].path, sc.bound[0].port))
        v1.sendall(ev.encode_frame([ev.Hello(1, 0, 1, 0, 1, "v1", "m", "module")] + _steps(0, 5)))
        v1.settimeout(5)
        assert v1.recv(1) == b""  # a v1 sender cannot present a token: refused
        v1.close()
        right = Sender(parse_address(addr), _hello_frame(), token="s3cret")
        assert right.send(ev.encode_frame(_steps(0, 7)))
        right.close()
        assert right.delivered == 7
        assert sc.stats.auth_failures_total == 2


def test_connection_cap(short_tmp):
    """The cap counts senders that completed their handshake (idle peers that never do have a pool of their
    own, see tests/agent/test_zero_loss.py)."""
    with Sidecar(os.path.join(short_tmp, "c.duckdb"), listen=[f"unix:{short_tmp}/a.sock"], max_connections=3) as sc:
        socks = []
        for _ in range(3):
            s = socket.socket(socket.AF_UNIX)
            s.connect(sc.bound[0].path)
            s.sendall(_hello_frame()())
            socks.append(s)
        assert sc.wait_rows(lambda: sc.stats.open_connections == 3 and not sc.ingest._unverified, HANG_S)
        extra = socket.socket(socket.AF_UNIX)
        extra.connect(sc.bound[0].path)
        extra.settimeout(5)
        assert extra.recv(1) == b""
        assert sc.stats.connections_refused_total == 1
        for s in socks + [extra]:
            s.close()


def test_structured_garbage_never_raises_anything_but_frame_error():
    from phasescope.agent.sidecar import columnar

    payload, n = ev.encode_records(_steps(0, 3) + [ev.RunLabel(1, "a", "b")] + _steps(3, 2))
    d = columnar.decode(payload, n)
    assert d.records == 6 and sum(len(a) for a in d.arrays[2]) == 5 and d.control == [ev.RunLabel(1, "a", "b")]
    for cut in range(len(payload)):
        with pytest.raises(ev.FrameError):
            columnar.decode(payload[:cut], n)
    with pytest.raises(ev.FrameError, match="trailing"):
        columnar.decode(payload + b"\0", n)
    with pytest.raises(ev.FrameError, match="unknown record type"):
        columnar.decode(b"\xc8" * 60, 1)
    assert struct.calcsize("<qQHBIIIQdd") + 1 == columnar.TYPES[2].size


_DISK_AGENT = r'''
import json, os, sys
from prometheus_client import CollectorRegistry
from phasescope.agent.sidecar import Sidecar
from phasescope.exporters.prometheus import MetricsServer, SidecarStatsCollector
mnt, sock = sys.argv[1], sys.argv[2]
db = os.path.join(mnt, "d.duckdb")
sc = Sidecar(db, listen=[f"unix:{sock}"], batch_interval_s=0.05, checkpoint_interval_s=0.5,
             memory_budget_bytes=8 << 20, read_api="127.0.0.1:0").start()
reg = CollectorRegistry()
reg.register(SidecarStatsCollector(sc.stats))
ms = MetricsServer(reg, "127.0.0.1:0").start()
print("READY", sc.read_api.url, ms.url, flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "fill":  # take every free byte of the file system
        fd = os.open(os.path.join(mnt, "filler"), os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * (1 << 16))
        except OSError:
            pass
        os.close(fd)
        print("FILLED", flush=True)
    elif cmd == "free":
        os.unlink(os.path.join(mnt, "filler"))
        print("FREED", flush=True)
    elif cmd == "stop":
        sc.stop()
        ms.close()
        import duckdb
        con = duckdb.connect(db, read_only=True)
        print("STORED", con.execute("SELECT count(*) FROM steps").fetchone()[0], flush=True)
        break
'''


def _can_mount_tmpfs():
    try:
        return subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unprivileged user+mount namespaces for a size-limited tmpfs")
def test_disk_full_then_space_freed_writes_resume_and_nothing_is_lost_uncounted(short_tmp):
    mnt = os.path.join(short_tmp, "mnt")
    os.mkdir(mnt)
    sock = os.path.join(short_tmp, "agent.sock")
    # a real 32 MiB tmpfs in a user+mount namespace of its own (no root needed); the agent runs inside it
    agent = subprocess.Popen(
        ["unshare", "-Urm", "sh", "-c", 'mount -t tmpfs -o size=32m tmpfs "$0" && exec "$1" -c "$2" "$0" "$3"',
         mnt, sys.executable, _DISK_AGENT, sock],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def say(cmd, expect):
        agent.stdin.write(cmd + "\n")
        agent.stdin.flush()
        line = agent.stdout.readline()
        assert line.startswith(expect), line
        return line

    line = agent.stdout.readline()
    assert line.startswith("READY"), line
    _, api_url, metrics_url = line.split()

    def health():
        return json.loads(_get(api_url + "/api/v1/health")[1])

    def store_up():
        text = _get(metrics_url)[1].decode()
        return float(re.search(r"^phasescope_sidecar_store_up (\S+)$", text, re.M).group(1))

    s = Streamer(f"unix:{sock}", frame_records=500, pause_s=0.005).start()
    try:
        deadline = time.monotonic() + HANG_S
        while s.sender.delivered < 20_000 and time.monotonic() < deadline:
            time.sleep(0.05)
        say("fill", "FILLED")
        deadline = time.monotonic() + HANG_S
        while health()["store_ok"] and time.monotonic() < deadline:
            time.sleep(0.05)
        h = health()
        assert h["store_ok"] == 0 and h["store_errors_total"] > 0, h
        assert store_up() == 0.0
        status, body = _get(api_url + "/readyz")
        assert status == 503 and not json.loads(body)["checks"]["store"]["ok"]
        time.sleep(2)  # the outage: the budget fills, the probe's window fills, it drops and counts
        during = s.sender.delivered
        time.sleep(1)
        assert s.sender.delivered == during  # nothing acknowledged while nothing is written
        say("free", "FREED")
        deadline = time.monotonic() + HANG_S
        while s.sender.delivered < during + 20_000 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.sender.delivered >= during + 20_000  # writes resumed in the running agent
        assert store_up() == 1.0
        h = health()
        assert h["store_ok"] == 1 and h["store_reopens_total"] >= 1, h
    finally:
        sender = s.stop()
        stored = int(say("stop", "STORED").split()[1])
        agent.wait(HANG_S)
    print(f"disk full: sent={sender.sent} delivered={sender.delivered} lost={sender.lost} stored={stored} "
          f"not-sent (backpressure)={s.not_sent} health={h}")
    # backpressure held the producer during the outage (nothing was acknowledged meanwhile, checked above);
    # what it could not hand over it counted (not_sent), and nothing it handed over was lost
    assert sender.lost == 0 and sender.in_flight == 0
    assert sender.sent == sender.delivered + sender.lost + sender.rejected
    assert sender.delivered == stored


def test_a_declared_pod_shared_folder_is_accepted_by_probe_and_agent(short_tmp, monkeypatch):
    """A Kubernetes emptyDir (root-owned, 2777 under fsGroup) or a compose volume owned by the agent's
    user: refused by default, accepted on both sides once PHASESCOPE_SOCKET_SHARED=1 declares it."""
    folder = os.path.join(short_tmp, "pod")
    os.mkdir(folder)
    os.chmod(folder, 0o777)
    other = os.getuid() + 4242
    assert check_private_folder(folder) is not None
    assert check_private_folder(folder, other) is not None
    monkeypatch.setenv("PHASESCOPE_SOCKET_SHARED", "1")
    assert check_private_folder(folder) is None and check_private_folder(folder, other) is None
    make_private_folder(folder)  # the agent leaves the pod's mode alone
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o777
    assert check_private_folder(os.path.join(folder, "missing")) is not None  # still a real folder


def test_the_partial_frame_budget_derives_from_the_memory_budget():
    import dataclasses

    assert SidecarLimits().partial_bytes == SidecarLimits().memory_budget_bytes // 2 == 16 << 20
    assert SidecarLimits(memory_budget_bytes=8 << 20).partial_bytes == 4 << 20
    # how the agent applies its flags: replace() on the defaults
    assert dataclasses.replace(SidecarLimits(), memory_budget_bytes=8 << 20).partial_bytes == 4 << 20
    assert SidecarLimits(memory_budget_bytes=2 << 20).partial_bytes == 1 << 20  # its floor
    assert SidecarLimits(memory_budget_bytes=8 << 20, partial_budget_bytes=3 << 20).partial_bytes == 3 << 20
    with pytest.raises(ValueError):
        SidecarLimits(partial_budget_bytes=1024)


def test_a_frame_with_no_room_in_the_partial_budget_is_refused_and_counted(short_tmp):
    """With the partial-frame budget spent (held here directly: a crowd's frames would hold it, but which of
    them waits past its deadline depends on the loop's wake order), a verified connection's frame finds no
    room before its deadline: it is closed and counted under `partial_budget`, not as a plain timeout; with the
    budget back, a probe stores everything."""
    with Sidecar(os.path.join(short_tmp, "b.duckdb"), listen=[f"unix:{short_tmp}/a.sock"],
                 partial_budget_bytes=1 << 20, frame_timeout_s=1.0) as sc:
        path = sc.bound[0].path
        assert sc.ingest._partial.try_take(1 << 20)
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.sendall(_hello_frame("stall")())
        s.sendall(ev.HEADER.pack(ev.MAGIC, 1, 0, 100, 64 << 10) + b"\x05" * 1024)
        assert sc.wait_rows(lambda: sum(sc.stats.connections_closed_total.values()) >= 1, HANG_S)
        assert sc.stats.connections_closed_total == {"partial_budget": 1}
        s.close()
        sc.ingest._partial.give(1 << 20)
        sender = Sender(parse_address(f"unix:{path}"), _hello_frame())
        for k in range(5):
            assert sender.send(ev.encode_frame(_steps(k * 100, 100)))
        sender.close()
        assert (sender.delivered, sender.lost) == (500, 0)
