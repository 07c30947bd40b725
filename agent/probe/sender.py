"""Probe -> sidecar transport: a sender that reconnects with backoff and counts only acknowledged records.

The sender runs on the probe's background thread (and an exit hook's ship) only; the host's threads never touch a socket.

Delivery (wire v2, see `agent/events.py`): every data frame carries a sequence
number; the sidecar acknowledges what it has committed, cumulatively per sender
nonce. Records count as `delivered` only when acknowledged as stored, and as
`rejected` when the sidecar refused them (bad values).

At-least-once delivery, exactly-once storage: the sender keeps the bytes of every
frame until it is acknowledged. When a connection dies (the sidecar restarted,
a send timed out), the next connection's welcome says which frames the store
committed; the others are sent again, in order, with their sequence numbers,
and the sidecar stores a frame only if its sequence number is above what the
store committed for this nonce (checked in the same transaction as the rows).
Records count as `lost` only when `close` ends with frames still unacknowledged.
So at any time `sent = delivered + rejected + lost + in_flight`, and after a close
`delivered` equals what the store holds from this sender. The bytes held are
capped (`window_bytes`): when the sidecar is slow, full or gone, `ready()` says
no, records stay in the probe's ring, and the ring drops (and counts) the oldest.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import select
import socket
import time
from typing import Callable

from ..records.address import ENV_TOKEN, Address, check_private_folder
from ..records.events import ACK_WELCOME, HEADER, TOKEN_BYTES, Ack, FrameError, Session, decode_acks, decode_header, frame_v2

log = logging.getLogger("phasescope.transport")


def connect(addr: Address, timeout_s: float, folder_uid: int | None = None) -> socket.socket:
    """Open a blocking client socket with a send timeout. Raises OSError (PermissionError for an
    unsafe socket folder: one owned by another user or writable by others)."""
    if addr.kind == "unix":
        reason = check_private_folder(os.path.dirname(addr.path) or ".", folder_uid)
        if reason is not None:
            raise PermissionError(f"refusing {addr}: {reason}")
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


def _readable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether `sock` has data (or EOF) within `timeout_s`. poll(), not select(): a host process with many
    descriptors (a server with a thousand clients) gives the probe's socket a number select() refuses."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(max(0, int(timeout_s * 1000))))


class Sender:
    """A connection to the sidecar that reconnects with exponential backoff.

    `send(frame)` returns False when the frame could not be handed to the socket
    (no sidecar, broken pipe, timeout); the caller counts those records as dropped.
    `on_connect` returns the (v1-encoded) frame to send first on each new connection (Hello).
    `token`: the shared secret of a TCP sidecar started with one (default $PHASESCOPE_AGENT_TOKEN).
    `window_bytes`: sent-but-unacknowledged bytes at most (kept here until acknowledged, to be sent again
    after a reconnect), and it must exceed what the sidecar's writer waits for
    before a transaction (a DuckDB row group: 122,880 records, ~6.6 MiB of Steps) by a good margin, or
    a lone fast probe waits for each commit instead of sending the next frames meanwhile.
    """

    def __init__(
        self,
        addr: Address,
        on_connect: Callable[[], bytes],
        timeout_s: float = 2.0,
        backoff_min_s: float = 0.05,
        backoff_max_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        token: str | None = None,
        window_bytes: int = 32 << 20,
        drain_s: float = 5.0,
        folder_uid: int | None = None,
    ) -> None:
        token = os.environ.get(ENV_TOKEN, "") if token is None else token
        if len(token.encode()) > TOKEN_BYTES:
            raise ValueError(f"token longer than {TOKEN_BYTES} bytes")
        if window_bytes < 1 << 16:
            raise ValueError("window_bytes must be >= 64 KiB")
        self.addr = addr
        self._on_connect = on_connect
        self._timeout_s = timeout_s
        self._backoff_min_s = backoff_min_s
        self._backoff_max_s = backoff_max_s
        self._clock = clock
        self._token = token
        self._window = window_bytes
        self._drain_s = drain_s
        self._folder_uid = folder_uid
        self._sock: socket.socket | None = None
        self._backoff_s = backoff_min_s
        self._next_try = 0.0
        self._warned = False
        self._v1 = False  # the sidecar is an old build without acks
        self._no_welcome = 0  # handshakes in a row closed without a welcome
        self.nonce = random.SystemRandom().getrandbits(63) + 1
        self._seq = 0  # last data frame sequence number used
        # frames sent and not yet acknowledged, in seq order: (seq, records, v2 frame bytes)
        self._inflight: collections.deque[tuple[int, int, bytes]] = collections.deque()
        self._inflight_bytes = 0  # bytes of _inflight and _unresolved: what this sender holds
        self._unresolved: list[tuple[int, int, bytes]] = []  # sent on a connection that died: resolved by
        # the next welcome (committed, or sent again)
        self._acked = (0, 0, 0)  # the sidecar's cumulative (last_seq, stored, rejected) for our nonce
        self._rx = bytearray()
        # counters (monotonic), in records unless named otherwise
        self.connects = 0
        self.failures = 0
        self.sent = 0  # records in data frames handed to the socket
        self.delivered = 0  # acknowledged as stored
        self.rejected = 0  # acknowledged as refused by the sidecar (bad values)
        self.lost = 0  # sent, and still unacknowledged when `close` gave up on them
        self.resent = 0  # records sent again after a reconnect (not counted again in `sent`)
        self.max_reconnect_s = 0.0  # longest time from a lost connection to the next one, s
        self._lost_at: float | None = None
        self.unacked_v1 = 0  # sent to an old (v1) sidecar, which cannot acknowledge

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def in_flight(self) -> int:
        """Records sent and not yet accounted for (acknowledged or known lost)."""
        return sum(n for _, n, _ in self._inflight) + sum(n for _, n, _ in self._unresolved)

    def ready(self) -> bool:
        """Connected with room in the window, or connected now if the backoff allows a try."""
        if self._sock is not None:
            self.poll()
            return self._sock is not None and self._inflight_bytes < self._window
        now = self._clock()
        if now < self._next_try:
            return False
        try:
            sock = connect(self.addr, self._timeout_s, self._folder_uid)
            try:
                self._handshake(sock)
            except BaseException:
                sock.close()
                raise
        except (OSError, FrameError) as exc:
            self._next_try = now + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, self._backoff_max_s)
            if not self._warned:
                level = logging.WARNING if isinstance(exc, PermissionError) else logging.INFO
                log.log(level, "phasescope: no sidecar at %s (%s); retrying with backoff", self.addr, exc)
                self._warned = True
            return False
        self._sock = sock
        self._backoff_s = self._backoff_min_s
        self.connects += 1
        if self._lost_at is not None:
            self.max_reconnect_s = max(self.max_reconnect_s, self._clock() - self._lost_at)
            self._lost_at = None
        self._warned = False
        if self._unresolved:
            self._resend()
        return self._sock is not None and self._inflight_bytes < self._window

    def _resend(self) -> None:
        """Send again, in order, the frames of a dead connection that the welcome did not cover."""
        todo, self._unresolved = self._unresolved, []
        for i, (seq, n, data) in enumerate(todo):
            self._inflight.append((seq, n, data))
            try:
                self._sock.sendall(data)  # type: ignore[union-attr]
            except (OSError, AttributeError) as exc:
                self._inflight.extend(todo[i + 1:])
                self._lost_connection(exc)
                return
            self.resent += n

    def _handshake(self, sock: socket.socket) -> None:
        hello = self._on_connect()
        if self._v1:
            sock.sendall(hello)
            return
        sock.sendall(frame_v2(hello, 0, [Session(self.nonce, self._token)]))
        deadline = time.monotonic() + self._timeout_s
        while True:
            acks = decode_acks(self._rx)
            if acks:
                self._no_welcome = 0
                for a in acks:
                    self._apply(a)
                return
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(4096)
            except socket.timeout:
                raise OSError("no welcome from the sidecar") from None
            if not chunk:
                # closed without a welcome: a v1 sidecar (it rejects v2 frames), a refused token, or a
                # sidecar going down; after 3 in a row, assume v1
                self._no_welcome += 1
                if self._no_welcome >= 3 and not self._token:
                    log.info("phasescope: sidecar at %s speaks wire v1 only; sending without acknowledgements",
                             self.addr)
                    self._v1 = True
                raise OSError("the sidecar closed the connection during the handshake")
            self._rx += chunk
            sock.settimeout(self._timeout_s)

    def send(self, frame: bytes) -> bool:
        """Send one (v1-encoded) data frame; False if it was not handed to the socket."""
        if not self.ready():
            return False
        assert self._sock is not None
        count, _ = decode_header(frame[: HEADER.size])
        if self._v1:
            data, seq = frame, 0
        else:
            seq = self._seq + 1
            data = frame_v2(frame, seq)
        if not self._v1:  # held from now on: a failed send is sent again after the reconnect
            self._seq = seq
            self._inflight.append((seq, count, data))
            self._inflight_bytes += len(data)
        self.sent += count
        try:
            self._sock.sendall(data)
        except OSError as exc:
            self._lost_connection(exc)
            if self._v1:
                self.sent -= count
                return False
            return True
        if self._v1:
            self.unacked_v1 += count
        self.poll()
        return True

    def poll(self) -> None:
        """Read whatever acks arrived (never blocks)."""
        sock = self._sock
        if sock is None or self._v1:
            return
        while True:
            try:
                if not _readable(sock, 0):
                    break
                chunk = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except (OSError, ValueError) as exc:
                self._lost_connection(exc)
                return
            if not chunk:
                self._lost_connection(EOFError("closed by the sidecar"))
                return
            self._rx += chunk
        try:
            for a in decode_acks(self._rx):
                self._apply(a)
        except FrameError as exc:
            self._lost_connection(exc)

    def wait_room(self, timeout_s: float) -> bool:
        """Block until the window has room (acks arrived) or `timeout_s` passes; True if `send` may go.
        For callers that would rather wait than drop (benchmarks, offline replays): the probe never waits."""
        sock = self._sock
        if sock is None or self._v1 or self._inflight_bytes < self._window:
            return self.ready()
        try:
            _readable(sock, timeout_s)
        except (OSError, ValueError):
            pass
        return self.ready()

    def _apply(self, ack: Ack) -> None:
        last_seq, stored, rejected = self._acked
        if ack.kind == ACK_WELCOME:
            if ack.last_seq < last_seq or ack.stored < stored or ack.rejected < rejected:
                last_seq, stored, rejected = 0, 0, 0  # the sidecar's store does not know us (a new file)
            self.delivered += ack.stored - stored
            self.rejected += ack.rejected - rejected
            self._acked = (ack.last_seq, ack.stored, ack.rejected)
            # frames of the dead connection that the store committed are done; the rest are sent again
            keep = []
            for seq, n, data in self._unresolved:
                if seq > ack.last_seq:
                    keep.append((seq, n, data))
                else:
                    self._inflight_bytes -= len(data)
            self._unresolved = keep
            return
        if ack.last_seq < last_seq:
            return
        self.delivered += ack.stored - stored
        self.rejected += ack.rejected - rejected
        self._acked = (ack.last_seq, ack.stored, ack.rejected)
        while self._inflight and self._inflight[0][0] <= ack.last_seq:
            self._inflight_bytes -= len(self._inflight.popleft()[2])

    def _lost_connection(self, exc: BaseException) -> None:
        self.failures += 1
        if self._lost_at is None:
            self._lost_at = self._clock()
        log.info("phasescope: lost sidecar connection (%s)", exc)
        self._drop_socket()
        self._next_try = self._clock() + self._backoff_s

    def _drop_socket(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
        self._rx.clear()
        # what the dead connection did not acknowledge: resolved by the next welcome (kept, bytes and all)
        self._unresolved.extend(self._inflight)
        self._inflight.clear()

    def close(self) -> None:
        """Wait (up to `drain_s`) for the acks of what was sent, then close; the rest counts as lost.
        Frames of a dead connection get one more try first (a sidecar restarted meanwhile)."""
        if self._unresolved and self._sock is None and not self._v1:
            self._next_try = 0.0
            self.ready()
        sock = self._sock
        if sock is not None and not self._v1 and self._inflight:
            deadline = time.monotonic() + self._drain_s
            try:
                sock.shutdown(socket.SHUT_WR)  # the sidecar commits what it has, acks, and closes
            except OSError:
                pass
            while self._sock is not None and self._inflight and time.monotonic() < deadline:
                try:
                    sock.settimeout(max(0.01, deadline - time.monotonic()))
                    chunk = sock.recv(65536)
                except socket.timeout:
                    break
                except OSError:
                    break
                if not chunk:
                    break
                self._rx += chunk
                try:
                    for a in decode_acks(self._rx):
                        self._apply(a)
                except FrameError:
                    break
        self._drop_socket()
        self.lost += sum(n for _, n, _ in self._unresolved)
        self._unresolved.clear()
        self._inflight_bytes = 0
