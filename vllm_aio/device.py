"""The device the KV cache lives on, behind one small interface.

The connector runs unchanged on CUDA GPUs, Ascend NPUs (torch_npu registers
itself as torch's accelerator) and the CPU. Everything device-specific goes
through torch's generic accelerator API (``torch.Stream``, ``torch.Event``,
``torch.accelerator``); on the CPU the KV cache is host memory, copies are
synchronous and streams and events collapse to nothing.

Transfers run on a side stream so they overlap the forward on the compute
stream; an ``Event`` recorded after a copy is what the compute stream (or a
transfer thread) waits on. Host buffers are page-locked on accelerators:
pageable host-to-device copies ran at 6.5 GB/s on an H200 against 55 GB/s
pinned.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Device:
    def __init__(self, device: torch.device) -> None:
        self.torch_device = device
        self.is_host = device.type == "cpu"

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "Device":
        return cls(tensor.device)

    def new_stream(self) -> torch.Stream | None:
        return None if self.is_host else torch.Stream(device=self.torch_device)

    @contextmanager
    def on(self, stream: torch.Stream | None) -> Iterator[None]:
        """Enqueue the block's device work on ``stream`` (the current stream if None)."""
        if stream is None:
            yield
            return
        previous = torch.accelerator.current_stream(self.torch_device)
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)

    def record(self, stream: torch.Stream | None = None) -> torch.Event | None:
        """An event marking the work enqueued so far on ``stream`` (default: current)."""
        if self.is_host:
            return None
        event = torch.Event(device=self.torch_device)
        event.record(stream or torch.accelerator.current_stream(self.torch_device))
        return event

    def wait(self, event: torch.Event | None, stream: torch.Stream | None = None) -> None:
        """Make ``stream`` (default: current) wait for ``event`` without blocking the host."""
        if event is not None:
            (stream or torch.accelerator.current_stream(self.torch_device)).wait_event(event)

    @staticmethod
    def synchronize(event: torch.Event | None) -> None:
        """Block the calling host thread until ``event`` has completed."""
        if event is not None:
            event.synchronize()

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer the device copies from and to at full speed."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=not self.is_host)

    def empty(self, nbytes: int) -> torch.Tensor:
        """Device scratch bytes."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)
