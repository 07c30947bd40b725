"""An HTTP server subprocess for as long as a `with` block runs: started, waited for, stopped (stdlib only).

`served` starts `argv` with its stdout and stderr in a log file, waits until URL/health answers 200, yields a
`Server`, and on exit stops it: SIGTERM, 60 s to exit, then SIGKILL. Used by `sweep --serve` (any
OpenAI-compatible server, cli/sweep_server.py) and by `verify` on vLLM (one fresh server per run,
cli/verify_vllm.py). When the server exits or does not answer in time, `ServerStartError` says which, with the
command and the last lines of its log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import subprocess
import time
import urllib.request
from typing import Iterator, Mapping, Sequence

from .errors import CliError

STOP_GRACE_S = 60.0  # SIGTERM to SIGKILL: vLLM's shutdown joins its engine process
POLL_S = 0.5  # between health checks, seconds
LOG_TAIL_CHARS = 3000  # of the server's log, in a start failure's message


class ServerStartError(CliError):
    """The server exited before URL/health answered, or did not answer in time; the message ends with its log's
    last lines."""


@dataclasses.dataclass(frozen=True)
class Server:
    """A started server: its base URL, process, log file and start time (launch to first healthy answer, s)."""

    url: str
    proc: subprocess.Popen
    log_path: str
    start_s: float


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
    answers until the block exits, then stopped (`stop`). ServerStartError, the server stopped, when it exits
    first or has not answered after `start_timeout_s` seconds; `name` is what the message calls it."""
    argv = list(argv)
    with open(log_path, "w") as log:  # the child holds its own descriptor
        proc = subprocess.Popen(argv, env=None if env is None else dict(env), stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while not healthy(url):
            if proc.poll() is not None:
                why = f"it exited with code {proc.returncode}"
            elif time.monotonic() - t0 > start_timeout_s:
                why = f"{url}/health did not answer within {start_timeout_s:g} s"
            else:
                time.sleep(POLL_S)
                continue
            raise ServerStartError(f"{name} did not start ({why}): {shlex.join(argv)}\n"
                                   f"last lines of its log ({log_path}):\n{log_tail(log_path)}")
        yield Server(url, proc, log_path, time.monotonic() - t0)
    finally:
        stop(proc)
