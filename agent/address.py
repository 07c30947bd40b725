"""Where the sidecar listens: "unix:/path/agent.sock" or a plain path (the default,
a 0600 socket), or "tcp:127.0.0.1:7701". Shared by the probe and the sidecar; stdlib only.
"""

from __future__ import annotations

import os
import tempfile
from typing import NamedTuple

ENV_ADDRESS = "PHASESCOPE_AGENT"


class Address(NamedTuple):
    """Where the sidecar listens."""

    kind: str  # "unix" or "tcp"
    path: str  # socket path (unix) or host (tcp)
    port: int  # 0 for unix

    def __str__(self) -> str:
        return f"unix:{self.path}" if self.kind == "unix" else f"tcp:{self.path}:{self.port}"


def default_socket_path() -> str:
    """$XDG_RUNTIME_DIR/phasescope/agent.sock, else <tmp>/phasescope-<uid>/agent.sock."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    sub = "phasescope" if os.environ.get("XDG_RUNTIME_DIR") else f"phasescope-{os.getuid()}"
    return os.path.join(base, sub, "agent.sock")


def parse_address(text: str | None) -> Address:
    """Parse an address; None means $PHASESCOPE_AGENT or the default socket. Raises ValueError."""
    if text is None:
        text = os.environ.get(ENV_ADDRESS) or default_socket_path()
    if text.startswith("tcp:"):
        rest = text[4:].lstrip("/")
        host, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"bad tcp address {text!r}; expected tcp:HOST:PORT")
        return Address("tcp", host, int(port))
    if text.startswith("unix:"):
        text = text[5:]
    if not text:
        raise ValueError("empty socket path")
    return Address("unix", text, 0)
