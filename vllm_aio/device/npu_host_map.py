"""Host memory mapped for Ascend NPU kernels: the embedded pool's slots read and written in place.

CANN maps page-aligned host memory into an NPU's address space (``aclrtHostRegister``, mapped, on
Atlas A2/A3); device kernels read and write it at the returned device address (CANN documents it
for kernels, not for memcpy), so a batch of scattered slots moves in one gather or scatter per
plane, as on CUDA, with no staging copy. Registration goes through whichever the process has,
chosen once:

* torch_npu's own runtime binding, ``torch_npu.npu.npurt().npuHostRegister(ptr, size,
  ACL_HOST_REG_MAPPED)`` (torch_npu 2.10.0.post5 and later; it wraps ``aclrtHostRegisterV2``),
  then ``aclrtHostGetDevicePointer`` for the device address, which torch_npu does not wrap;
* otherwise (torch_npu 2.10.0.post4, the one vllm-ascend v0.23.0 pins) ``aclrtHostRegister(ptr,
  size, ACL_HOST_REGISTER_MAPPED, &device_ptr)`` through ctypes on ``libascendcl.so``.

The device address becomes an NPU uint8 tensor without a copy through
``torch_npu._C._construct_storage_from_data_pointer`` and
``_construct_NPU_Tensor_From_Storage_And_Metadata`` (torch_npu 2.3.1.post6 and later). Whatever
is refused, ``map_for_npu`` returns None and the caller stages through page-locked memory; one log
line says which path was taken and why.

On host kernels up to 5.10, CANN documents that registering memory that is not page-locked raises
exceptions, and the pool's ``/dev/shm`` pages are not. There the pages are locked first (``mlock``,
undone after unregistering); where the lock is refused (``RLIMIT_MEMLOCK``, e.g. a container
without ``--ulimit memlock=-1``), nothing is registered and values go through staging. One log
line names the kernel and the choice; it is made once, when the worker maps the pool at start.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import re
from collections.abc import Callable
from typing import Any, Protocol

import torch

from vllm_aio.device.mapped_host import MappedHost, shared_mapping
from vllm_aio.log import get_logger

logger = get_logger(__name__)

# The newest host kernel on which aclrtHostRegister needs page-locked memory (CANN's documentation).
LAST_KERNEL_NEEDING_LOCKED_PAGES = (5, 10)

ACL_HOST_REG_MAPPED = 0x2  # aclrtHostRegisterV2's flag, which npuHostRegister takes
ACL_HOST_REGISTER_MAPPED = 0  # aclrtHostRegister's type


class HostRegistrar(Protocol):
    name: str

    def register(self, address: int, nbytes: int) -> int:
        """Map the pages for the device; the device address (raises RuntimeError when refused)."""

    def unregister(self, address: int) -> None: ...


def _check(error: int, call: str) -> None:
    if error != 0:
        raise RuntimeError(f"{call} returned aclError {error}")


class NpurtRegistrar:
    name = "torch_npu's npuHostRegister"

    def __init__(self, npurt: Any, acl: Any) -> None:
        self._rt, self._acl = npurt, acl

    def register(self, address: int, nbytes: int) -> int:
        _check(self._rt.npuHostRegister(address, nbytes, ACL_HOST_REG_MAPPED), "npuHostRegister")
        pointer = ctypes.c_void_p()
        try:
            _check(self._acl.aclrtHostGetDevicePointer(ctypes.c_void_p(address), ctypes.byref(pointer), 0),
                   "aclrtHostGetDevicePointer")
        except RuntimeError:
            self.unregister(address)
            raise
        return pointer.value

    def unregister(self, address: int) -> None:
        _check(self._rt.npuHostUnregister(address), "npuHostUnregister")


class AclRegistrar:
    name = "aclrtHostRegister (libascendcl)"

    def __init__(self, acl: Any) -> None:
        self._acl = acl

    def register(self, address: int, nbytes: int) -> int:
        pointer = ctypes.c_void_p()
        _check(self._acl.aclrtHostRegister(ctypes.c_void_p(address), ctypes.c_uint64(nbytes),
                                           ACL_HOST_REGISTER_MAPPED, ctypes.byref(pointer)), "aclrtHostRegister")
        return pointer.value

    def unregister(self, address: int) -> None:
        _check(self._acl.aclrtHostUnregister(ctypes.c_void_p(address)), "aclrtHostUnregister")


def choose_registrar(torch_npu: Any, acl: Any) -> HostRegistrar:
    """torch_npu's binding where it has one (``npurt`` raises where the build lacks it), else ACL's."""
    npurt = getattr(torch_npu.npu, "npurt", None)
    if npurt is not None:
        try:
            return NpurtRegistrar(npurt(), acl)
        except RuntimeError:
            pass
    return AclRegistrar(acl)


def npu_tensor(torch_npu: Any, device_address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` at a device address as an NPU uint8 tensor that does not own them."""
    storage = torch_npu._C._construct_storage_from_data_pointer(device_address, device, nbytes)
    metadata = {"dtype": torch.uint8, "size": (nbytes,), "stride": (1,), "storage_offset": 0}
    return torch_npu._C._construct_NPU_Tensor_From_Storage_And_Metadata(metadata, storage)


_said: set[str] = set()  # one line per process and outcome


def map_for_npu(address: int, nbytes: int, device: torch.device, torch_npu: Any = None,
                acl: Any = None, libc: Any = None, kernel: str | None = None) -> MappedHost | None:
    """The host memory at ``address`` mapped for ``device``'s kernels, or None (stage instead).

    ``libc`` (``mlock``/``munlock``) and ``kernel`` (the host kernel's release) default to the
    process's own; tests give stand-ins, as for ``torch_npu`` and ``acl``.
    """
    return shared_mapping(address, nbytes, device,
                          lambda: _map(address, nbytes, device, torch_npu, acl, libc, kernel or platform.release()))


def kernel_version(release: str) -> tuple[int, int] | None:
    """(major, minor) of a kernel release such as ``5.10.0-60.18.0.50.oe2203.aarch64``; None if unreadable."""
    match = re.match(r"(\d+)\.(\d+)", release)
    return (int(match.group(1)), int(match.group(2))) if match else None


def lock_pages(address: int, nbytes: int, libc: Any, kernel: str) -> Callable[[], None] | None:
    """Page-lock the range where the host kernel needs it before registration (a release it
    cannot read counts as one that does): what undoes it, or None where ``mlock`` refused
    (the range must not be registered then). One log line says which, where locking was needed.
    """
    version = kernel_version(kernel)
    if version is not None and version > LAST_KERNEL_NEEDING_LOCKED_PAGES:
        return lambda: None
    why = (f"host kernel {kernel}: CANN's aclrtHostRegister needs page-locked memory on kernels up to "
           f"{'.'.join(map(str, LAST_KERNEL_NEEDING_LOCKED_PAGES))}")
    libc = libc or ctypes.CDLL(None, use_errno=True)
    if libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)) != 0:
        error = os.strerror(ctypes.get_errno())
        _say("warning", f"{why}, and mlock of the pool's {nbytes} bytes was refused ({error}; raise RLIMIT_MEMLOCK, "
                        "e.g. docker run --ulimit memlock=-1): values go through page-locked staging")
        return None
    _say("info", f"{why}: the pool's {nbytes} bytes are locked (mlock) before they are registered")
    return lambda: libc.munlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes))


def _map(address: int, nbytes: int, device: torch.device, torch_npu: Any, acl: Any, libc: Any, kernel: str):
    if address % mmap.PAGESIZE:
        _say("warning", f"not mapped for the NPU: {address:#x} is not page-aligned")
        return None
    unlock = lock_pages(address, nbytes, libc, kernel)
    if unlock is None:
        return None
    mapping = _register(address, nbytes, device, torch_npu, acl)
    if mapping is None:
        unlock()
        return None
    tensor, unmap = mapping

    def unmap_and_unlock() -> None:
        unmap()  # unregistered before the pages may move again
        unlock()

    return tensor, unmap_and_unlock


def _register(address: int, nbytes: int, device: torch.device, torch_npu: Any, acl: Any):
    try:
        torch_npu = torch_npu or __import__("torch_npu")
        acl = acl or ctypes.CDLL("libascendcl.so")
        registrar = choose_registrar(torch_npu, acl)
        device_address = registrar.register(address, nbytes)
    except (ImportError, OSError, RuntimeError, AttributeError) as exc:
        _say("warning", f"the NPU cannot map the pool's host memory ({exc}): values go through page-locked staging")
        return None
    try:
        tensor = npu_tensor(torch_npu, device_address, nbytes, device)
    except (RuntimeError, AttributeError, TypeError) as exc:
        registrar.unregister(address)
        _say("warning", f"torch_npu cannot wrap mapped host memory as a tensor ({exc}): values go through "
                        "page-locked staging")
        return None
    _say("info", f"the pool's host memory is mapped for the NPU through {registrar.name}: values move as device "
                 "gathers and scatters, no staging")

    def unmap() -> None:
        torch_npu.npu.synchronize(device)  # no kernel may still read or write the pages
        registrar.unregister(address)

    return tensor, unmap


def _say(level: str, message: str) -> None:
    if message not in _said:
        _said.add(message)
        getattr(logger, level)("vllm_aio: %s", message)
