"""cli/server_process.py: the server subprocess that `sweep --serve` and `verify` on vLLM start, wait for and stop.

Small Python children stand in for the server: one answering /health, one that exits at once, one that never
answers, one that ignores SIGTERM. ~3 s in all.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from phasescope.cli.errors import CliError
from phasescope.cli.server_process import ServerStartError, served, stop

HEALTH = r"""
import http.server, sys, time
time.sleep(0.5)  # a start that takes a while: the first checks are refused
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
print("listening", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_served_yields_once_healthy_and_stops_the_server_after(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with served([sys.executable, "-c", HEALTH, str(port)], url, log_path=str(tmp_path / "s.log"),
                start_timeout_s=60) as server:
        assert server.proc.poll() is None and server.url == url
        assert 0.5 <= server.start_s < 60
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200
    assert server.proc.returncode == -signal.SIGTERM
    assert "listening" in (tmp_path / "s.log").read_text()


def test_a_server_that_exits_is_an_error_with_its_log_tail(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('x' * 5000); print('bad flag --frob'); sys.exit(3)"]
    with pytest.raises(ServerStartError) as err:
        with served(argv, f"http://127.0.0.1:{_free_port()}", log_path=str(tmp_path / "s.log"), start_timeout_s=60,
                    name="vLLM with --frob"):
            pytest.fail("the block ran without a server")
    msg = str(err.value)
    assert isinstance(err.value, CliError) and isinstance(err.value, RuntimeError)  # what callers catch
    assert msg.startswith("vLLM with --frob did not start (it exited with code 3)")
    assert "bad flag --frob" in msg and str(tmp_path / "s.log") in msg
    assert len(msg) < 4000  # the log's last lines, not all of it


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match=r"did not answer within 1 s"):
        with served(argv, f"http://127.0.0.1:{_free_port()}", log_path=str(tmp_path / "s.log"), start_timeout_s=1):
            pytest.fail("the block ran without a server")
    assert time.monotonic() - t0 < 30  # stopped by SIGTERM, not left to its 60 s


def test_stop_kills_a_server_that_ignores_sigterm():
    proc = subprocess.Popen([sys.executable, "-c", "import signal, time\nsignal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"up\n"  # the handler is in place
    stop(proc, grace_s=0.5)
    assert proc.returncode == -signal.SIGKILL
