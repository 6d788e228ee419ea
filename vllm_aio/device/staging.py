"""A fixed host buffer lent out in slices, for bytes in flight.

Saved blocks are copied here out of the KV cache (the cache blocks can then be
freed or reused while the pool put runs in the background), and on an
accelerator loaded blocks pass through here on their way to the device. The
buffer is allocated once, page-locked on accelerators and registered with the
backend once, because registering memory per transfer (Mooncake, RDMA) costs
more than the copy.

Slices are handed out ring-wise: transfers finish roughly in the order they
started, so a slice freed out of order only waits for the older ones ahead of
it. When the ring is full, ``allocate`` waits (bounded) for a release, or not
at all where the caller says so: a save whose staging only earlier saves' puts
hold is dropped (``connector/worker/block_io/staging_save.py``), so a slow pool
neither grows memory without limit nor slows the forward down. A slice still
read or filled by a device copy is released *after* that copy's event: it
returns to the ring once the event has completed, and an allocation that finds
no room waits for the oldest such copy rather than for a timeout.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from vllm_aio.device.accelerator import Device


@dataclass(eq=False)
class Slice:
    start: int
    end: int
    tensor: torch.Tensor  # uint8 view of [start, end)
    released: bool = field(default=False)

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()


class StagingBuffer:
    """``on_device``: the buffer is device memory instead (a backend that moves device memory
    itself reads and writes it there: ``connector/worker/block_io/in_place.py``)."""

    def __init__(self, device: Device, nbytes: int, on_device: bool = False) -> None:
        self.buffer = device.empty(nbytes) if on_device else device.host_buffer(nbytes)
        self.capacity = nbytes
        self._device = device
        self._live: deque[Slice] = deque()  # oldest first; guarded by _cond
        self._after: deque[tuple[Slice, torch.Event]] = deque()  # released once the event completes
        self._head = 0  # where the next slice starts
        self._cond = threading.Condition()

    @property
    def address(self) -> int:
        return self.buffer.data_ptr()

    def allocate(self, nbytes: int, timeout: float) -> Slice | None:
        """A slice of ``nbytes``, or None if none frees up within ``timeout`` s."""
        if nbytes > self.capacity:
            return None
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                self._release_completed()
                if (start := self._fit(nbytes)) is not None:
                    piece = Slice(start, start + nbytes, self.buffer[start : start + nbytes])
                    self._live.append(piece)
                    self._head = piece.end
                    return piece
                oldest = self._after[0][1] if self._after else None
                if oldest is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self._cond.wait(left)
                    continue
            self._device.synchronize(oldest)  # outside the lock: copies finish on their own

    def release(self, piece: Slice, after: torch.Event | None = None) -> None:
        """Give ``piece`` back, at once or once the copy behind ``after`` has completed."""
        with self._cond:
            if after is not None:
                self._after.append((piece, after))
                return
            self._free(piece)

    def _release_completed(self) -> None:
        while self._after and Device.completed(self._after[0][1]):
            self._free(self._after.popleft()[0])

    def _free(self, piece: Slice) -> None:
        piece.released = True
        while self._live and self._live[0].released:
            self._live.popleft()
        if not self._live:
            self._head = 0
        self._cond.notify_all()

    def _fit(self, nbytes: int) -> int | None:
        if not self._live:
            return 0
        tail = self._live[0].start  # oldest byte still in use
        if self._head > tail:  # free: [head, capacity) and [0, tail)
            if self._head + nbytes <= self.capacity:
                return self._head
            return 0 if nbytes <= tail else None
        return self._head if self._head + nbytes <= tail else None  # free: [head, tail)


def even_ranges(n: int, max_rows: int) -> list[tuple[int, int]]:
    """[start, end) ranges covering ``n`` rows in as few pieces of at most ``max_rows`` as possible,
    their sizes differing by at most one (a batch moved through staging piece by piece)."""
    if n <= 0:
        return []
    count = -(-n // max(1, max_rows))
    base, extra = divmod(n, count)
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + base + (i < extra))
    return list(zip(bounds, bounds[1:]))
