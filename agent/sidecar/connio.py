"""A probe connection's byte stream for the sidecar's loop: the kernel copies each payload straight into
its own buffer (asyncio BufferedProtocol), once.

asyncio's StreamReader receives into a new bytes object per read, appends it to a
bytearray and slices frames back out: three copies of every byte (and a fresh
allocation per read). Here a read of n bytes that is not already buffered hands
the transport a view of the frame's own bytearray, so `recv_into` writes the
payload where the decoder reads it. Bytes that arrive while no read waits go to a
small look-ahead buffer; when it is full, reading pauses (the socket buffer fills
and the sender waits: backpressure, as with StreamReader's limit).

Memory is taken as bytes arrive, never from a header's claim: a connection holds no
buffer until its first bytes come, the look-ahead starts at 1 KiB and grows x4 to
64 KiB, and a frame's buffer starts at what arrived (1 KiB at least) and grows x4
toward the length read waits for (a frame that arrives whole is copied ~1/3 more
in those steps). A peer that announces 1 MiB and sends 10 bytes holds ~1 KiB.
"""

from __future__ import annotations

import asyncio
from typing import Callable

LOOKAHEAD_BYTES = 64 << 10  # bytes read ahead while no read waits (per connection), at most
FIRST_BUFFER_BYTES = 1 << 10  # a buffer's first size: each grows (x4) as bytes arrive, never from a header's claim


class Incomplete(asyncio.IncompleteReadError):
    """End of stream inside a read: `received` of `expected` bytes arrived (dropped, never copied)."""

    def __init__(self, received: int, expected: int) -> None:
        super().__init__(b"", expected)
        self.received = received

    def __str__(self) -> str:
        return f"{self.received} bytes read on a total of {self.expected} expected bytes"


class Writer:
    """The sending side of a connection (what the sidecar uses of a StreamWriter)."""

    __slots__ = ("transport",)

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self.transport = transport

    def write(self, data: bytes) -> None:
        self.transport.write(data)

    def close(self) -> None:
        self.transport.close()


class Reader(asyncio.BufferedProtocol):
    """Protocol + reader of one connection; `on_connect(reader, writer)` starts its handler."""

    def __init__(self, on_connect: Callable[["Reader", Writer], object]) -> None:
        self._on_connect = on_connect
        self._buf = bytearray()  # taken when the first bytes arrive, grown as more do (up to LOOKAHEAD_BYTES)
        self._start = self._end = 0  # look-ahead bytes not yet read: _buf[_start:_end]
        self._target: bytearray | None = None  # the buffer a waiting read fills, grown as its bytes arrive
        self._fill = 0
        self._want = 0  # the bytes that read waits for (len(_target) reaches it only as they arrive)
        self._waiter: asyncio.Future | None = None
        self._eof = False
        self._exc: BaseException | None = None
        self._paused = False
        self.transport: asyncio.Transport | None = None
        self.task: object = None

    # --- protocol (called by the transport) ---------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.task = self._on_connect(self, Writer(transport))  # type: ignore[arg-type]

    def get_buffer(self, sizehint: int) -> memoryview:
        target = self._target
        if target is not None:  # a read waits and the look-ahead is empty: fill the frame itself
            if self._fill == len(target):  # what arrived filled it: grow toward what the read waits for
                target.extend(bytes(min(self._want, 4 * len(target)) - len(target)))
            return memoryview(target)[self._fill:]
        if self._end == len(self._buf):
            if self._start:
                n = self._end - self._start
                self._buf[:n] = self._buf[self._start:self._end]
                self._start, self._end = 0, n
            if self._end == len(self._buf):  # full: grow x4 up to LOOKAHEAD_BYTES (past it only when the
                # transport asks once more before its pause takes effect: grow rather than fail)
                size = len(self._buf)
                if size < LOOKAHEAD_BYTES:
                    grow = max(FIRST_BUFFER_BYTES, min(LOOKAHEAD_BYTES, 4 * size)) - size
                else:
                    grow = size
                self._buf.extend(bytes(grow))
        return memoryview(self._buf)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is not None:
            self._fill += nbytes
            if self._fill == self._want:
                self._wake(None)
            return
        self._end += nbytes
        if self._end >= LOOKAHEAD_BYTES and self._end == len(self._buf) and not self._paused \
                and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake(self._incomplete())
        return True  # keep the sending side open: acknowledgements still go out

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self._exc = exc
        self._eof = True
        self._wake(exc or self._incomplete())
        # asyncio's selector transport keeps its read callback as a bound method of itself (CPython 3.11-3.13):
        # a transport <-> method cycle, with the socket objects and a dict in it, that only the cyclic collector
        # frees (~1 KiB a closed connection). Its reader is off the selector by now: the callback is never called.
        t = self.transport
        if t is not None and "_read_ready_cb" in getattr(t, "__dict__", ()):
            t._read_ready_cb = None

    # --- reading (called by the handler) --------------------------------------

    async def readexactly(self, n: int, deadline: float | None = None) -> bytes | bytearray:
        """The next `n` bytes; raises IncompleteReadError at end of stream, TimeoutError past `deadline` (the
        loop's clock), or the connection's error. The deadline is a timer on this read, not `asyncio.wait_for`:
        wait_for's inner task, holding the exception whose traceback holds wait_for's frame holding that task,
        made a cycle of every failed read (a closed or timed-out connection) that only the collector freed."""
        if self._exc is not None:
            raise self._exc
        have = self._end - self._start
        if have >= n:
            out = bytes(self._buf[self._start:self._start + n])
            self._start += n
            if self._start == self._end:
                self._start = self._end = 0
            return out
        if self._eof:  # before allocating: a lost connection's frame costs nothing
            self._start = self._end = 0
            raise Incomplete(have, n)
        # sized by what arrived (and a first step), not by `n`: a header's claim takes no memory until its bytes come
        target = bytearray(min(n, max(have, FIRST_BUFFER_BYTES)))
        if have:
            target[:have] = self._buf[self._start:self._end]
        self._start = self._end = 0
        self._target, self._fill, self._want = target, have, n
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        timer = loop.call_at(deadline, self._time_out) if deadline is not None else None
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        try:
            await self._waiter
        except BaseException:
            # a failed read (deadline, end of stream, lost connection) lets go of its buffer now: the
            # exception's traceback keeps this frame, and with it `target` (up to a whole frame), alive in
            # a reference cycle until the cyclic collector runs; a crowd of timed-out half-sent frames
            # held ~100 MiB past the partial-frame budget that way (2026-12-03)
            target = None
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self._target, self._waiter = None, None
        return target

    def _time_out(self) -> None:
        self._wake(TimeoutError())

    def _incomplete(self) -> BaseException | None:
        if self._target is None:
            return None
        return Incomplete(self._fill, self._want)

    def _wake(self, exc: BaseException | None) -> None:
        w = self._waiter
        if w is None or w.done():
            return
        self._target = None  # nothing more goes into it
        if exc is None:
            w.set_result(None)
        else:
            w.set_exception(exc)
