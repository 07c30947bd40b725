"""GPU step timing with pre-created CUDA events, completed off the host thread.

The host thread only records events on the current stream (and, for exact token
counts, queues a tiny reduction and an asynchronous copy into pinned memory);
the probe's background wake (outbox.py) asks `Event.query()` and reads the elapsed time once the end
event has completed. Nothing here ever synchronizes the device.

CUDA-graph capture. While a stream captures, recording a timing event or
launching a readback on it invalidates the capture, and in the default ("global")
capture mode so does an `Event.query()` from ANY thread. So:
- the hooks check `torch.cuda.is_current_stream_capturing()` before every CUDA
  call they make (exact for any capture, whoever started it);
- the poller only queries under `CaptureGuard.lock`, and only while no capture
  is open. The guard wraps `torch.cuda.CUDAGraph.capture_begin`/`capture_end`
  (every torch capture goes through them: `torch.cuda.graph`, vLLM's capture,
  `torch.compile(mode="reduce-overhead")`): `capture_begin` takes the lock (so
  it waits for a poll in progress, microseconds) and raises `depth` before the
  capture starts; `capture_end` lowers it after the capture ended. Installed by
  the first probe that times on CUDA, removed when the last one closes.
  A capture started outside torch (a C++ extension calling
  cudaStreamBeginCapture directly) is still safe in the hooks, but not from the
  poller's queries in global mode: such runtimes should use
  `capture_error_mode="thread_local"` or close the probe around capture.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch

# ints per pinned readback slot: enough for cu_seq_lens_q and _k of 511 sequences
READBACK_INTS = 1024


class TimingSlot:
    """One reusable (start, end) event pair with a pinned readback buffer."""

    __slots__ = ("start", "end", "readback", "n_read")

    def __init__(self, device: torch.device) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.readback = torch.zeros(READBACK_INTS, dtype=torch.int64, pin_memory=True)
        self.n_read = 0


class EventPool:
    """A fixed pool of timing slots; when empty the step goes untimed (counted).

    Last in, first out: the few slots in flight are reused while hot. torch creates a
    CUDA event lazily at its first record, which costs tens of us; the pool records
    each event once here (not while a capture is open), so no step pays for it.
    """

    def __init__(self, device: torch.device, size: int = 256) -> None:
        if size < 1:
            raise ValueError("event pool size must be >= 1")
        self.device = device
        with torch.cuda.device(device):
            self._free: collections.deque[TimingSlot] = collections.deque(
                TimingSlot(device) for _ in range(size)
            )
            if not (GUARD.depth or torch.cuda.is_current_stream_capturing()):
                for slot in self._free:
                    slot.start.record()
                    slot.end.record()
        self.size = size

    def take(self) -> TimingSlot | None:
        try:
            return self._free.pop()
        except IndexError:
            return None

    def give(self, slot: TimingSlot) -> None:
        self._free.append(slot)


def stream_of(device: torch.device) -> Any:
    """The host's current stream on `device` (events are recorded there)."""
    return torch.cuda.current_stream(device)


def queue_readback(slot: TimingSlot, values: list[torch.Tensor]) -> bool:
    """Copy small int device tensors into the slot's pinned buffer, asynchronously.

    Returns False (and queues nothing) when they do not fit.
    """
    n = sum(int(v.numel()) for v in values)
    if n > READBACK_INTS:
        slot.n_read = 0
        return False
    pos = 0
    for v in values:
        k = int(v.numel())
        slot.readback[pos : pos + k].copy_(v.reshape(-1), non_blocking=True)
        pos += k
    slot.n_read = n
    return True


class CaptureGuard:
    """Knows whether a torch CUDA-graph capture is open in this process (see the module doc).

    Process-wide by nature (capture state is the CUDA context's), so there is one
    instance, `GUARD`; probes `acquire()` it at attach and `release()` it at close.
    """

    def __init__(self, target: Any = None) -> None:
        self._target = target  # the class to wrap; None: torch.cuda.CUDAGraph (tests pass a fake)
        self.lock = threading.Lock()  # held by a poller while it queries events; capture_begin waits on it
        self.depth = 0  # captures open now (read without the lock on the hot path: an int read)
        self.captures = 0  # captures begun since installed
        self._users = 0
        self._orig: tuple | None = None
        self._users_lock = threading.Lock()

    def acquire(self) -> None:
        """Install the wrappers (first user) and count one more user."""
        with self._users_lock:
            self._users += 1
            if self._users > 1:
                return
            cls = self._target if self._target is not None else torch.cuda.CUDAGraph
            begin, end = cls.capture_begin, cls.capture_end
            guard = self

            def capture_begin(graph: Any, *args: Any, **kwargs: Any) -> Any:
                with guard.lock:  # no poller is between query() calls from here on
                    guard.depth += 1
                    guard.captures += 1
                try:
                    return begin(graph, *args, **kwargs)
                except BaseException:
                    guard.depth -= 1
                    raise

            def capture_end(graph: Any, *args: Any, **kwargs: Any) -> Any:
                try:
                    return end(graph, *args, **kwargs)
                finally:
                    guard.depth -= 1

            capture_begin.__wrapped__ = begin  # type: ignore[attr-defined]
            capture_end.__wrapped__ = end  # type: ignore[attr-defined]
            cls.capture_begin, cls.capture_end = capture_begin, capture_end
            self._orig = (cls, begin, end, capture_begin, capture_end)

    def release(self) -> None:
        """Count one user less; the last one puts torch's methods back (if still ours)."""
        with self._users_lock:
            if self._users == 0:
                return
            self._users -= 1
            if self._users or self._orig is None:
                return
            cls, begin, end, mine_begin, mine_end = self._orig
            self._orig = None
            if cls.__dict__.get("capture_begin") is mine_begin:
                cls.capture_begin = begin
            if cls.__dict__.get("capture_end") is mine_end:
                cls.capture_end = end

    @property
    def installed(self) -> bool:
        return self._orig is not None


GUARD = CaptureGuard()


def capturing() -> bool:
    """Whether the current stream captures now (any capture, torch's or not). Host-only, ~1 us."""
    return bool(GUARD.depth) or torch.cuda.is_current_stream_capturing()
