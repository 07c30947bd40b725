"""A probe connection's byte stream for the sidecar's loop: the kernel copies each payload straight into
its own buffer (asyncio BufferedProtocol), once.

asyncio's StreamReader receives into a new bytes object per read, appends it to a
bytearray and slices frames back out: three copies of every byte (and a fresh
allocation per read). Here a read of n bytes that is not already buffered hands
the transport a view of the frame's own bytearray, so `recv_into` writes the
payload where the decoder reads it. Bytes that arrive while no read waits go to a
small look-ahead buffer; when it is full, reading pauses (the socket buffer fills
and the sender waits: backpressure, as with StreamReader's limit).
"""

from __future__ import annotations

import asyncio
from typing import Callable

LOOKAHEAD_BYTES = 64 << 10  # bytes read ahead while no read waits (per connection)


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
        self._buf = bytearray(LOOKAHEAD_BYTES)
        self._start = self._end = 0  # look-ahead bytes not yet read: _buf[_start:_end]
        self._target: bytearray | None = None  # the buffer a waiting read fills
        self._fill = 0
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
        if self._target is not None:  # a read waits and the look-ahead is empty: fill the frame itself
            return memoryview(self._target)[self._fill:]
        if self._end == len(self._buf):
            if self._start:
                n = self._end - self._start
                self._buf[:n] = self._buf[self._start:self._end]
                self._start, self._end = 0, n
            else:  # full and not paused yet (the transport asks once more): grow rather than fail
                self._buf.extend(bytes(len(self._buf)))
        return memoryview(self._buf)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is not None:
            self._fill += nbytes
            if self._fill == len(self._target):
                self._wake(None)
            return
        self._end += nbytes
        if self._end == len(self._buf) and not self._paused and self.transport is not None:
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

    # --- reading (called by the handler) --------------------------------------

    async def readexactly(self, n: int) -> bytes | bytearray:
        """The next `n` bytes; raises IncompleteReadError at end of stream, or the connection's error."""
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
        target = bytearray(n)
        if have:
            target[:have] = self._buf[self._start:self._end]
        self._start = self._end = 0
        self._target, self._fill = target, have
        self._waiter = asyncio.get_running_loop().create_future()
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
            self._target, self._waiter = None, None
        return target

    def _incomplete(self) -> BaseException | None:
        if self._target is None:
            return None
        return Incomplete(self._fill, len(self._target))

    def _wake(self, exc: BaseException | None) -> None:
        w = self._waiter
        if w is None or w.done():
            return
        self._target = None  # nothing more goes into it
        if exc is None:
            w.set_result(None)
        else:
            w.set_exception(exc)
