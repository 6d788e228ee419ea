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

Two ways to get page-locked host memory: ``host_buffer`` (torch's
``pin_memory``, for staging rings of a few GiB) and ``host_memory`` (exactly
the bytes asked for, for large long-lived buffers such as the dynamic
buffer's host copy of every layer: torch's caching host allocator rounds each
``pin_memory`` allocation up to a power of two, and an 8.25 GiB host copy
became 16 GiB, 6.7 s to allocate, on an H200 host).
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from vllm_aio.log import get_logger

logger = get_logger(__name__)


class Device:
    def __init__(self, device: torch.device) -> None:
        self.torch_device = device
        self.is_host = device.type == "cpu"

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
    def completed(event: torch.Event | None) -> bool:
        """Whether ``event`` has completed, without waiting (None: nothing to wait for)."""
        return event is None or event.query()

    @staticmethod
    def synchronize(event: torch.Event | None) -> None:
        """Block the calling host thread until ``event`` has completed."""
        if event is not None:
            event.synchronize()

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host byte buffer the device copies from and to at full speed."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=not self.is_host)

    def host_memory(self, nbytes: int) -> "HostMemory":
        """``nbytes`` of host memory the device copies at full speed, not rounded up.

        CUDA: plain host memory registered with the driver (``cudaHostRegister``),
        unregistered by ``HostMemory.release``; other accelerators (Ascend NPU, ...):
        ``pin_memory``, rounded by torch's host allocator; the CPU: plain memory.
        """
        if self.is_host or nbytes == 0:
            return HostMemory(torch.empty(nbytes, dtype=torch.uint8))
        if self.torch_device.type == "cuda":
            pages = _whole_pages(nbytes)
            return HostMemory(pages[:nbytes], _register_cuda(pages, self.torch_device))
        return HostMemory(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))

    def empty(self, nbytes: int) -> torch.Tensor:
        """Device scratch bytes."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.torch_device)


class HostMemory:
    """Host bytes from ``Device.host_memory``: ``tensor`` (uint8), valid until ``release``.

    Registered memory must be unregistered before it is freed (the driver
    would keep the stale registration, and a later allocation at the same
    address could not be registered). ``release`` does that once, after the
    device has finished every copy (unregistering pages a copy still uses is
    undefined); garbage collection does it too, so a forgotten release leaks
    nothing. Views of ``tensor`` taken earlier stay valid after ``release``
    (the memory is freed with the last of them), only no longer page-locked.
    torch's ``is_pinned()`` says False for registered memory (torch 2.11 on
    an H200), yet copies from it ran asynchronously at 52 GB/s.
    """

    def __init__(self, tensor: torch.Tensor, unregister: Callable[[], None] | None = None) -> None:
        self.tensor: torch.Tensor | None = tensor
        self._finalizer = weakref.finalize(self, _unregister, tensor, unregister) if unregister else None
        if self._finalizer is not None:
            self._finalizer.atexit = False  # at exit the process's memory goes anyway, the driver may not

    @property
    def registered(self) -> bool:
        """Whether the memory is registered with the driver and not yet released."""
        return self._finalizer is not None and self._finalizer.alive

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs at most once
        self.tensor = None


def _unregister(tensor: torch.Tensor, unregister: Callable[[], None]) -> None:
    # ``tensor`` is an argument so the memory outlives its registration.
    try:
        unregister()
    except Exception as exc:  # a finalizer must not raise; the process goes on
        logger.warning("vllm_aio: unregistering %d bytes of host memory failed: %s", tensor.nbytes, exc)


def _whole_pages(nbytes: int) -> torch.Tensor:
    """At least ``nbytes`` of host memory, page-aligned, in whole pages of one allocation.

    The driver page-locks whole pages: a buffer sharing a page with another
    allocation (small ones come from the heap) could not be registered if that
    one were registered too (cudaErrorHostMemoryAlreadyRegistered).
    """
    page = mmap.PAGESIZE
    backing = torch.empty(nbytes + 2 * page, dtype=torch.uint8)
    start = -backing.data_ptr() % page
    return backing[start : start + -(-nbytes // page) * page]


def _register_cuda(tensor: torch.Tensor, device: torch.device) -> Callable[[], None]:
    """Page-locks ``tensor``'s memory for ``device``; returns what unregisters it."""
    cudart = torch.cuda.cudart()
    address, nbytes = tensor.data_ptr(), tensor.nbytes
    with torch.cuda.device(device):
        error = cudart.cudaHostRegister(address, nbytes, 0)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed: {error}")

    def unregister() -> None:
        torch.cuda.synchronize(device)  # no copy may still use the pages
        error = cudart.cudaHostUnregister(address)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostUnregister failed: {error}")

    return unregister
