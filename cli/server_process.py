"""An HTTP server subprocess for as long as a `with` block runs: started, waited for, stopped.

`served` starts `argv` with its stdout and stderr in a log file, waits until URL/health answers 200, yields a
`Server`, and on exit stops it: SIGTERM, 60 s to exit, then SIGKILL. A URL with port 0 (`http://127.0.0.1:0`, the
server started with `--port 0`) means "the port the server binds": it is read back from the started process's
listening sockets (`listening_ports`), so nothing picks a free port, releases it and hopes the child gets it.
Used by `sweep --serve` (any OpenAI-compatible server, cli/sweep_server.py) and by `verify` on vLLM (one fresh
server per run, cli/verify_vllm.py). When the server exits or does not answer in time, `ServerStartError` says
which, with the command and the last lines of its log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from typing import Iterator, Mapping, Sequence

import psutil

from .errors import CliError

STOP_GRACE_S = 60.0  # SIGTERM to SIGKILL: vLLM's shutdown joins its engine process
POLL_S = 0.5  # between health checks, seconds
LOG_TAIL_CHARS = 3000  # of the server's log, in a start failure's message


class ServerStartError(CliError):
    """The server exited before URL/health answered, did not answer in time, or (port 0) answered on more than one
    port; the message ends with its log's last lines."""


@dataclasses.dataclass(frozen=True)
class Server:
    """A started server: its base URL (with the port it bound when started on port 0), process, log file and
    start time (launch to first healthy answer, s)."""

    url: str
    proc: subprocess.Popen
    log_path: str
    start_s: float

    @property
    def port(self) -> int:
        """The TCP port `url` names."""
        return _port_of(self.url)


def healthy(url: str, timeout_s: float = 10.0) -> bool:
    """Whether URL/health answers 200 within `timeout_s` seconds."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:  # refused, reset, timed out, or an HTTP error status (HTTPError is an OSError)
        return False


def log_tail(path: str, chars: int = LOG_TAIL_CHARS) -> str:
    """The last `chars` characters of the file at `path` (undecodable bytes replaced)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError as exc:
        return f"(log unreadable: {exc})"


def listening_ports(pid: int, host: str) -> list[int]:
    """TCP ports that process `pid` itself listens on at `host` (an address, or a name: the addresses it resolves
    to), sorted; [] when it is gone. Not its children's: vLLM's data-parallel workers listen on a dozen ports each
    at 127.0.0.1. Not on every address (0.0.0.0, ::) either: vLLM's API server with --data-parallel-size 2 listened
    on [::]:PORT while its engines started, besides its own port (both seen in tests/agent/test_vllm_dp_skew.py's
    run); a server found this way is started on the URL's host (`--host 127.0.0.1`)."""
    try:
        proc = psutil.Process(pid)
        conns = proc.net_connections("tcp") if hasattr(proc, "net_connections") else proc.connections("tcp")
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []
    addrs = {host}
    with contextlib.suppress(OSError):
        addrs |= {ai[4][0] for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    return sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.ip in addrs})


def _port_of(url: str) -> int:
    u = urllib.parse.urlsplit(url)
    return u.port if u.port is not None else {"http": 80, "https": 443}.get(u.scheme, 0)


def _with_port(url: str, port: int) -> str:
    u = urllib.parse.urlsplit(url)
    host = f"[{u.hostname}]" if ":" in (u.hostname or "") else u.hostname
    return urllib.parse.urlunsplit(u._replace(netloc=f"{host}:{port}"))


def _answering(proc: subprocess.Popen, url: str) -> list[str]:
    """The URLs on which `proc` answers /health now: `url` itself ([] when not), or with port 0 in `url` one per
    port that `proc` listens on at the URL's host and answers /health on."""
    if _port_of(url) != 0:
        return [url] if healthy(url) else []
    ports = listening_ports(proc.pid, urllib.parse.urlsplit(url).hostname or "")
    return [u for u in (_with_port(url, p) for p in ports) if healthy(u)]


def stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM, `grace_s` seconds to exit, then SIGKILL (and 10 s for the kernel to reap it)."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def served(argv: Sequence[str], url: str, *, log_path: str, start_timeout_s: float,
           env: Mapping[str, str] | None = None, name: str = "the server") -> Iterator[Server]:
    """`argv` running (environment `env`, default this one; output to `log_path`) from the moment URL/health
    answers until the block exits, then stopped (`stop`). With port 0 in `url` (`argv` starts the server on port
    0), the URL is the one port the started process listens on at that host and answers /health on; the yielded
    `Server.url` names it. ServerStartError, the server stopped, when it exits first, has not answered after
    `start_timeout_s` seconds, or (port 0) answers on more than one port; `name` is what the message calls it."""
    argv = list(argv)
    with open(log_path, "w") as log:  # the child holds its own descriptor
        proc = subprocess.Popen(argv, env=None if env is None else dict(env), stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while True:
            found = _answering(proc, url)
            if len(found) == 1:
                break
            host = urllib.parse.urlsplit(url).hostname or ""
            if found:  # which one is the server's is not knowable from here
                why = f"it answers /health on {len(found)} ports of {host} ({', '.join(found)}): give it one port"
            elif proc.poll() is not None:
                why = f"it exited with code {proc.returncode}"
            elif time.monotonic() - t0 > start_timeout_s:
                why = (f"{url}/health did not answer within {start_timeout_s:g} s" if _port_of(url) != 0 else
                       f"no port it listens on at {host} answered /health within {start_timeout_s:g} s; listening: "
                       f"{', '.join(map(str, listening_ports(proc.pid, host))) or 'none'}")
            else:
                time.sleep(POLL_S)
                continue
            raise ServerStartError(f"{name} did not start ({why}): {shlex.join(argv)}\n"
                                   f"last lines of its log ({log_path}):\n{log_tail(log_path)}")
        yield Server(found[0], proc, log_path, time.monotonic() - t0)
    finally:
        stop(proc)
