"""Host memory mapped for the NPU (``vllm_aio/device/npu_host_map.py``) against a stand-in torch_npu and ACL.

vllm-ascend's own CPU unit tests stub torch_npu the same way: here the stand-ins record what the
mapping asks of torch_npu and of CANN's runtime, so the wiring is pinned where no NPU exists; the
real path runs in the NPU workflow (``tests/test_device.py``'s npu cases, ``make test-npu``).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import platform
from types import SimpleNamespace

import pytest
import torch

from vllm_aio.device import npu_host_map
from vllm_aio.device.npu_host_map import ACL_HOST_REG_MAPPED, ACL_HOST_REGISTER_MAPPED, kernel_version, map_for_npu

DEVICE_OFFSET = 1 << 40  # where the stand-in runtime "maps" host pages


class StandInAcl:
    """libascendcl's host-registration calls, as ctypes would make them."""

    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[tuple] = []
        self.refuse = refuse

    def aclrtHostRegister(self, ptr, size, kind, device_ptr) -> int:
        self.calls.append(("aclrtHostRegister", ptr.value, size.value, kind))
        if self.refuse:
            return 107000
        ctypes.cast(device_ptr, ctypes.POINTER(ctypes.c_void_p))[0] = ptr.value + DEVICE_OFFSET
        return 0

    def aclrtHostUnregister(self, ptr) -> int:
        self.calls.append(("aclrtHostUnregister", ptr.value))
        return 0

    def aclrtHostGetDevicePointer(self, ptr, device_ptr, flag) -> int:
        self.calls.append(("aclrtHostGetDevicePointer", ptr.value, flag))
        ctypes.cast(device_ptr, ctypes.POINTER(ctypes.c_void_p))[0] = ptr.value + DEVICE_OFFSET
        return 0


class StandInTorchNpu:
    """The parts of torch_npu the mapping uses; ``npurt``: whether the build has torch_npu's runtime binding."""

    def __init__(self, npurt: bool, wraps: bool = True) -> None:
        self.calls: list[tuple] = []
        self.npu = SimpleNamespace(synchronize=lambda device: self.calls.append(("synchronize", device)))
        if npurt:
            runtime = SimpleNamespace(npuHostRegister=self._register, npuHostUnregister=self._unregister)
            self.npu.npurt = lambda: runtime
        self._C = SimpleNamespace(_construct_storage_from_data_pointer=self._storage)
        if wraps:
            self._C._construct_NPU_Tensor_From_Storage_And_Metadata = self._tensor

    def _register(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("npuHostRegister", ptr, size, flags))
        return 0

    def _unregister(self, ptr: int) -> int:
        self.calls.append(("npuHostUnregister", ptr))
        return 0

    def _storage(self, ptr: int, device, nbytes: int):
        self.calls.append(("storage", ptr, str(device), nbytes))
        return ("storage", ptr)

    def _tensor(self, metadata: dict, storage):
        self.calls.append(("tensor", metadata, storage))
        return torch.empty(metadata["size"], dtype=metadata["dtype"])  # stands in for the NPU tensor


@pytest.fixture
def pages(monkeypatch):
    npu_host_map._said.clear()  # each test sees its own log lines
    monkeypatch.setattr(platform, "release", lambda: "6.6.0")  # a kernel that registers pages as they are
    region = mmap.mmap(-1, 4 * mmap.PAGESIZE)  # page-aligned, as the pool's /dev/shm mapping is
    view = ctypes.c_char.from_buffer(region)  # keeps the mapping alive while the test runs
    yield ctypes.addressof(view), len(region)


DEVICE = "npu:0"


def test_torch_npus_runtime_binding_maps_the_pages_and_the_device_address_becomes_a_tensor(pages):
    address, nbytes = pages
    torch_npu, acl = StandInTorchNpu(npurt=True), StandInAcl()
    mapped = map_for_npu(address, nbytes, DEVICE, torch_npu, acl)
    assert mapped is not None and mapped.tensor.dtype == torch.uint8 and mapped.tensor.numel() == nbytes
    assert torch_npu.calls[0] == ("npuHostRegister", address, nbytes, ACL_HOST_REG_MAPPED)
    assert acl.calls == [("aclrtHostGetDevicePointer", address, 0)]
    device_address = address + DEVICE_OFFSET
    assert torch_npu.calls[1] == ("storage", device_address, DEVICE, nbytes)
    assert torch_npu.calls[2][1] == {"dtype": torch.uint8, "size": (nbytes,), "stride": (1,), "storage_offset": 0}
    mapped.release()
    assert torch_npu.calls[3:] == [("synchronize", DEVICE), ("npuHostUnregister", address)]


def test_without_the_runtime_binding_acl_registers_the_pages_through_ctypes(pages):
    address, nbytes = pages
    torch_npu, acl = StandInTorchNpu(npurt=False), StandInAcl()
    mapped = map_for_npu(address, nbytes, DEVICE, torch_npu, acl)
    assert acl.calls == [("aclrtHostRegister", address, nbytes, ACL_HOST_REGISTER_MAPPED)]
    assert torch_npu.calls[0] == ("storage", address + DEVICE_OFFSET, DEVICE, nbytes)
    mapped.release()
    assert acl.calls[-1] == ("aclrtHostUnregister", address)


def test_two_users_of_one_region_share_one_registration(pages):
    address, nbytes = pages
    torch_npu, acl = StandInTorchNpu(npurt=False), StandInAcl()
    first, second = (map_for_npu(address, nbytes, DEVICE, torch_npu, acl) for _ in range(2))
    first.release()
    assert [c[0] for c in acl.calls] == ["aclrtHostRegister"]
    second.release()
    assert [c[0] for c in acl.calls] == ["aclrtHostRegister", "aclrtHostUnregister"]


def test_a_refused_registration_means_staging_and_says_so_once(pages, caplog):
    address, nbytes = pages
    with caplog.at_level(logging.INFO, logger="vllm"):
        for _ in range(2):
            assert map_for_npu(address, nbytes, DEVICE, StandInTorchNpu(npurt=False), StandInAcl(refuse=True)) is None
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "aclError 107000" in record.getMessage()
    assert "page-locked staging" in record.getMessage()


def test_a_torch_npu_that_cannot_wrap_the_address_unregisters_and_stages(pages):
    address, nbytes = pages
    acl = StandInAcl()
    assert map_for_npu(address, nbytes, DEVICE, StandInTorchNpu(npurt=False, wraps=False), acl) is None
    assert [c[0] for c in acl.calls] == ["aclrtHostRegister", "aclrtHostUnregister"]


def test_memory_that_is_not_page_aligned_is_not_registered(pages):
    address, nbytes = pages
    acl = StandInAcl()
    assert map_for_npu(address + 64, nbytes - 64, DEVICE, StandInTorchNpu(npurt=False), acl) is None
    assert acl.calls == []


class StandInLibc:
    """mlock / munlock as ctypes calls them; ``refuse``: mlock fails as over RLIMIT_MEMLOCK."""

    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[tuple] = []
        self.refuse = refuse

    def mlock(self, ptr, size) -> int:
        self.calls.append(("mlock", ptr.value, size.value))
        return -1 if self.refuse else 0

    def munlock(self, ptr, size) -> int:
        self.calls.append(("munlock", ptr.value, size.value))
        return 0


OLD_KERNEL = "5.10.0-60.18.0.50.oe2203.aarch64"  # openEuler 22.03's, common on Ascend hosts


def test_kernel_versions_are_read_from_their_release_strings():
    assert kernel_version(OLD_KERNEL) == (5, 10)
    assert kernel_version("6.18.44-fc-v1252") == (6, 18)
    assert kernel_version("unknown") is None


def test_on_an_old_kernel_the_pages_are_locked_before_registration_and_unlocked_after(pages, caplog):
    address, nbytes = pages
    torch_npu, acl, libc = StandInTorchNpu(npurt=False), StandInAcl(), StandInLibc()
    with caplog.at_level(logging.INFO, logger="vllm"):
        mapped = map_for_npu(address, nbytes, DEVICE, torch_npu, acl, libc, kernel=OLD_KERNEL)
    assert mapped is not None
    assert libc.calls == [("mlock", address, nbytes)] and acl.calls[0][0] == "aclrtHostRegister"
    assert any(OLD_KERNEL in r.getMessage() and "mlock" in r.getMessage() for r in caplog.records)
    mapped.release()
    assert acl.calls[-1][0] == "aclrtHostUnregister" and libc.calls[-1] == ("munlock", address, nbytes)


def test_on_an_old_kernel_a_refused_lock_means_staging_in_one_line_and_no_registration(pages, caplog):
    address, nbytes = pages
    acl = StandInAcl()
    with caplog.at_level(logging.INFO, logger="vllm"):
        for _ in range(2):
            assert map_for_npu(address, nbytes, DEVICE, StandInTorchNpu(npurt=False), acl,
                               StandInLibc(refuse=True), kernel=OLD_KERNEL) is None
    assert acl.calls == []
    (record,) = caplog.records
    message = record.getMessage()
    assert record.levelno == logging.WARNING and OLD_KERNEL in message and "page-locked staging" in message


def test_on_a_newer_kernel_nothing_is_locked(pages):
    address, nbytes = pages
    libc = StandInLibc()
    mapped = map_for_npu(address, nbytes, DEVICE, StandInTorchNpu(npurt=False), StandInAcl(), libc, kernel="5.15.0")
    assert mapped is not None and libc.calls == []
    mapped.release()


def test_a_refused_registration_on_an_old_kernel_unlocks_the_pages(pages):
    address, nbytes = pages
    libc = StandInLibc()
    assert map_for_npu(address, nbytes, DEVICE, StandInTorchNpu(npurt=False), StandInAcl(refuse=True), libc,
                       kernel=OLD_KERNEL) is None
    assert libc.calls == [("mlock", address, nbytes), ("munlock", address, nbytes)]
