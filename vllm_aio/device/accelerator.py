"""The device the KV cache lives on, behind one small interface.

The connector runs unchanged on CUDA GPUs, Ascend NPUs (torch_npu registers
itself as torch's accelerator) and the CPU. Everything device-specific goes
through torch's generic accelerator API (``torch.Stream``, ``torch.Event``,
``torch.accelerator``); on the CPU the KV cache is host memory, copies are
synchronous and streams and events collapse to nothing.

Transfers run on a side stream so they overlap the forward on the compute
stream; an ``Event`` recorded after a copy is what the compute stream (or a
transfer thread) waits on. Host buffers are page-locked on accelerators:
pageable host-to-device copies run at a fraction of a pinned copy's speed.

Two ways to get page-locked host memory: ``host_buffer`` (torch's
``pin_memory``, for staging rings of a few GiB) and ``host_memory`` (exactly
the bytes asked for, for large long-lived buffers such as the dynamic
buffer's host copy of every layer: torch's caching host allocator rounds each
``pin_memory`` allocation up to a power of two, which nearly doubles a large
host copy and the time to allocate it).

``map_host`` goes further where the device allows it: it maps existing host
memory (the embedded pool's ``/dev/shm`` slots) into the device's address
space, so kernels read and write it directly and a batch of scattered slots
moves in one gather or scatter kernel, with no host memcpy and no staging,
close to the speed of one large pinned copy (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from vllm_aio.device import link_copy
from vllm_aio.device.mapped_host import MappedHost, shared_mapping, unregister_quietly
from vllm_aio.device.plane_copy import PlaneCopies
from vllm_aio.log import get_logger

logger = get_logger(__name__)

# Row copies of at most this many rows use torch's index kernels on CUDA too (``Device.copy_rows``).
LINK_COPY_MIN_ROWS = 16


# The accelerator device each thread last made current through ``Device.bind_thread``.
_thread_device = threading.local()


class Device:
    def __init__(self, device: torch.device) -> None:
        self.torch_device = device
        self.is_host = device.type == "cpu"

    def bind_thread(self) -> None:
        """Make this device the calling thread's current device (once per thread; no-op on the CPU).

        A thread starts on device 0: on CUDA, and on Ascend, whose runtime
        keeps the current device per thread. A transfer thread of the worker
        on device 1 would otherwise make its streams, events and copies on
        device 0 (or, on an NPU, fail for want of that device's context).
        Called wherever a thread of ours starts device work (``BlockIO``'s
        loads and saves, the put thread). A device without an index names
        none to bind to.
        """
        if self.is_host or self.torch_device.index is None:
            return
        if getattr(_thread_device, "device", None) != self.torch_device:
            torch.accelerator.set_device_index(self.torch_device.index)
            _thread_device.device = self.torch_device

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
        event.record(stream)  # None: the device's current stream (looked up in C++, per layer this counts)
        return event

    def wait(self, event: torch.Event | None, stream: torch.Stream | None = None) -> None:
        """Make ``stream`` (default: current) wait for ``event`` without blocking the host."""
        if event is not None:
            event.wait(stream)

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

        CUDA: plain host memory registered with the driver (page-locked and
        mapped: ``HostMemory.device_view``), unregistered by ``HostMemory.release``; other accelerators (Ascend NPU, ...):
        ``pin_memory``, rounded by torch's host allocator; the CPU: plain memory.
        """
        if self.is_host or nbytes == 0:
            return HostMemory(torch.empty(nbytes, dtype=torch.uint8))
        if self.torch_device.type == "cuda":
            pages = _whole_pages(nbytes)
            return HostMemory(pages[:nbytes], _register_cuda(pages, self.torch_device), self.torch_device)
        return HostMemory(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))

    def map_host(self, address: int, nbytes: int) -> "MappedHost | None":
        """``nbytes`` of host memory at ``address`` as a uint8 tensor the device's kernels use in place.

        CUDA: the pages are registered once (mapped, portable) and viewed
        through their device address (unified addressing); ``release``
        unregisters them. Ascend NPU: registered mapped with the runtime
        (``npu_host_map.py``) and wrapped as an NPU tensor at its device address.
        The CPU: the memory itself. None where the device cannot map host
        memory (callers stage through page-locked buffers).
        """
        if self.is_host:
            return MappedHost(host_tensor(address, nbytes))
        if self.torch_device.type == "cuda" and nbytes:
            return _map_cuda(address, nbytes, self.torch_device)
        if self.torch_device.type == "npu" and nbytes:
            from vllm_aio.device.npu_host_map import map_for_npu

            return map_for_npu(address, nbytes, self.torch_device)
        return None

    def copy_rows(self, dst: torch.Tensor, dst_index: torch.Tensor | None, src: torch.Tensor,
                  src_index: torch.Tensor | None) -> None:
        """``dst[dst_index[r]] = src[src_index[r]]`` for every r (an index None: r itself), on the
        current stream; for copies where one side is mapped host memory (``map_host``, ``HostMemory.device_view``).

        CUDA with Triton: a kernel of a few programs (``link_copy.py``), which
        waits on the link without holding the SMs the forward computes on;
        elsewhere, and for a few rows (whose copy is shorter than a Triton
        launch's host time), torch's index kernels.
        """
        rows = len(dst_index if dst_index is not None else src_index if src_index is not None else src)
        if self.torch_device.type == "cuda" and rows > LINK_COPY_MIN_ROWS and link_copy.available():
            link_copy.copy_rows(dst, dst_index, src, src_index)
            return
        if dst_index is None and src_index is not None and dst.is_contiguous():
            torch.index_select(src, 0, src_index, out=dst[: len(src_index)])
            return
        if src_index is not None:
            rows = src.index_select(0, src_index)
        else:
            rows = src if dst_index is None else src[: len(dst_index)]
        if dst_index is None:
            dst[: len(rows)].copy_(rows)
        else:
            dst.index_copy_(0, dst_index, rows)

    def plane_copies(self, layers: Sequence[Sequence[tuple[int, int, int]]]) -> PlaneCopies | None:
        """One kernel per batch moving blocks of every plane of ``layers`` (each plane: address of
        block 0, bytes between blocks, bytes per block) to or from rows on the device; None where
        torch's per-plane index kernels do it (no CUDA, no Triton, planes of different shapes)."""
        if self.torch_device.type == "cuda" and link_copy.available() and PlaneCopies.fits(layers):
            return PlaneCopies(layers, self.torch_device)
        return None

    def indices(self, values: list[int] | np.ndarray) -> torch.Tensor:
        """``values`` as an int64 tensor on the device, copied without blocking the host.

        From page-locked memory: a copy from pageable memory waits for the
        stream's earlier work, so an index tensor made after a batch's first
        kernel stalled the host until that kernel ended (milliseconds per
        batch). torch's host allocator keeps the
        page-locked source until the copy has run.
        """
        host = torch.as_tensor(values, dtype=torch.int64)
        return host if self.is_host else host.pin_memory().to(self.torch_device, non_blocking=True)

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
    torch's ``is_pinned()`` says False for registered memory, yet copies
    from it run asynchronously.
    """

    def __init__(
        self, tensor: torch.Tensor, unregister: Callable[[], None] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.tensor: torch.Tensor | None = tensor
        self._device = device  # where the registration maps the memory (CUDA), else None
        self._finalizer = weakref.finalize(self, unregister_quietly, tensor, unregister) if unregister else None
        if self._finalizer is not None:
            self._finalizer.atexit = False  # at exit the process's memory goes anyway, the driver may not

    def device_view(self) -> torch.Tensor | None:
        """The same bytes as a tensor on the device (kernels read and write them across
        the link), or None where the memory is not mapped for a device."""
        if self._device is None or not self.registered:
            return None
        return _device_view(self.tensor.data_ptr(), self.tensor.nbytes, self._device)

    @property
    def registered(self) -> bool:
        """Whether the memory is registered with the driver and not yet released."""
        return self._finalizer is not None and self._finalizer.alive

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs at most once
        self.tensor = None


def set_process_npu() -> int | None:
    """Give a process that has set no NPU one (the first visible), where it runs on an NPU host;
    returns the NPU index now current, None where there is no NPU (torch_npu missing or no card).

    For vLLM's scheduler process, which selects no device, before a library
    that needs one starts: Mooncake's NPU build always starts its Ascend
    transport, which asks Ascend's runtime for the current device
    (``aclrtGetDevice``) and fails without one, whatever ``protocol`` says. A
    process whose NPU is already initialized (a worker, also vLLM's scheduler
    and its TP=1 worker in one process) keeps the device it chose.
    """
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return None
    npu = torch.npu
    if not npu.is_available() or npu.device_count() == 0:
        return None
    if npu.is_initialized():
        return npu.current_device()
    npu.set_device(0)
    logger.info("vllm_aio: this process had no NPU selected: npu:0 (the first visible one) is now current")
    return 0


# Ascend storage formats (aclFormat) whose bytes lie where the tensor's strides say. torch_npu
# reports the logical strides for any other (a private format such as FRACTAL_NZ, which
# vllm-ascend gives KV caches on Ascend 310P), so only the format tells them apart.
STRIDED_NPU_FORMATS = {0: "NCHW", 1: "NHWC", 2: "ND", 30: "NCDHW"}
_PRIVATE_NPU_FORMATS = {3: "NC1HWC0", 4: "FRACTAL_Z", 29: "FRACTAL_NZ", 32: "NDC1HWC0", 33: "FRACTAL_Z_3D"}


def npu_private_format(tensor: torch.Tensor) -> str | None:
    """The storage format of an NPU tensor whose bytes do not follow its strides (e.g.
    ``"FRACTAL_NZ (29)"``); None for any other tensor (CPU, CUDA, NPU in a strided format)."""
    if tensor.device.type != "npu":
        return None
    import torch_npu  # loaded already: the tensor is on an NPU

    code = int(torch_npu.get_npu_format(tensor))
    if code in STRIDED_NPU_FORMATS:
        return None
    return f"{_PRIVATE_NPU_FORMATS.get(code, 'aclFormat')} ({code})"


def host_tensor(address: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory at ``address`` as a CPU uint8 tensor (no copy; the caller keeps the memory alive)."""
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


class _DeviceArray:
    """Device memory at an address, in the form ``torch.as_tensor`` wraps without a copy."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (pointer, False), "version": 3, "strides": None,
        }


_CU_MEMHOSTREGISTER_PORTABLE, _CU_MEMHOSTREGISTER_DEVICEMAP = 1, 2


def _map_cuda(address: int, nbytes: int, device: torch.device) -> MappedHost:
    def make() -> tuple[torch.Tensor, Callable[[], None]]:
        unregister = _register_cuda(host_tensor(address, nbytes), device)
        return _device_view(address, nbytes, device), unregister

    return shared_mapping(address, nbytes, device, make)


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


def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _register_cuda(tensor: torch.Tensor, device: torch.device) -> Callable[[], None]:
    """Page-locks ``tensor``'s memory and maps it for every device; returns what unregisters it.

    Through the driver API: a failing runtime call (``cudaHostRegister``)
    would leave an error behind that torch's next kernel launch raises.
    """
    address, nbytes = tensor.data_ptr(), tensor.nbytes
    flags = _CU_MEMHOSTREGISTER_PORTABLE | _CU_MEMHOSTREGISTER_DEVICEMAP
    with torch.cuda.device(device):
        torch.cuda.synchronize(device)  # a runtime call: the primary context is current on this thread
        result = _libcuda().cuMemHostRegister_v2(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), ctypes.c_uint(flags))
    if result != 0:
        raise RuntimeError(f"cuMemHostRegister of {nbytes} bytes of host memory at {address:#x} failed ({result})")

    def unregister() -> None:
        torch.cuda.synchronize(device)  # no copy or kernel may still use the pages
        result = _libcuda().cuMemHostUnregister(ctypes.c_void_p(address))
        if result != 0:
            raise RuntimeError(f"cuMemHostUnregister failed ({result})")

    return unregister


def _device_view(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """Registered host memory as a uint8 tensor on ``device`` (its device address; unified addressing)."""
    pointer = ctypes.c_uint64()
    with torch.cuda.device(device):
        torch.cuda.synchronize(device)  # the primary context, current on this thread
        result = _libcuda().cuMemHostGetDevicePointer_v2(ctypes.byref(pointer), ctypes.c_void_p(address), ctypes.c_uint(0))
        if result != 0:
            raise RuntimeError(f"cuMemHostGetDevicePointer failed ({result}) for registered host memory")
        return torch.as_tensor(_DeviceArray(pointer.value, nbytes), device=device)
