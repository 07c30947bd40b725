"""The sidecar's connection reader: a read that cannot complete costs no frame buffer.

A crowd of half-sent frames must stay inside the partial-frame budget: a read on a lost connection
allocates nothing, and a read that fails (deadline, end of stream) lets go of its buffer at once, not
when the cyclic collector next runs (the cycle collector is off in these tests to make that sharp).
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc

import pytest

from phasescope.agent.sidecar.connio import Incomplete, Reader

FRAME = 1 << 20  # bytes: the largest frame payload (events.MAX_FRAME_BYTES)


class _Transport:
    """What Reader uses of an asyncio transport."""

    def __init__(self) -> None:
        self.paused = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def _reader() -> Reader:
    r = Reader(lambda reader, writer: None)
    r.connection_made(_Transport())  # type: ignore[arg-type]
    return r


def _feed(r: Reader, data: bytes) -> None:
    view = r.get_buffer(len(data))
    view[:len(data)] = data
    r.buffer_updated(len(data))


@pytest.fixture
def no_cycle_collector():
    was = gc.isenabled()
    gc.disable()
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()
        if was:
            gc.enable()


def test_a_read_on_a_lost_connection_allocates_no_frame_buffer(no_cycle_collector):
    r = _reader()
    _feed(r, b"\x01" * 10)
    r.connection_lost(None)
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    with pytest.raises(Incomplete) as exc:
        asyncio.run(r.readexactly(FRAME))
    assert (exc.value.received, exc.value.expected) == (10, FRAME)
    assert str(exc.value) == f"10 bytes read on a total of {FRAME} expected bytes"  # what arrived, not 0
    assert tracemalloc.get_traced_memory()[1] - before < FRAME // 4  # no 1 MiB buffer, not even for a moment


@pytest.mark.parametrize("ending", ["deadline", "end of stream", "lost"])
def test_a_failed_read_lets_go_of_its_buffer_at_once(no_cycle_collector, ending):
    r = _reader()

    async def read() -> None:
        task = asyncio.ensure_future(asyncio.wait_for(r.readexactly(FRAME), 0.05 if ending == "deadline" else 5))
        await asyncio.sleep(0.01)
        _feed(r, b"\x02" * 1000)  # goes straight into the waiting read's buffer
        if ending == "end of stream":
            r.eof_received()
        elif ending == "lost":
            r.connection_lost(ConnectionResetError())
        await task

    before = tracemalloc.get_traced_memory()[0]
    expected = {"deadline": asyncio.TimeoutError, "end of stream": Incomplete, "lost": ConnectionResetError}[ending]
    with pytest.raises(expected) as exc:
        asyncio.run(read())
    if ending == "end of stream":
        assert (exc.value.received, exc.value.expected) == (1000, FRAME)
    del exc  # the test's own hold on the traceback
    assert tracemalloc.get_traced_memory()[0] - before < FRAME // 4  # the frame's buffer is gone


def test_a_whole_read_keeps_its_bytes_and_a_later_read_sees_the_rest():
    r = _reader()

    async def read() -> tuple[bytes, bytes]:
        task = asyncio.ensure_future(r.readexactly(5))
        await asyncio.sleep(0)
        _feed(r, b"abcde")
        first = await task
        _feed(r, b"fgh")
        return bytes(first), bytes(await r.readexactly(3))

    assert asyncio.run(read()) == (b"abcde", b"fgh")
