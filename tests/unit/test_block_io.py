"""``BlockIO``'s three paths over the real embedded pool, on the CPU and, where present, an accelerator.

Each case runs on every path the device has: on the CPU the in-place path
(the backend copies into and out of the cache), the direct path (the pool's
memory is its own mapping there) and the staged path (never picked for a
host cache, forced here), so the logic of all three is checked without a
GPU; on an accelerator the staged path (page-locked staging) and the direct
path (``mapped_slots.py``). On a GPU machine run
``python -m pytest tests/unit/test_block_io.py``.
"""

from __future__ import annotations

import threading
import uuid

import pytest
import torch
from harness.devices import CUDA, marks

from vllm_aio.backends import Status
from vllm_aio.backends.local import LocalBackend
from vllm_aio.connector.worker.block_io import (
    BlockIO, BlockRef, CopyHandoff, DirectPath, InPlacePath, StagedPath, ValueLabels, open_block_io,
)
from vllm_aio.connector.worker.block_io.staging_save import Copied, StagingSave
from vllm_aio.device.block_layout import BlockLayout
from vllm_aio.connector.worker.block_io.mapped_slots import MappedSlots
from vllm_aio.device.staging import StagingBuffer
from vllm_aio.connector.worker.transfer import TransferThread
from vllm_aio.device.accelerator import Device
from vllm_aio.pool.entry import HEADER_BYTES, EntryHeader
from vllm_aio.pool.keys import Unit

LAYERS, NUM_BLOCKS = ("l0", "l1", "l2"), 12
SHAPES = {"block_major": (NUM_BLOCKS, 2, 16, 64), "kv_split": (2, NUM_BLOCKS, 16, 4, 16)}
# "+direct": values move straight between pool slots and the cache; "+staged": through staging, on the CPU too.
# NPU: staged only (torch_npu cannot map host memory for kernels).
DEVICES = [d + path for d in ["cpu", *CUDA] for path in ("", "+direct")] + ["cpu+staged", "npu"]
EVERY_LAYER, LAYER_1 = Unit((0, 1, 2), None), Unit((1,), 1)


def make_io(
    device: str, shape: tuple[int, ...], backend: LocalBackend | None, seed: int, shard: str = "pp0.dcp0.h0",
    staging: int = 1 << 20,
):
    device, _, path = device.partition("+")
    g = torch.Generator().manual_seed(seed)
    caches = {n: torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for n in LAYERS}
    layout = BlockLayout(caches, LAYERS, NUM_BLOCKS)
    dev = Device(torch.device(device))
    value = HEADER_BYTES + layout.payload_bytes(EVERY_LAYER.layers)
    backend = backend or LocalBackend(f"io-{uuid.uuid4().hex[:8]}", 1 << 22, value, seal=True)
    header = EntryHeader("0123456789abcdef", shard, -1, 16, 0)
    labels = ValueLabels(header, layout)
    if path == "direct":
        slots = MappedSlots.open(backend.slots(), layout, dev)
        assert slots is not None
        return DirectPath(labels, dev, slots), caches, backend
    kind = InPlacePath if dev.is_host and path != "staged" else StagedPath
    io = kind(labels, dev, layout, backend, StagingBuffer(dev, staging), StagingBuffer(dev, staging), 5.0)
    return io, caches, backend


def loaded(io: BlockIO, blocks, unit) -> list[Status]:
    """A load, waited for as the forward thread would (its stream after the copy event)."""
    result = io.load(blocks, unit)
    io.device.wait(result.copied)
    return result.settle()


def refs(block_ids, tag="b"):
    return [BlockRef(b, f"{tag}{i}".encode()) for i, b in enumerate(block_ids)]


@pytest.fixture(params=[pytest.param((d, s), marks=marks(d), id=f"{d}-{s}") for d in DEVICES for s in SHAPES])
def device_and_shape(request):
    return request.param[0], SHAPES[request.param[1]]


def test_warm_up_leaves_the_cache_and_the_pool_as_they_were(device_and_shape):
    """Every path compiles its copies at registration (``BlockIO.warm_up``) without moving a value."""
    device, shape = device_and_shape
    io, caches, backend = make_io(device, shape, None, seed=3)
    before = {name: cache.cpu().clone() for name, cache in caches.items()}
    io.warm_up([EVERY_LAYER.layers, LAYER_1.layers])
    assert all(torch.equal(caches[name].cpu(), before[name]) for name in caches)
    assert backend.gauges()["pool_stored_values"] == 0
    io.close()
    backend.close()


def test_saved_blocks_load_into_other_block_ids_byte_for_byte(device_and_shape):
    device, shape = device_and_shape
    saver, src, backend = make_io(device, shape, None, seed=1)
    handoff = CopyHandoff()
    assert saver.save(refs([3, 7, 1]), EVERY_LAYER, saver.device.record(), handoff) == [Status.OK] * 3
    assert handoff.wait(0)
    loader, dst, _ = make_io(device, shape, backend, seed=2)
    before = {n: t.clone() for n, t in dst.items()}
    assert loaded(loader, refs([0, 5, 11]), EVERY_LAYER) == [Status.OK] * 3
    for n in LAYERS:
        def blocks(t, ids):
            return t[ids] if len(shape) == 4 else t[:, ids]
        assert torch.equal(blocks(dst[n], [0, 5, 11]), blocks(src[n], [3, 7, 1]))
        untouched = [b for b in range(NUM_BLOCKS) if b not in (0, 5, 11)]
        assert torch.equal(blocks(dst[n], untouched), blocks(before[n], untouched))


def test_a_value_of_another_shard_is_refused_and_leaves_the_device_cache_alone(device_and_shape):
    device, shape = device_and_shape
    saver, _, backend = make_io(device, shape, None, seed=1, shard="pp0.dcp0.h1")
    saver.save(refs([3]), EVERY_LAYER, saver.device.record(), CopyHandoff())
    loader, dst, _ = make_io(device, shape, backend, seed=2)
    # The reader asks for its own key; plant the other shard's value under it.
    key = loader.keys(refs([0]), EVERY_LAYER)[0]
    theirs = saver.keys(refs([0]), EVERY_LAYER)[0]
    value = torch.empty(loader.value_bytes(EVERY_LAYER), dtype=torch.uint8)
    assert backend.batch_get([theirs], [[(value.data_ptr(), value.numel())]]) == [Status.OK]
    backend.batch_put([key], [[(value.data_ptr(), value.numel())]])
    before = {n: t.clone() for n, t in dst.items()}
    assert loaded(loader, refs([6]), EVERY_LAYER) == [Status.FOREIGN]
    if device != "cpu":  # the host cache is written in place; vLLM recomputes the refused block
        assert all(torch.equal(dst[n], before[n]) for n in LAYERS)


def test_one_layer_values_move_only_that_layer(device_and_shape):
    device, shape = device_and_shape
    saver, src, _ = make_io(device, shape, None, seed=1)
    backend = LocalBackend(f"io-{uuid.uuid4().hex[:8]}", 1 << 22, saver.value_bytes(LAYER_1), seal=True)
    saver, src, _ = make_io(device, shape, backend, seed=1)
    saver.save(refs([2, 4]), LAYER_1, saver.device.record(), CopyHandoff())
    loader, dst, _ = make_io(device, shape, backend, seed=2)
    before = {n: t.clone() for n, t in dst.items()}
    assert loaded(loader, refs([8, 9]), LAYER_1) == [Status.OK, Status.OK]
    assert torch.equal(dst["l0"], before["l0"]) and torch.equal(dst["l2"], before["l2"])
    assert not torch.equal(dst["l1"], before["l1"])


def test_abandoned_save_is_never_put():
    saver, _, backend = make_io("cpu", SHAPES["block_major"], None, seed=1)
    handoff = CopyHandoff()
    assert not handoff.wait(0)  # the forward thread gave up before the copy
    assert saver.save(refs([1]), EVERY_LAYER, None, handoff) == [Status.ERROR]
    assert backend.batch_exists(saver.keys(refs([1]), EVERY_LAYER)) == [False]


class CopyInFlight:
    """A copy into staging that the device finishes only when the host waits for it (``Device.synchronize``)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("copied")


def test_a_chunk_of_an_abandoned_save_gives_its_staging_back_only_after_its_copy(monkeypatch):
    from vllm_aio.connector.worker.block_io import base

    caches = {n: torch.zeros(SHAPES["block_major"], dtype=torch.bfloat16) for n in LAYERS}
    layout = BlockLayout(caches, LAYERS, NUM_BLOCKS)
    labels = ValueLabels(EntryHeader("0123456789abcdef", "pp0.dcp0.h0", -1, 16, 0), layout)
    monkeypatch.setattr(base, "_CHUNK_BYTES", 1)  # one value per chunk
    staging, log, handoff = StagingBuffer(Device(torch.device("cpu")), 1 << 20), [], CopyHandoff()
    release = staging.release
    monkeypatch.setattr(staging, "release",
                        lambda piece, after=None: (log.append(f"released at {piece.start}"), release(piece, after)))

    def copy_out(blocks, unit, computed, piece):
        assert not handoff.wait(0)  # the forward thread gives up while the first chunk is copied
        return Copied(blocks, unit, piece, None, CopyInFlight(log))

    backend = LocalBackend(f"io-{uuid.uuid4().hex[:8]}", 1 << 22, labels.value_bytes(EVERY_LAYER), seal=True)
    save, got = StagingSave(backend, staging, 1.0, copy_out, Device(torch.device("cpu"))), []
    save.save(refs([1, 2]), EVERY_LAYER, labels, None, handoff, 0, got.append)
    save.drain()
    assert got == [[Status.ERROR] * 2]
    # The second chunk's slice, never copied into, goes back (on this thread); the first chunk's
    # (on the put thread) once its copy is over.
    assert f"released at {labels.value_bytes(EVERY_LAYER)}" in log
    assert log.index("copied") < log.index("released at 0")
    save.close()


def test_batch_larger_than_the_staging_buffer_moves_chunk_by_chunk(device_and_shape, monkeypatch):
    from vllm_aio.connector.worker.block_io import base

    device, shape = device_and_shape
    value = make_io(device, shape, None, seed=1)[0].value_bytes(EVERY_LAYER)
    monkeypatch.setattr(base, "_CHUNK_BYTES", 2 * value)  # chunks of two values
    saver, src, backend = make_io(device, shape, None, seed=1, staging=3 * value)  # one chunk at a time
    assert saver.save(refs(range(8)), EVERY_LAYER, saver.device.record(), CopyHandoff()) == [Status.OK] * 8
    loader, dst, _ = make_io(device, shape, backend, seed=2, staging=3 * value)
    assert loaded(loader, refs(range(4, 12)), EVERY_LAYER) == [Status.OK] * 8
    def blocks(t, ids):
        return t[ids] if len(shape) == 4 else t[:, ids]
    for n in LAYERS:
        assert torch.equal(blocks(dst[n], list(range(4, 12))), blocks(src[n], list(range(8))))


class BindingDevice(Device):
    """The CPU, recording the threads that bind themselves to it (``Device.bind_thread``)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.bound: list[str] = []

    def bind_thread(self) -> None:
        self.bound.append(threading.current_thread().name)


def test_every_thread_that_moves_blocks_binds_itself_to_the_caches_device_first():
    caches = {n: torch.randn(SHAPES["block_major"]).to(torch.bfloat16) for n in LAYERS}
    layout, device = BlockLayout(caches, LAYERS, NUM_BLOCKS), BindingDevice()
    labels = ValueLabels(EntryHeader("0123456789abcdef", "pp0.dcp0.h0", -1, 16, 0), layout)
    backend = LocalBackend(f"io-{uuid.uuid4().hex[:8]}", 1 << 22, labels.value_bytes(EVERY_LAYER), seal=True)
    io = InPlacePath(labels, device, layout, backend, StagingBuffer(device, 1 << 20), StagingBuffer(device, 1 << 20),
                     5.0)
    recv, send = TransferThread("vllm_aio-recv"), TransferThread("vllm_aio-send")
    assert send.submit(io.save, refs([1]), EVERY_LAYER, None, CopyHandoff()).result() == [Status.OK]
    assert recv.submit(lambda: io.load(refs([2]), EVERY_LAYER).settle()).result() == [Status.OK]
    assert device.bound == ["vllm_aio-send", "vllm_aio-put", "vllm_aio-recv"]
    for thread in (recv, send):
        thread.close()
    io.close()
    backend.close()


def test_save_without_staging_space_is_dropped_not_blocked():
    saver, _, backend = make_io("cpu", SHAPES["block_major"], None, seed=1, staging=100)
    handoff = CopyHandoff()
    assert saver.save(refs([1]), EVERY_LAYER, None, handoff) == [Status.DROPPED]
    assert handoff.wait(0)


STAGING_DEVICES = [pytest.param(d, marks=marks(d), id=d) for d in ["cpu", "cpu+staged", *CUDA, "npu"]]


def gated_puts(backend: LocalBackend) -> threading.Event:
    """The pool made slow: its puts wait until the returned event is set."""
    gate, put = threading.Event(), backend.batch_put
    backend.batch_put = lambda *args: (gate.wait(30), put(*args))[1]
    return gate


@pytest.mark.parametrize("device", STAGING_DEVICES)
def test_a_save_leaves_the_cache_while_the_puts_of_an_earlier_save_still_wait_on_the_pool(device):
    shape = SHAPES["block_major"]
    value = make_io(device, shape, None, seed=1)[0].value_bytes(EVERY_LAYER)
    saver, src, backend = make_io(device, shape, None, seed=1, staging=3 * value)
    gate, first, second = gated_puts(backend), [], []
    earlier, later = CopyHandoff(), CopyHandoff()
    saver.begin_save(refs([1, 2]), EVERY_LAYER, saver.device.record(), earlier, 0, first.append)
    saver.begin_save(refs([3], tag="c"), EVERY_LAYER, saver.device.record(), later, 0, second.append)
    assert earlier.wait(0) and later.wait(0)  # both out of the cache, though nothing is put yet
    assert first == second == []
    gate.set()
    saver.drain()
    assert first == [[Status.OK] * 2] and second == [[Status.OK]]
    saver.close()


@pytest.mark.parametrize("device", STAGING_DEVICES)
def test_a_save_whose_staging_earlier_puts_still_hold_is_dropped_without_waiting(device, monkeypatch):
    shape = SHAPES["block_major"]
    value = make_io(device, shape, None, seed=1)[0].value_bytes(EVERY_LAYER)
    saver, _, backend = make_io(device, shape, None, seed=1, staging=2 * value)
    asked, allocate = [], StagingBuffer.allocate
    monkeypatch.setattr(StagingBuffer, "allocate",
                        lambda self, nbytes, timeout: (asked.append(timeout), allocate(self, nbytes, timeout))[1])
    gate, first, second = gated_puts(backend), [], []
    saver.begin_save(refs([1, 2]), EVERY_LAYER, saver.device.record(), CopyHandoff(), 0, first.append)
    handoff = CopyHandoff()
    saver.begin_save(refs([3], tag="c"), EVERY_LAYER, saver.device.record(), handoff, 0, second.append)
    assert handoff.wait(0) and asked[-1] == 0  # the staging was asked for without waiting
    gate.set()
    saver.drain()
    assert first == [[Status.OK] * 2] and second == [[Status.DROPPED]]
    assert backend.batch_exists(saver.keys(refs([3], tag="c"), EVERY_LAYER)) == [False]
    saver.close()


def test_batches_split_into_chunks_keep_every_block_and_every_status(device_and_shape, monkeypatch):
    from vllm_aio.connector.worker.block_io import base

    monkeypatch.setattr(base, "_CHUNK_BYTES", 1)  # one value per chunk
    device, shape = device_and_shape
    saver, src, backend = make_io(device, shape, None, seed=1)
    assert saver.save(refs([3, 7, 1, 2]), EVERY_LAYER, saver.device.record(), CopyHandoff()) == [Status.OK] * 4
    loader, dst, _ = make_io(device, shape, backend, seed=2)
    wanted = refs([0, 5, 9, 11])
    wanted[2] = BlockRef(9, b"never stored")  # a hole in the middle of the batch
    assert loaded(loader, wanted, EVERY_LAYER) == [Status.OK, Status.OK, Status.MISSING, Status.OK]
    def blocks(t, ids):
        return t[ids] if len(shape) == 4 else t[:, ids]
    for n in LAYERS:
        assert torch.equal(blocks(dst[n], [0, 5, 11]), blocks(src[n], [3, 7, 2]))


class DistinctKeysOnly(LocalBackend):
    """The embedded pool, refusing what Mooncake mishandles: one key twice in a batch.

    Mooncake's ``batch_get_into`` answers success for both occurrences of a
    repeated key and writes only one destination; a batch reaching a backend
    must name each key once.
    """

    def batch_get(self, keys, segments):
        assert len(set(keys)) == len(keys), "a key repeated within one get batch"
        return super().batch_get(keys, segments)

    def batch_put(self, keys, segments, retention=0):
        assert len(set(keys)) == len(keys), "a key repeated within one put batch"
        return super().batch_put(keys, segments, retention)


def shared_prefix_refs(block_ids, hashes):
    return [BlockRef(b, h) for b, h in zip(block_ids, hashes)]


@pytest.mark.parametrize("unit", [EVERY_LAYER, LAYER_1], ids=["every_layer", "one_layer"])
def test_blocks_sharing_a_key_in_one_load_all_receive_its_value(device_and_shape, unit):
    device, shape = device_and_shape
    probe, _, _ = make_io(device, shape, None, seed=1)
    backend = DistinctKeysOnly(f"io-{uuid.uuid4().hex[:8]}", 1 << 22, probe.value_bytes(unit), seal=True)
    saver, src, _ = make_io(device, shape, backend, seed=1)
    assert saver.save(refs([3, 7]), unit, saver.device.record(), CopyHandoff()) == [Status.OK] * 2
    loader, dst, _ = make_io(device, shape, backend, seed=2)
    # Two requests with the same two-block prefix, loaded in one step into blocks of their own.
    wanted = shared_prefix_refs([0, 5, 9, 11], [b"b0", b"b1", b"b0", b"b1"])
    assert loaded(loader, wanted, unit) == [Status.OK] * 4
    def blocks(t, ids):
        return t[ids] if len(shape) == 4 else t[:, ids]
    for i in unit.layers:
        n = LAYERS[i]
        assert torch.equal(blocks(dst[n], [0, 5, 9, 11]), blocks(src[n], [3, 7, 3, 7]))


def test_a_shared_key_that_fails_fails_for_every_block_naming_it(device_and_shape):
    device, shape = device_and_shape
    probe, _, _ = make_io(device, shape, None, seed=1)
    backend = DistinctKeysOnly(f"io-{uuid.uuid4().hex[:8]}", 1 << 22, probe.value_bytes(EVERY_LAYER), seal=True)
    saver, _, _ = make_io(device, shape, backend, seed=1)
    saver.save(refs([3]), EVERY_LAYER, saver.device.record(), CopyHandoff())
    loader, _, _ = make_io(device, shape, backend, seed=2)
    wanted = shared_prefix_refs([0, 5, 9, 11], [b"b0", b"gone", b"b0", b"gone"])
    assert loaded(loader, wanted, EVERY_LAYER) == [Status.OK, Status.MISSING, Status.OK, Status.MISSING]


def test_blocks_sharing_a_key_in_one_save_are_put_once(device_and_shape):
    device, shape = device_and_shape
    probe, _, _ = make_io(device, shape, None, seed=1)
    backend = DistinctKeysOnly(f"io-{uuid.uuid4().hex[:8]}", 1 << 22, probe.value_bytes(EVERY_LAYER), seal=True)
    saver, _, _ = make_io(device, shape, backend, seed=1)
    batch = shared_prefix_refs([3, 7, 9, 10], [b"b0", b"b1", b"b0", b"b1"])
    statuses = saver.save(batch, EVERY_LAYER, saver.device.record(), CopyHandoff())
    assert statuses == [Status.OK, Status.OK, Status.EXISTS, Status.EXISTS]
    assert backend.pool.usage().num_ready == 2


DIRECT_DEVICES = [d for d in DEVICES if d.endswith("+direct")]


@pytest.mark.parametrize("device", DIRECT_DEVICES)
def test_a_slot_rewritten_after_a_direct_load_began_is_reported_corrupt(device):
    shape = SHAPES["kv_split"]
    value = make_io(device, shape, None, seed=1)[0].value_bytes(EVERY_LAYER)
    backend = LocalBackend(f"io-{uuid.uuid4().hex[:8]}", 2 * value, value, seal=True)  # two slots
    saver, _, _ = make_io(device, shape, backend, seed=1)
    assert saver.save(refs([3, 7]), EVERY_LAYER, saver.device.record(), CopyHandoff()) == [Status.OK] * 2
    loader, _, _ = make_io(device, shape, backend, seed=2)
    result = loader.load(refs([0, 5]), EVERY_LAYER)
    assert result.statuses == [Status.OK, Status.OK]
    # Both slots are evicted and rewritten under other keys before the load has settled.
    assert saver.save(refs([1, 2], tag="other"), EVERY_LAYER, saver.device.record(), CopyHandoff()) == [Status.OK] * 2
    assert result.settle() == [Status.CORRUPT, Status.CORRUPT]


@pytest.mark.parametrize("device", DIRECT_DEVICES)
def test_a_direct_save_that_raises_gives_its_reserved_slot_back(device, monkeypatch):
    shape = SHAPES["kv_split"]
    value = make_io(device, shape, None, seed=1)[0].value_bytes(EVERY_LAYER)
    backend = LocalBackend(f"io-{uuid.uuid4().hex[:8]}", value, value, seal=True)  # one slot
    saver, _, _ = make_io(device, shape, backend, seed=1)
    with monkeypatch.context() as m:
        m.setattr(MappedSlots, "copy_out", lambda *a: (_ for _ in ()).throw(RuntimeError("copy failed")))
        with pytest.raises(RuntimeError, match="copy failed"):
            saver.save(refs([3]), EVERY_LAYER, saver.device.record(), CopyHandoff())
    # Had the slot stayed reserved, the pool would have no room for this one.
    assert saver.save(refs([1]), EVERY_LAYER, saver.device.record(), CopyHandoff()) == [Status.OK]


@pytest.mark.parametrize("device", DIRECT_DEVICES)
def test_slots_in_runs_move_by_dma_byte_for_byte(device, monkeypatch):
    from vllm_aio.connector.worker.block_io import mapped_slots

    monkeypatch.setattr(mapped_slots, "_MIN_DMA_BYTES", 1)  # every run worth a DMA (accelerators)
    shape = SHAPES["kv_split"]
    saver, src, backend = make_io(device, shape, None, seed=1)
    # Saved together: consecutive slots, one run; the load's second half is another run.
    assert saver.save(refs([3, 7, 1, 2, 9, 4]), EVERY_LAYER, saver.device.record(), CopyHandoff()) == [Status.OK] * 6
    loader, dst, _ = make_io(device, shape, backend, seed=2)
    wanted = refs([0, 5, 11, 6, 8, 10])
    assert loaded(loader, wanted[3:] + wanted[:3], EVERY_LAYER) == [Status.OK] * 6
    for n in LAYERS:
        assert torch.equal(dst[n][:, [0, 5, 11, 6, 8, 10]], src[n][:, [3, 7, 1, 2, 9, 4]])


def test_renamed_io_keys_saves_and_loads_under_the_new_namespace(device_and_shape):
    """A new weight version: values stored before stay under the old keys, never loaded after."""
    device, shape = device_and_shape
    saver, _, backend = make_io(device, shape, None, seed=1)
    saver.save(refs([3]), EVERY_LAYER, saver.device.record(), CopyHandoff())
    old_key = saver.keys(refs([3]), EVERY_LAYER)[0]
    saver.rename("fedcba9876543210")
    assert saver.namespace_digest == "fedcba9876543210"
    assert saver.keys(refs([3]), EVERY_LAYER)[0] == old_key.replace("0123456789abcdef", "fedcba9876543210")
    assert loaded(saver, refs([5]), EVERY_LAYER) == [Status.MISSING]
    assert saver.save(refs([3]), EVERY_LAYER, saver.device.record(), CopyHandoff()) == [Status.OK]
    assert loaded(saver, refs([5]), EVERY_LAYER) == [Status.OK]


class WithoutSlots(LocalBackend):
    """The embedded pool hiding its slots: a backend the device cannot map, as Mooncake and Memcache are."""

    def slots(self):
        return None


def opened(device: str, backend: LocalBackend) -> BlockIO:
    caches = {n: torch.zeros(SHAPES["kv_split"], dtype=torch.bfloat16, device=device) for n in LAYERS}
    header = EntryHeader("0123456789abcdef", "pp0.dcp0.h0", -1, 16, 0)
    return open_block_io(caches, LAYERS, NUM_BLOCKS, backend, header, 1 << 20, 5.0)


@pytest.mark.parametrize("device", ["cpu", *CUDA])
def test_open_block_io_moves_values_through_the_pools_slots_where_the_device_maps_them(device):
    io = opened(device, LocalBackend(f"io-{uuid.uuid4().hex[:8]}", 1 << 22, 1 << 16, seal=True))
    assert isinstance(io, DirectPath) and io.direct


def test_open_block_io_without_slots_copies_into_a_host_cache_in_place():
    io = opened("cpu", WithoutSlots(f"io-{uuid.uuid4().hex[:8]}", 1 << 22, 1 << 16, seal=True))
    assert isinstance(io, InPlacePath) and not io.direct


@pytest.mark.parametrize("device", CUDA)
def test_open_block_io_without_slots_stages_values_for_a_device_cache(device):
    io = opened(device, WithoutSlots(f"io-{uuid.uuid4().hex[:8]}", 1 << 22, 1 << 16, seal=True))
    assert isinstance(io, StagedPath) and not io.direct
