"""Probe -> sidecar transport: a sender that reconnects with backoff.

The sender runs on the probe's flush thread only; the host's threads never touch a socket.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Callable

from ..address import Address

log = logging.getLogger("phasescope.transport")


def connect(addr: Address, timeout_s: float) -> socket.socket:
    """Open a blocking client socket with a send timeout. Raises OSError."""
    if addr.kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: object = addr.path
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        target = (addr.path, addr.port)
    sock.settimeout(timeout_s)
    try:
        sock.connect(target)
    except OSError:
        sock.close()
        raise
    return sock


class Sender:
    """A connection to the sidecar that reconnects with exponential backoff.

    `send(frame)` returns False when the frame could not be delivered (no
    sidecar, broken pipe, timeout); the caller counts what was lost.
    `on_connect` returns the frame to send first on each new connection (Hello).
    """

    def __init__(
        self,
        addr: Address,
        on_connect: Callable[[], bytes],
        timeout_s: float = 2.0,
        backoff_min_s: float = 0.05,
        backoff_max_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.addr = addr
        self._on_connect = on_connect
        self._timeout_s = timeout_s
        self._backoff_min_s = backoff_min_s
        self._backoff_max_s = backoff_max_s
        self._clock = clock
        self._sock: socket.socket | None = None
        self._backoff_s = backoff_min_s
        self._next_try = 0.0
        self.connects = 0
        self.failures = 0
        self._warned = False

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def ready(self) -> bool:
        """Connected, or connected now if the backoff allows a try."""
        if self._sock is not None:
            return True
        now = self._clock()
        if now < self._next_try:
            return False
        try:
            sock = connect(self.addr, self._timeout_s)
            sock.sendall(self._on_connect())
        except OSError as exc:
            self._next_try = now + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, self._backoff_max_s)
            if not self._warned:
                log.info("phasescope: no sidecar at %s (%s); retrying with backoff", self.addr, exc)
                self._warned = True
            return False
        self._sock = sock
        self._backoff_s = self._backoff_min_s
        self.connects += 1
        self._warned = False
        return True

    def send(self, frame: bytes) -> bool:
        """Send one frame; False if it was not delivered."""
        if not self.ready():
            return False
        assert self._sock is not None
        try:
            self._sock.sendall(frame)
            return True
        except OSError as exc:
            self.failures += 1
            log.info("phasescope: lost sidecar connection (%s)", exc)
            self.close()
            self._next_try = self._clock() + self._backoff_s
            return False

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
