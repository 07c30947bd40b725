"""The sidecar: many connections, bad frames closing only their connection, batches in DuckDB."""

from __future__ import annotations

import os
import socket
import stat
import threading

import pytest

from phasescope.agent.records import events as ev
from phasescope.agent.sidecar import Sidecar
from phasescope.agent.sidecar.store import Store


def _hello(rank=0, run="run-a"):
    return ev.Hello(1, 0, os.getpid(), rank, 2, run, "m", "module")


def _steps(n, rank=0):
    return [ev.Step(i, i, rank, ev.PHASE_DECODE, 1, 0, 1, i, 0.5, float("nan")) for i in range(n)]


def _send(path, *chunks):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    for c in chunks:
        s.sendall(c)
    return s


def _closed_by_peer(s):
    s.settimeout(5)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_socket_is_private(sidecar):
    assert stat.S_IMODE(os.stat(sidecar.bound[0].path).st_mode) == 0o600


def test_many_connections_at_once(sidecar):
    path = sidecar.bound[0].path

    def rank(r):
        s = _send(path, ev.encode_frame([_hello(r)] + _steps(100, r)), ev.encode_frame(_steps(50, r)))
        s.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sidecar.wait_rows(lambda: sidecar.stats.rows_written_total == 8 * 150)
    sidecar.stop()
    con = Store.open_readonly(sidecar.db_path)
    assert con.execute("SELECT count(DISTINCT source_id), count(*) FROM steps").fetchone() == (8, 1200)
    assert con.execute("SELECT count(*) FROM sources WHERE run_id = 'run-a'").fetchone() == (8,)
    con.close()


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda: ev.encode_frame([_hello()])[:7], id="truncated-header"),
        pytest.param(lambda: ev.encode_frame([_hello()] + _steps(3))[:-5], id="truncated-payload"),
        pytest.param(lambda: ev.HEADER.pack(ev.MAGIC, 1, 0, 1, ev.MAX_FRAME_BYTES + 1) + b"x" * 100, id="oversized"),
        pytest.param(lambda: os.urandom(4096), id="random"),
        pytest.param(lambda: b"PS\x07\x00" + os.urandom(60), id="unknown-version"),
        pytest.param(lambda: ev.encode_frame(_steps(2)), id="no-hello-first"),
    ],
)
def test_bad_frames_close_only_their_connection(sidecar, bad):
    path = sidecar.bound[0].path
    good = _send(path, ev.encode_frame([_hello(0)] + _steps(10)))
    evil = _send(path, bad())
    evil.shutdown(socket.SHUT_WR)  # a truncated frame is only known at end of stream
    assert _closed_by_peer(evil)
    evil.close()
    good.sendall(ev.encode_frame(_steps(5)))
    good.close()
    assert sidecar.wait_rows(lambda: sidecar.stats.rows_written_total == 15)
    assert sidecar.stats.bad_frames_total == 1
    # and a new connection is still served
    again = _send(path, ev.encode_frame([_hello(1)] + _steps(1, 1)))
    again.close()
    assert sidecar.wait_rows(lambda: sidecar.stats.rows_written_total == 16)


def test_tcp_on_loopback_and_refusing_a_live_socket(short_tmp):
    sc = Sidecar(os.path.join(short_tmp, "t.duckdb"), listen=["tcp:127.0.0.1:0"], batch_interval_s=0.05).start()
    try:
        host, port = sc.bound[0].path, sc.bound[0].port
        s = socket.create_connection((host, port))
        s.sendall(ev.encode_frame([_hello()] + _steps(3)))
        s.close()
        assert sc.wait_rows(lambda: sc.stats.rows_written_total == 3)
    finally:
        sc.stop()
    first = Sidecar(os.path.join(short_tmp, "a.duckdb"), listen=[f"unix:{short_tmp}/s.sock"]).start()
    try:
        with pytest.raises(OSError, match="already listening"):
            Sidecar(os.path.join(short_tmp, "b.duckdb"), listen=[f"unix:{short_tmp}/s.sock"]).start()
    finally:
        first.stop()


def test_schema_is_documented_and_versioned(short_tmp):
    store = Store(os.path.join(short_tmp, "s.duckdb"))
    con = store.con
    assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("1",)
    undocumented = con.execute(
        "SELECT table_name, column_name FROM duckdb_columns() WHERE NOT internal AND comment IS NULL "
        "AND table_name IN (SELECT table_name FROM duckdb_tables() WHERE table_name != 'meta')"
    ).fetchall()
    assert undocumented == []
    store.close()
