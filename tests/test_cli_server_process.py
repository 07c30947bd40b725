"""cli/server_process.py: the server subprocess that `sweep --serve` and `verify` on vLLM start, wait for and stop.

Small Python children stand in for the server: one answering /health (on port 0: the port it bound is read back
from its sockets), one on two ports, one that exits at once, one that never answers, one that ignores SIGTERM.
No test picks a free port and releases it for a child: a child binds port 0, or this process holds the socket.
~5 s in all.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from phasescope.cli.errors import CliError
from phasescope.cli.server_process import ServerStartError, listening_ports, served, stop
from hang import HANG_S

# argv: one status per port, each served on a port of its own (port 0: the kernel picks); prints the ports bound
HEALTH = r"""
import http.server, sys, threading, time
time.sleep(0.5)  # a start that takes a while: the first checks find no port
def handler(status):
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status if self.path == "/health" else 404); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a): pass
    return H
servers = [http.server.HTTPServer(("127.0.0.1", 0), handler(int(s))) for s in sys.argv[1:]]
print("listening", *[s.server_address[1] for s in servers], flush=True)
for s in servers[1:]:
    threading.Thread(target=s.serve_forever, daemon=True).start()
servers[0].serve_forever()
"""


def _printed_ports(log) -> list[int]:
    m = re.search(r"listening ((?:\d+ ?)+)", log.read_text())
    return [int(p) for p in m.group(1).split()]


def test_served_on_port_0_yields_the_port_the_server_bound_and_stops_it_after(tmp_path):
    log = tmp_path / "s.log"
    with served([sys.executable, "-c", HEALTH, "200"], "http://127.0.0.1:0", log_path=str(log),
                start_timeout_s=60) as server:
        [bound] = _printed_ports(log)
        assert server.proc.poll() is None
        assert server.port == bound != 0 and server.url == f"http://127.0.0.1:{bound}"
        assert 0.5 <= server.start_s < 60
        with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
            assert r.status == 200
    assert server.proc.returncode == -signal.SIGTERM


def test_on_two_ports_the_one_answering_health_is_the_server(tmp_path):
    """A server with a second port (a metrics port, say) whose /health is 404: the URL is the healthy port's."""
    log = tmp_path / "s.log"
    with served([sys.executable, "-c", HEALTH, "404", "200"], "http://127.0.0.1:0", log_path=str(log),
                start_timeout_s=60) as server:
        other, bound = _printed_ports(log)
        assert server.port == bound and listening_ports(server.proc.pid, "127.0.0.1") == sorted([other, bound])


def test_two_ports_answering_health_is_an_error_not_a_guess(tmp_path):
    argv = [sys.executable, "-c", HEALTH, "200", "200"]
    with pytest.raises(ServerStartError, match=r"answers /health on 2 ports of 127\.0\.0\.1 .*give it one port"):
        with served(argv, "http://127.0.0.1:0", log_path=str(tmp_path / "s.log"), start_timeout_s=60):
            pytest.fail("the block ran on one of two servers")


def test_a_fixed_url_is_waited_for_as_given(tmp_path):
    """With a port in the URL, served waits for that URL: here a server in this process, its socket bound before
    (no race), listening only after 0.5 s (the first checks are refused)."""
    import http.server

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), H, bind_and_activate=False)
    httpd.server_bind()  # bound, not listening: connections are refused
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    threading.Timer(0.5, lambda: (httpd.server_activate(), httpd.serve_forever())).start()
    try:
        with served([sys.executable, "-c", "import time; time.sleep(60)"], url, log_path=str(tmp_path / "s.log"),
                    start_timeout_s=60) as server:
            assert server.url == url and 0.5 <= server.start_s < 60
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_server_that_exits_is_an_error_with_its_log_tail(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('x' * 5000); print('bad flag --frob'); sys.exit(3)"]
    with pytest.raises(ServerStartError) as err:
        with served(argv, "http://127.0.0.1:0", log_path=str(tmp_path / "s.log"), start_timeout_s=60,
                    name="vLLM with --frob"):
            pytest.fail("the block ran without a server")
    msg = str(err.value)
    assert isinstance(err.value, CliError) and isinstance(err.value, RuntimeError)  # what callers catch
    assert msg.startswith("vLLM with --frob did not start (it exited with code 3)")
    assert "bad flag --frob" in msg and str(tmp_path / "s.log") in msg
    assert len(msg) < 4000  # the log's last lines, not all of it


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path, monkeypatch):
    procs: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def recorded(*args, **kwargs):
        procs.append(popen(*args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(subprocess, "Popen", recorded)
    argv = [sys.executable, "-c", f"import time; time.sleep({2 * HANG_S})"]
    refused = socket.socket()  # bound, never listening: the URL is refused, and no other process can take it
    refused.bind(("127.0.0.1", 0))
    t0 = time.monotonic()
    try:
        with pytest.raises(ServerStartError, match=r"did not answer within 1 s"):
            with served(argv, f"http://127.0.0.1:{refused.getsockname()[1]}", log_path=str(tmp_path / "s.log"),
                        start_timeout_s=1):
                pytest.fail("the block ran without a server")
    finally:
        refused.close()
    # stopped, not left to its own end (2 x HANG_S): the process has exited, and the wait ended long before
    left = [p for p in procs if p.poll() is None]
    for p in left:
        p.kill()
    assert len(procs) == 1 and not left, "the server process was left running"
    assert time.monotonic() - t0 < HANG_S


def test_on_port_0_a_server_whose_health_never_answers_times_out_naming_its_ports(tmp_path):
    log = tmp_path / "s.log"
    with pytest.raises(ServerStartError, match=r"no port it listens on at 127\.0\.0\.1 answered /health within "
                                               r"2 s; listening: \d+") as err:
        with served([sys.executable, "-c", HEALTH, "503"], "http://127.0.0.1:0", log_path=str(log),
                    start_timeout_s=2):
            pytest.fail("the block ran without a healthy server")
    assert f"listening: {_printed_ports(log)[0]}" in str(err.value)


def test_listening_ports_are_the_process_own_listeners_on_the_host():
    """Only LISTEN sockets, only at the host asked (not on every address), only this process's."""
    here, elsewhere, unlistened, everywhere = socket.socket(), socket.socket(), socket.socket(), socket.socket()
    child = client = None
    try:
        here.bind(("127.0.0.1", 0))
        here.listen(1)
        elsewhere.bind(("127.0.0.2", 0))  # another loopback address
        elsewhere.listen(1)
        unlistened.bind(("127.0.0.1", 0))
        everywhere.bind(("0.0.0.0", 0))  # a port of this test's own, on every address
        everywhere.listen(1)
        client = socket.create_connection(here.getsockname())  # an ESTABLISHED socket at 127.0.0.1 is no listener
        child = subprocess.Popen([sys.executable, "-c", "import socket, time\ns = socket.socket()\n"
                                  "s.bind(('127.0.0.1', 0)); s.listen(1); print(s.getsockname()[1], flush=True)\n"
                                  "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
        child_port = int(child.stdout.readline())
        ports = listening_ports(os.getpid(), "127.0.0.1")
        assert here.getsockname()[1] in ports
        assert elsewhere.getsockname()[1] not in ports and unlistened.getsockname()[1] not in ports
        assert client.getsockname()[1] not in ports and everywhere.getsockname()[1] not in ports
        assert everywhere.getsockname()[1] in listening_ports(os.getpid(), "0.0.0.0")
        assert here.getsockname()[1] in listening_ports(os.getpid(), "localhost")  # a name: resolved
        assert child_port not in ports  # a child's listener is the child's
        assert listening_ports(child.pid, "127.0.0.1") == [child_port]
        assert listening_ports(child.pid, "127.0.0.2") == []
    finally:
        for s in (here, elsewhere, unlistened, everywhere, client):
            if s is not None:
                s.close()
        if child is not None:
            child.kill()
            child.wait()
    assert listening_ports(child.pid, "127.0.0.1") == []  # gone


def test_stop_kills_a_server_that_ignores_sigterm():
    proc = subprocess.Popen([sys.executable, "-c", "import signal, time\nsignal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"up\n"  # the handler is in place
    stop(proc, grace_s=0.5)
    assert proc.returncode == -signal.SIGKILL
