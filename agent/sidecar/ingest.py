"""Ingest: the asyncio loop that accepts probe connections and reads whole frames under deadlines and
byte budgets; what a frame holds is then the sessions' business (agent/sidecar/sessions.py: handshake,
token, sequence, queueing for the writer, acknowledgements).

Structural garbage or a wrong token closes only its connection.
Connections have a cap, an idle deadline, a per-frame deadline and a cap on the bytes of partial frames
held in total. A connection that has not completed its handshake (Session, Hello) lives in a small pool
of its own (`max_unverified`, the oldest evicted when full) with a short deadline and a small first
frame, so idle, slow, malformed or half-sent peers never take a real probe's slot or partial budget. A
sender that connects again ends its old connections at once (its frames in flight are sent again), and
every close is counted by reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import threading
import time

from ..records.address import Address, make_private_folder
from ..records.events import HEADER, FrameError, read_header
from .connio import Incomplete, Reader, Writer
from .limits import SidecarLimits
from .sessions import Conn, Sessions
from .stats import Budget, SidecarStats
from .store import Store
from .writer import Item
from .writer import Writer as StoreWriter

log = logging.getLogger("phasescope.sidecar")

FIRST_FRAME_BYTES = 64 << 10  # a first frame (Session, Hello, run labels) holds at most this
BACKLOG = 4096  # pending connects the kernel holds (capped by net.core.somaxconn): a flood of peers
# must not fill a short queue and make a real probe's connect fail


class _Timeout(Exception):
    """A read deadline passed; `reason` names the close when it is not the plain frame/handshake deadline."""

    def __init__(self, reason: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason


class Ingest:
    """Serves `addresses` on a loop thread of its own and queues what arrives on `writer`."""

    def __init__(self, addresses: list[Address], store: Store, stats: SidecarStats, limits: SidecarLimits,
                 budget: Budget, writer: StoreWriter, token: str | None = None) -> None:
        self.addresses, self.store, self.stats, self.limits = addresses, store, stats, limits
        self.sessions = Sessions(store, stats, writer, token)
        self._budget = budget
        self._partial = Budget(limits.partial_bytes)
        self._unverified: dict[Conn, None] = {}  # connections without a completed handshake, oldest first
        self._loop: asyncio.AbstractEventLoop | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self._tasks: set[asyncio.Task] = set()
        self.thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._stopping = threading.Event()
        self.bound: list[Address] = []

    def start(self) -> None:
        """Bind every address and serve. Raises what binding raised."""
        self._loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run_loop, name="phasescope-sidecar", daemon=True)
        self.thread.start()
        self._started.wait(10)
        if self._start_error is not None:
            raise self._start_error

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop accepting; let connections whose probe already closed deliver their last frames; end the loop."""
        self._stopping.set()
        if self._loop is None or self._loop.is_closed():
            return
        fut = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        try:
            fut.result(timeout_s)
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            log.warning("sidecar shutdown: %r", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self.thread is not None:
            self.thread.join(5)
        for a in self.bound:
            if a.kind == "unix":
                try:
                    os.unlink(a.path)
                except OSError:
                    pass

    def committed(self, items: list[Item]) -> None:
        """From the writer's thread: acknowledge `items` on the loop."""
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self.sessions.committed, items)
            except RuntimeError:
                pass

    def _run_loop(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        self._budget.bind(self._loop)
        self._partial.bind(self._loop)
        try:
            self._loop.run_until_complete(self._bind_all())
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._start_error = exc
            self._loop.close()
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()
        self._loop.close()

    async def _bind_all(self) -> None:
        for addr in self.addresses:
            if addr.kind == "unix":
                _prepare_unix_path(addr.path)
                old_umask = os.umask(0o177)  # socket file created 0600
                try:
                    server = await self._loop.create_unix_server(lambda: Reader(self._connected), path=addr.path,
                                                                    backlog=BACKLOG)
                finally:
                    os.umask(old_umask)
                os.chmod(addr.path, 0o600)
                self.bound.append(addr)
            else:
                server = await self._loop.create_server(lambda: Reader(self._connected), host=addr.path, backlog=BACKLOG,
                                                        port=addr.port)
                port = server.sockets[0].getsockname()[1]
                self.bound.append(Address("tcp", addr.path, port))
            self._servers.append(server)

    async def _shutdown(self, drain_s: float = 2.0) -> None:
        """Stop accepting; let connections whose probe already closed deliver their last frames."""
        for s in self._servers:
            s.close()
        deadline = time.monotonic() + drain_s
        while self._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _connected(self, reader: Reader, writer: Writer) -> asyncio.Task:
        assert self._loop is not None
        return self._loop.create_task(self._handle(reader, writer))

    async def _read(self, reader: Reader, n: int, deadline: float) -> bytes | bytearray:
        assert self._loop is not None
        left = deadline - self._loop.time()
        if left <= 0:
            raise _Timeout()
        try:
            return await reader.readexactly(n, deadline)
        except TimeoutError:
            raise _Timeout() from None

    def _admit(self, conn: Conn) -> bool:
        """A slot for every sender that completed its handshake (up to max_connections); connections that
        have not yet (or never will) have a small pool of their own, the oldest evicted when it is full,
        so a flood of idle, slow or half-sent connections cannot keep a real probe out."""
        st = self.stats
        if st.open_connections - len(self._unverified) >= self.limits.max_connections:
            st.connections_refused_total += 1
            st.closed("refused")
            log.info("refused a probe connection: %d connections (--max-connections)", self.limits.max_connections)
            return False
        while len(self._unverified) >= self.limits.max_unverified:
            oldest = next(iter(self._unverified))
            del self._unverified[oldest]
            oldest.evicted = True
            oldest.writer.transport.abort()
        self._unverified[conn] = None
        return True

    async def _handle(self, reader: Reader, writer: Writer) -> None:
        st = self.stats
        conn = Conn(writer)
        if not self._admit(conn):
            writer.close()
            return
        task = conn.task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        st.connections_total += 1
        st.open_connections += 1
        reason = "end"
        try:
            while await self._serve_frame(reader, conn):
                if conn.verified:
                    self._unverified.pop(conn, None)
            if conn.pending:  # the probe closed its side: let the writer commit and acknowledge the rest
                try:
                    await asyncio.wait_for(conn.drained.wait(), 10.0)
                except asyncio.TimeoutError:
                    pass
        except FrameError as exc:
            st.bad_frames_total += 1
            reason = "bad_frame"
            log.warning("rejected frame from a probe connection (closing it): %s", exc)
        except _Timeout as exc:
            st.timeouts_total += 1
            reason = exc.reason or ("timeout" if conn.verified else "handshake_timeout")
            log.info("closing a probe connection: read deadline passed (%s)", reason)
        except PermissionError as exc:
            st.auth_failures_total += 1
            reason = "auth"
            log.warning("refused a probe connection: %s", exc)
        except (ConnectionError, OSError) as exc:
            reason = "evicted" if conn.evicted else "lost"
            log.info("probe connection %s: %r", "evicted (pool of unverified connections full)"
                     if conn.evicted else "lost", exc)
        except asyncio.CancelledError:
            reason = "shutdown" if self._stopping.is_set() else "replaced"  # or its sender connected again
        except Exception as exc:  # noqa: BLE001 - a bug must cost one connection, never the sidecar
            st.bad_frames_total += 1
            reason = "error"
            log.error("closing a probe connection after an unexpected error: %r", exc, exc_info=True)
        finally:
            if conn.evicted:
                reason = "evicted"
            self._unverified.pop(conn, None)
            st.closed(reason)
            self.sessions.ended(conn)
            st.open_connections -= 1
            writer.close()
            self._tasks.discard(task)

    async def _serve_frame(self, reader: Reader, conn: Conn) -> bool:
        """Read one frame whole, under its deadline and the byte budgets, and hand it to the sessions;
        False at a clean end of stream."""
        loop = self._loop
        assert loop is not None
        verified = conn.verified
        try:
            first = await reader.readexactly(1, loop.time() + (self.limits.idle_timeout_s if verified
                                                               else self.limits.handshake_timeout_s))
        except Incomplete:
            return False  # clean end of stream
        except TimeoutError:
            raise _Timeout() from None
        deadline = loop.time() + (self.limits.frame_timeout_s if verified else self.limits.handshake_timeout_s)
        try:
            header = first + await self._read(reader, HEADER.size - 1, deadline)
        except Incomplete as exc:
            raise FrameError(f"connection closed inside a header ({1 + exc.received} bytes)")
        version, count, length = read_header(header)
        if not verified and length > FIRST_FRAME_BYTES:
            raise FrameError(f"a first frame of {length} bytes (at most {FIRST_FRAME_BYTES}: Session, "
                             "Hello, run labels)")
        # bytes of frames still arriving are capped over all verified connections (half-sent frames
        # cost at most `partial_budget_bytes`; a first frame is small and its pool bounded); a whole
        # frame then waits for room in the memory budget
        part = length if verified else 0
        try:  # the frame's deadline covers the wait for room too: a crowd of half-sent frames ends
            await asyncio.wait_for(self._partial.take(part), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            raise _Timeout("partial_budget") from None  # refused: no room for it before its deadline
        try:
            payload = await self._read(reader, length, deadline)
            await self._budget.take(length)
        except Incomplete as exc:
            raise FrameError(f"connection closed inside a payload ({exc.received} of {length} bytes)")
        finally:
            self._partial.give(part)
        try:
            self.stats.frames_total += 1
            queued = await self.sessions.frame(conn, version, count, payload)
        except BaseException:
            self._budget.give(length)
            raise
        if not queued:
            self._budget.give(length)
        return True


def _prepare_unix_path(path: str) -> None:
    """Create the socket's folder (0700, ours), refuse a folder another user owns or can write,
    remove a stale socket, and refuse a live one."""
    folder = os.path.dirname(path) or "."
    make_private_folder(folder)
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: nobody listens
        else:
            raise OSError(f"another sidecar is already listening on {path}")
        finally:
            probe.close()
