"""A fixed host buffer lent out in slices, for bytes in flight.

Saved blocks are copied here out of the KV cache (the cache blocks can then be
freed or reused while the pool put runs in the background), and on an
accelerator loaded blocks pass through here on their way to the device. The
buffer is allocated once, page-locked on accelerators and registered with the
backend once, because registering memory per transfer (Mooncake, RDMA) costs
more than the copy.

Slices are handed out ring-wise: transfers finish roughly in the order they
started, so a slice freed out of order only waits for the older ones ahead of
it. When the ring is full, ``allocate`` waits (bounded) for a release: a slow
pool slows saves down instead of growing memory without limit. ``InFlight``
hands slices back when the device copies using them complete.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from vllm_aio.device import Device


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
    def __init__(self, device: Device, nbytes: int) -> None:
        self.buffer = device.host_buffer(nbytes)
        self.capacity = nbytes
        self._live: deque[Slice] = deque()  # oldest first; guarded by _cond
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
        with self._cond:
            while (start := self._fit(nbytes)) is None:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    if (start := self._fit(nbytes)) is None:
                        return None
                    break
            piece = Slice(start, start + nbytes, self.buffer[start : start + nbytes])
            self._live.append(piece)
            self._head = piece.end
            return piece

    def release(self, piece: Slice) -> None:
        with self._cond:
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


class InFlight:
    """Slices of one staging buffer that device copies still read or fill.

    A slice goes back to the buffer once its copy's event has completed, so
    the thread that queued the copy never waits for it unless it needs the
    space: then it waits for the oldest copy only.
    """

    def __init__(self, staging: StagingBuffer, device: Device) -> None:
        self.staging = staging
        self._device = device
        self._slices: deque[tuple[Slice, torch.Event | None]] = deque()  # oldest first
        self._lock = threading.Lock()

    def allocate(self, nbytes: int, timeout: float) -> Slice | None:
        while True:
            with self._lock:
                while self._slices and _completed(self._slices[0][1]):
                    self.staging.release(self._slices.popleft()[0])
                oldest = self._slices[0][1] if self._slices else None
            if (piece := self.staging.allocate(nbytes, 0)) is not None:
                return piece
            if oldest is None:  # nothing of ours to wait for: others hold the space
                return self.staging.allocate(nbytes, timeout)
            self._device.synchronize(oldest)

    def hold(self, piece: Slice, event: torch.Event | None) -> None:
        """Release ``piece`` once ``event`` (None: now) has completed."""
        if event is None:
            self.staging.release(piece)
            return
        with self._lock:
            self._slices.append((piece, event))


def _completed(event: torch.Event | None) -> bool:
    return event is None or event.query()
