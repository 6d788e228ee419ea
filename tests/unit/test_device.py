"""``Device.host_memory``: exact-size host memory, page-locked on CUDA by registration, freed once."""

from __future__ import annotations

import ctypes
import gc
import mmap
import sys
import threading
import types

import numpy as np
import pytest
import torch

from harness.devices import CUDA as CUDA_DEVICES
from harness.devices import params, registered
from vllm_aio.device import accelerator as device_module
from vllm_aio.buffer.swaps import RowSwaps
from vllm_aio.device.accelerator import LINK_COPY_MIN_ROWS, Device

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class FakeDriver:
    """Stands in for cudaHostRegister / cudaHostUnregister (records the calls)."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def register(self, tensor: torch.Tensor, device: torch.device):
        address = tensor.data_ptr()
        self.registered[address] = tensor.nbytes

        def unregister() -> None:
            self.unregistered.append(address)

        return unregister


@pytest.fixture
def driver(monkeypatch) -> FakeDriver:
    fake = FakeDriver()
    monkeypatch.setattr(device_module, "_register_cuda", fake.register)
    return fake


def test_cpu_host_memory_is_plain_and_exact():
    memory = Device(torch.device("cpu")).host_memory(3 << 20 | 1)
    assert memory.tensor.nbytes == 3 << 20 | 1 and not memory.registered
    memory.release()  # nothing to unregister
    assert memory.tensor is None


def test_cuda_host_memory_is_registered_and_unregistered_once(driver):
    memory = Device(torch.device("cuda")).host_memory(1000)
    address = memory.tensor.data_ptr()
    assert memory.tensor.nbytes == 1000 and memory.registered
    # Whole pages of its own: no page shared with another allocation is registered.
    assert driver.registered == {address: mmap.PAGESIZE} and address % mmap.PAGESIZE == 0
    memory.release()
    memory.release()
    assert driver.unregistered == [address] and not memory.registered


def test_forgotten_host_memory_is_unregistered_when_collected(driver):
    memory = Device(torch.device("cuda")).host_memory(1000)
    address = memory.tensor.data_ptr()
    view = memory.tensor[10:20]
    del memory
    gc.collect()
    assert driver.unregistered == [address]
    view.fill_(7)  # views outlive the registration: the memory is freed with them
    assert view.sum().item() == 70


def test_no_bytes_register_nothing(driver):
    memory = Device(torch.device("cuda")).host_memory(0)
    assert memory.tensor.nbytes == 0 and driver.registered == {}


@CUDA
def test_registered_memory_is_page_locked_without_the_caching_allocator():
    device = Device(torch.device("cuda"))
    before = _host_allocator_bytes()
    memory = device.host_memory((3 << 20) + 4096)
    assert memory.tensor.nbytes == (3 << 20) + 4096 and registered(memory.tensor)
    small = [device.host_memory(100) for _ in range(8)]  # heap allocations, maybe on shared pages
    assert all(registered(m.tensor) for m in small)
    assert _host_allocator_bytes() == before  # not rounded up to 4 MiB by torch's host allocator
    src = torch.arange(memory.tensor.nbytes, device="cuda").to(torch.uint8)
    memory.tensor.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(memory.tensor.cuda(), src)
    view = memory.tensor[:4096]
    memory.release()
    assert not registered(view)  # unregistered, still readable
    assert torch.equal(view, src[:4096].cpu())


@pytest.mark.npu
def test_npu_host_memory_is_pinned():
    device = Device(torch.device("npu", 0))
    memory = device.host_memory(4096)
    assert memory.tensor.nbytes == 4096 and memory.tensor.is_pinned()
    src = torch.arange(4096).to(torch.uint8).to("npu:0")
    memory.tensor.copy_(src, non_blocking=True)
    device.synchronize(device.record())
    assert torch.equal(memory.tensor, src.cpu())
    memory.release()


@pytest.mark.npu
def test_npu_kernels_read_and_write_mapped_host_memory_in_place():
    import ctypes
    import mmap

    from vllm_aio.device.accelerator import host_tensor

    device = Device(torch.device("npu", 0))  # a mapping is made for one card: named by its index
    region = mmap.mmap(-1, 1 << 20)  # page-aligned, as the pool's /dev/shm slots are
    view = ctypes.c_char.from_buffer(region)
    address = ctypes.addressof(view)
    host = host_tensor(address, 1 << 20)
    host.copy_(torch.arange(1 << 20).to(torch.uint8))
    mapped = device.map_host(address, 1 << 20)
    assert mapped is not None, "CANN refused to map page-aligned host memory (the log says why)"
    rows = mapped.tensor.view(256, 4096)
    ids = device.indices([3, 200, 7])
    assert torch.equal(rows.index_select(0, ids).cpu(), host.view(256, 4096)[[3, 200, 7]])
    rows.index_copy_(0, device.indices([9]), torch.full((1, 4096), 77, dtype=torch.uint8, device="npu:0"))
    device.synchronize(device.record())
    assert bool((host.view(256, 4096)[9] == 77).all())
    mapped.release()


def _host_allocator_bytes() -> int | None:
    try:
        return int(torch.cuda.memory.host_memory_stats().get("active_bytes.current", 0))
    except Exception:  # older torch
        return None


@pytest.mark.parametrize("name", params("cpu", *CUDA_DEVICES))
@pytest.mark.parametrize(("dst_indexed", "src_indexed"), [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("rows", [32, LINK_COPY_MIN_ROWS])  # the link kernel on CUDA, and torch's for a few rows
def test_copy_rows_moves_indexed_rows_between_mapped_host_memory_and_the_device(name, dst_indexed, src_indexed, rows):
    device = Device(torch.device(name))
    pages = mmap.mmap(-1, 64 * 1040 * 8)  # 64 rows of 1,040 words: a width that is no multiple of the kernel's block
    mapped = device.map_host(ctypes.addressof(ctypes.c_char.from_buffer(pages)), len(pages))
    host = mapped.tensor.view(torch.int64).view(64, 1040)
    try:
        host.copy_(torch.arange(64 * 1040, dtype=torch.int64).view(64, 1040))
        on_device = torch.full((32, 1048), -1, dtype=torch.int64, device=device.torch_device)
        dst = on_device[:, 8:]  # strided rows, as the slots' payloads behind their headers
        src_ids, dst_ids = torch.randperm(64)[:rows], torch.randperm(32)[:rows]
        device.copy_rows(dst, dst_ids.to(name) if dst_indexed else None, host,
                         src_ids.to(name) if src_indexed else None)
        device.synchronize(device.record())
        got = dst.cpu()[dst_ids if dst_indexed else torch.arange(rows)]
        want = host.cpu()[src_ids if src_indexed else torch.arange(rows)]
        assert torch.equal(got, want)
        assert (on_device[:, :8] == -1).all()  # nothing outside the rows' columns
        device.copy_rows(host, src_ids.to(name), dst[:rows], None)  # and back, into the mapped rows
        device.synchronize(device.record())
        assert torch.equal(host.cpu()[src_ids], dst[:rows].cpu())
    finally:
        del host
        mapped.release()


@pytest.mark.parametrize("name", params("cpu", *CUDA_DEVICES))
@pytest.mark.parametrize("directions", ["out and in", "out", "in"])
def test_row_swaps_move_rows_out_of_a_buffer_before_moving_rows_into_it(name, directions):
    """A block written back and loaded in one swap leaves with its old bytes and gets the new ones;
    a second step's rows (another count: its index tensors 8 bytes off 16-byte alignment) move as
    exactly, through the kernel compiled for the first."""
    device = Device(torch.device(name))
    planes, blocks, width = 2, 40, 1040  # two planes (K and V apart); a width no multiple of the kernel's block
    pages = mmap.mmap(-1, 2 * planes * blocks * width * 8)  # two layers' host copies
    mapped = device.map_host(ctypes.addressof(ctypes.c_char.from_buffer(pages)), len(pages))
    done, following = mapped.tensor.view(torch.int64).view(2, planes, blocks, width).unbind(0)
    stream = device.new_stream()
    try:
        values = torch.arange(3 * planes * blocks * width, dtype=torch.int64).view(3, planes, blocks, width)
        buffer = torch.empty_like(values[2]).to(device.torch_device)
        swaps = RowSwaps(device, [done, following], [buffer, buffer], stream)  # both layers in one buffer
        steps = [(np.array([3, 7, 11, 20]), np.array([7, 11, 30, 31, 39])),  # 7 and 11 both ways
                 (np.array([1, 5, 9]), np.array([5]))]
        for out_rows, in_rows in steps:
            done.copy_(values[0])
            following.copy_(values[1])
            buffer.copy_(values[2])
            out_rows = out_rows if "out" in directions else out_rows[:0]
            in_rows = in_rows if "in" in directions else in_rows[:0]
            device.synchronize(device.record())
            swaps.plan(out_rows, in_rows)
            swaps.swap(0, 1)
            device.synchronize(device.record(stream))
            want_host, want_buffer = values[0].clone(), values[2].clone()
            want_host[:, out_rows] = values[2][:, out_rows]
            want_buffer[:, in_rows] = values[1][:, in_rows]
            assert torch.equal(done.cpu(), want_host)
            assert torch.equal(buffer.cpu(), want_buffer)
            assert torch.equal(following.cpu(), values[1])
    finally:
        del done, following
        mapped.release()


# A thread's current device (``Device.bind_thread``) and a process's NPU (``set_process_npu``).

@pytest.fixture
def device_indices(monkeypatch) -> list[tuple[str, int]]:
    """(thread name, index) of every current device set through torch's accelerator API."""
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(torch.accelerator, "set_device_index",
                        lambda index: calls.append((threading.current_thread().name, index)))
    return calls


def test_binding_a_thread_sets_its_device_once_per_thread(device_indices):
    device = Device(torch.device("cuda", 1))  # a worker's card other than 0: no GPU needed to name it
    for name in ("vllm_aio-recv", "vllm_aio-send"):
        thread = threading.Thread(target=lambda: [device.bind_thread() for _ in range(3)], name=name)
        thread.start()
        thread.join()
    assert device_indices == [("vllm_aio-recv", 1), ("vllm_aio-send", 1)]


def test_binding_a_thread_to_the_cpu_sets_nothing(device_indices):
    Device(torch.device("cpu")).bind_thread()
    assert device_indices == []


class StandInNpu:
    """``torch.npu`` as torch_npu registers it, recording ``set_device``."""

    def __init__(self, cards: int, initialized: bool = False) -> None:
        self.cards, self.initialized, self.selected = cards, initialized, []

    def is_available(self) -> bool:
        return self.cards > 0

    def device_count(self) -> int:
        return self.cards

    def is_initialized(self) -> bool:
        return self.initialized

    def current_device(self) -> int:
        return 3

    def set_device(self, index: int) -> None:
        self.selected.append(index)


@pytest.fixture
def npu_host(monkeypatch):
    """A host where torch_npu imports; the test sets what ``torch.npu`` answers."""
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))

    def with_npu(npu: StandInNpu) -> StandInNpu:
        monkeypatch.setattr(torch, "npu", npu, raising=False)
        return npu

    return with_npu


def test_a_process_without_an_npu_selected_gets_the_first_visible_one(npu_host):
    npu = npu_host(StandInNpu(cards=2))
    assert device_module.set_process_npu() == 0 and npu.selected == [0]


def test_a_process_whose_npu_is_initialized_keeps_its_device(npu_host):
    npu = npu_host(StandInNpu(cards=8, initialized=True))
    assert device_module.set_process_npu() == 3 and npu.selected == []


def test_no_npu_visible_selects_nothing(npu_host):
    npu = npu_host(StandInNpu(cards=0))
    assert device_module.set_process_npu() is None and npu.selected == []


def test_without_torch_npu_no_npu_is_selected(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails
    assert device_module.set_process_npu() is None
