"""GPU step timing with pre-created CUDA events, completed off the host thread.

The host thread only records events on the current stream (and, for exact token
counts, queues a tiny reduction and an asynchronous copy into pinned memory);
a poller thread asks `Event.query()` and reads the elapsed time once the end
event has completed. Nothing here ever synchronizes the device.
"""

from __future__ import annotations

import collections
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
    """A fixed pool of timing slots; when empty the step goes untimed (counted)."""

    def __init__(self, device: torch.device, size: int = 256) -> None:
        if size < 1:
            raise ValueError("event pool size must be >= 1")
        self.device = device
        with torch.cuda.device(device):
            self._free: collections.deque[TimingSlot] = collections.deque(
                TimingSlot(device) for _ in range(size)
            )
        self.size = size

    def take(self) -> TimingSlot | None:
        try:
            return self._free.popleft()
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
