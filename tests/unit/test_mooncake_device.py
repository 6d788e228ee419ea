"""Mooncake on Ascend without an NPU: the NPU selected before the client starts, and device-direct.

Device-direct (``block_io/in_place.py`` over ``MooncakeBackend.segment_memory``): the worker
registers its KV cache and its staging as device memory with the store and hands the store those
addresses. Here a stand-in store records what is registered and what is passed, and copies bytes
at the addresses it is given: CPU tensors play the NPU's memory, and a device that calls itself an
accelerator but computes on the CPU plays the NPU. The real transfer runs only on an NPU.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import socket
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vllm_aio.backends import Memory, Status
from vllm_aio.backends import mooncake as mooncake_module
from vllm_aio.backends.mooncake import MooncakeBackend, MooncakeSettings
from vllm_aio.connector.worker import block_io
from vllm_aio.connector.worker.block_io import BlockRef, CopyHandoff, InPlacePath, open_block_io
from vllm_aio.device.accelerator import Device
from vllm_aio.pool.entry import HEADER_BYTES, EntryHeader
from vllm_aio.pool.keys import Unit

LAYERS, NUM_BLOCKS = ("l0", "l1"), 8
EVERY_LAYER = Unit((0, 1), None)
OBJECT_NOT_FOUND, TRANSFER_FAIL = -704, -800


class StandInStore:
    """``MooncakeDistributedStore`` over a dict: bytes copied at the addresses given, which must lie in
    registered memory (as the transfer engine requires); ``fail``: keys whose transfer fails."""

    def __init__(self, log: list[str] | None = None) -> None:
        self.values: dict[str, bytes] = {}
        self.registered: list[tuple[int, int]] = []
        self.calls: list[tuple[str, Any]] = []
        self.fail: set[str] = set()
        self.log = log if log is not None else []

    def setup(self, *args: Any) -> int:
        self.log.append("setup")
        return 0

    def register_buffer(self, address: int, size: int) -> int:
        self.registered.append((address, size))
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [int(k in self.values) for k in keys]

    def batch_put_from(self, keys, ptrs, sizes, config) -> list[int]:
        self.calls.append(("batch_put_from", list(zip(ptrs, sizes))))
        return [self._put(k, [(p, n)]) for k, p, n in zip(keys, ptrs, sizes)]

    def batch_put_from_multi_buffers(self, keys, ptrs, sizes, config) -> list[int]:
        self.calls.append(("batch_put_from_multi_buffers", [list(zip(p, n)) for p, n in zip(ptrs, sizes)]))
        return [self._put(k, list(zip(p, n))) for k, p, n in zip(keys, ptrs, sizes)]

    def batch_get_into(self, keys, ptrs, sizes) -> list[int]:
        self.calls.append(("batch_get_into", list(zip(ptrs, sizes))))
        return [self._get(k, [(p, n)]) for k, p, n in zip(keys, ptrs, sizes)]

    def batch_get_into_multi_buffers(self, keys, ptrs, sizes) -> list[int]:
        self.calls.append(("batch_get_into_multi_buffers", [list(zip(p, n)) for p, n in zip(ptrs, sizes)]))
        return [self._get(k, list(zip(p, n))) for k, p, n in zip(keys, ptrs, sizes)]

    def get_size(self, key: str) -> int:
        return len(self.values[key]) if key in self.values else OBJECT_NOT_FOUND

    def close(self) -> int:
        return 0

    def in_registered(self, address: int, size: int) -> bool:
        return any(a <= address and address + size <= a + n for a, n in self.registered)

    def _put(self, key: str, segments: list[tuple[int, int]]) -> int:
        if key in self.fail or not all(self.in_registered(p, n) for p, n in segments):
            return TRANSFER_FAIL
        self.values.setdefault(key, b"".join(ctypes.string_at(p, n) for p, n in segments))
        return 0

    def _get(self, key: str, segments: list[tuple[int, int]]) -> int:
        if key not in self.values:
            return OBJECT_NOT_FOUND
        if key in self.fail or not all(self.in_registered(p, n) for p, n in segments):
            return TRANSFER_FAIL
        value, offset = self.values[key], 0
        for p, n in segments:
            ctypes.memmove(p, value[offset : offset + n], n)
            offset += n
        return offset


class NpuOnTheCpu(Device):
    """An accelerator to ``open_block_io`` (not host memory: staging on the device, device memory
    registered), whose memory and copies are the CPU's: synchronous, so no streams or events."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.is_host = False

    def new_stream(self) -> None:
        return None

    def record(self, stream=None) -> None:
        return None

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        raise AssertionError("device-direct stages in device memory, never in host buffers")

    def indices(self, values) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int64)


@pytest.fixture
def master() -> Iterator[str]:
    """An address that accepts TCP, as a master's port does (the backend checks it before setup)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


def backend_for(master: str, store: StandInStore, protocol: str = "ascend", ascend_transport: bool = True,
                value_bytes: int | None = None) -> MooncakeBackend:
    settings = MooncakeSettings(master_server_address=master, local_hostname="127.0.0.1", protocol=protocol)
    return MooncakeBackend(settings, value_bytes=value_bytes, store_factory=lambda: store,
                           ascend_transport=ascend_transport)


# -- the capability ------------------------------------------------------------------------------

def test_the_ascend_transport_over_protocol_ascend_moves_device_memory(master):
    assert backend_for(master, StandInStore()).segment_memory() == frozenset({Memory.HOST, Memory.DEVICE})


@pytest.mark.parametrize("protocol", ["tcp", "rdma"])
def test_other_protocols_move_host_memory_only(master, protocol):
    assert backend_for(master, StandInStore(), protocol=protocol).segment_memory() == frozenset({Memory.HOST})


def test_a_build_without_the_ascend_transport_moves_host_memory_only(master):
    assert backend_for(master, StandInStore(), ascend_transport=False).segment_memory() == frozenset({Memory.HOST})


def test_a_client_without_multi_buffer_batches_moves_host_memory_only(master):
    class OlderStore(StandInStore):
        batch_put_from_multi_buffers = property()  # as an older client, which lacks it

    store = OlderStore()
    assert not hasattr(store, "batch_put_from_multi_buffers")
    assert backend_for(master, store).segment_memory() == frozenset({Memory.HOST})


def test_the_npu_build_is_told_by_its_wheel(monkeypatch):
    monkeypatch.setattr(mooncake_module.importlib.metadata, "packages_distributions",
                        lambda: {"mooncake": ["mooncake-transfer-engine-npu"]})
    assert mooncake_module.ascend_transport_built()
    monkeypatch.setattr(mooncake_module.importlib.metadata, "packages_distributions",
                        lambda: {"mooncake": ["mooncake-transfer-engine-non-cuda"]})
    assert not mooncake_module.ascend_transport_built()


# -- the NPU selected before setup ---------------------------------------------------------------

class StandInNpu:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 2

    def is_initialized(self) -> bool:
        return False

    def set_device(self, index: int) -> None:
        self.log.append(f"set_device({index})")


def test_an_npu_is_selected_before_the_client_starts(master, monkeypatch):
    # vLLM's scheduler process: torch_npu present, no NPU selected; Mooncake's NPU build needs one in setup.
    log: list[str] = []
    stand_in = types.ModuleType("torch_npu")
    stand_in.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    monkeypatch.setitem(sys.modules, "torch_npu", stand_in)
    monkeypatch.setattr(torch, "npu", StandInNpu(log), raising=False)
    backend_for(master, StandInStore(log), protocol="tcp").close()
    assert log == ["set_device(0)", "setup"]


# -- the device-direct path ----------------------------------------------------------------------

@pytest.fixture
def npu_on_the_cpu(monkeypatch) -> None:
    monkeypatch.setattr(block_io, "Device", NpuOnTheCpu)


def caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn((NUM_BLOCKS, 2, 16, 32), generator=g).to(torch.bfloat16) for n in LAYERS}


def value_bytes(kv: dict[str, torch.Tensor]) -> int:
    return HEADER_BYTES + sum(t[0].nbytes for t in kv.values())


def open_io(kv: dict[str, torch.Tensor], backend: MooncakeBackend):
    header = EntryHeader("0123456789abcdef", "pp0.dcp0.h0", -1, 16, 0)
    return open_block_io(kv, LAYERS, NUM_BLOCKS, backend, header, 1 << 20, 5.0)


def refs(block_ids, tag: str = "b") -> list[BlockRef]:
    return [BlockRef(b, f"{tag}{i}".encode()) for i, b in enumerate(block_ids)]


def test_device_direct_registers_the_kv_cache_and_its_staging_as_device_memory(master, npu_on_the_cpu, monkeypatch):
    kv, store = caches(1), StandInStore()
    backend = backend_for(master, store, value_bytes=value_bytes(kv))
    registered: list[tuple[int, int, Memory]] = []
    register = backend.register_memory
    monkeypatch.setattr(backend, "register_memory",
                        lambda address, size, memory=Memory.HOST: (registered.append((address, size, memory)),
                                                                  register(address, size, memory)))
    io = open_io(kv, backend)
    assert isinstance(io, InPlacePath) and not io.direct
    planes = [(t.data_ptr(), t.nbytes) for t in kv.values()]  # one plane a layer: its whole extent
    assert [(a, n) for a, n, _ in registered[:2]] == planes
    assert len(registered) == 4 and all(memory is Memory.DEVICE for *_, memory in registered)
    assert store.registered == [(a, n) for a, n, _ in registered]
    io.close()
    backend.close()


@pytest.fixture
def pair(master, npu_on_the_cpu):
    """(source caches, destination caches, store, saver, loader): two device-direct paths on one store."""
    src, dst, store = caches(1), caches(2), StandInStore()
    backend = backend_for(master, store, value_bytes=value_bytes(src))
    saver, loader = open_io(src, backend), open_io(dst, backend)
    yield src, dst, store, saver, loader
    saver.close()
    loader.close()
    backend.close()


def test_device_direct_puts_from_device_staging_and_gets_into_the_cache_blocks(pair):
    src, dst, store, saver, loader = pair
    assert saver.save(refs([1, 4, 6]), EVERY_LAYER, None, CopyHandoff()) == [Status.OK] * 3
    name, puts = store.calls[-1]
    assert name == "batch_put_from" and all(store.in_registered(p, n) for p, n in puts)
    assert not any(t.data_ptr() <= p < t.data_ptr() + t.nbytes for p, _ in puts for t in src.values())

    result = loader.load(refs([0, 2, 7]), EVERY_LAYER)
    assert result.settle() == [Status.OK] * 3
    name, gets = store.calls[-1]
    assert name == "batch_get_into_multi_buffers"
    for segments, block in zip(gets, [0, 2, 7]):  # the header into staging, then each layer's block itself
        assert segments[1:] == [(t[block].data_ptr(), t[block].nbytes) for t in dst.values()]
        assert segments[0][1] == HEADER_BYTES and store.in_registered(*segments[0])
    for n in LAYERS:
        assert torch.equal(dst[n][[0, 2, 7]], src[n][[1, 4, 6]])


def test_device_direct_failures_become_misses(pair):
    src, dst, store, saver, loader = pair
    assert saver.save(refs([1, 2]), EVERY_LAYER, None, CopyHandoff()) == [Status.OK] * 2
    store.fail = {saver.keys(refs([1, 2]), EVERY_LAYER)[1]}
    untouched = dst["l0"][5].clone()
    assert loader.load(refs([3, 4, 5]), EVERY_LAYER).settle() == [Status.OK, Status.ERROR, Status.MISSING]
    assert torch.equal(dst["l0"][3], src["l0"][1]) and torch.equal(dst["l0"][5], untouched)
    store.fail = {saver.keys(refs([7], tag="n"), EVERY_LAYER)[0]}
    assert saver.save(refs([7], tag="n"), EVERY_LAYER, None, CopyHandoff()) == [Status.ERROR]


def test_device_direct_refuses_a_value_under_another_header(pair):
    _, _, store, saver, loader = pair
    assert saver.save(refs([1]), EVERY_LAYER, None, CopyHandoff()) == [Status.OK]
    (key,) = saver.keys(refs([1]), EVERY_LAYER)
    store.values[key] = bytes(HEADER_BYTES) + store.values[key][HEADER_BYTES:]  # another writer's header
    assert loader.load(refs([3]), EVERY_LAYER).settle() == [Status.FOREIGN]


def test_with_a_host_only_backend_an_accelerator_takes_the_staged_path(master, npu_on_the_cpu):
    # tcp over the NPU build: no device-direct, so the staged path (page-locked host staging).
    backend = backend_for(master, StandInStore(), protocol="tcp", value_bytes=value_bytes(caches(1)))
    with pytest.raises(AssertionError, match="never in host buffers"):
        open_io(caches(1), backend)
    backend.close()
