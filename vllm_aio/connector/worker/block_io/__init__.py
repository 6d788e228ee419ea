"""Moves one batch of blocks, for one value unit, between the KV cache and the pool.

``open_block_io`` picks one of three data paths once, for the worker's
cache and backend:

* ``DirectPath`` (``direct.py``): the backend keeps values in slots of a host
  mapping the device can map (the embedded pool on the CPU and on CUDA);
  values move straight between the slots and the cache;
* ``InPlacePath`` (``in_place.py``): the backend copies into and out of the
  KV cache's own memory: a host cache (CPU), or a device cache where the
  backend moves device memory itself (device-direct: Mooncake's Ascend
  transport, Memcache's memory-owning client);
* ``StagedPath`` (``staged.py``): an accelerator's cache with a pool that can
  neither be mapped nor move device memory; values pass through page-locked
  staging.

Each is a ``BlockIO`` (``base.py``): what callers hold, whichever path runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vllm_aio.backends import Backend, Memory
from vllm_aio.connector.worker.block_io.base import BlockIO, CopyHandoff, Loaded, chunk_rows
from vllm_aio.connector.worker.block_io.blocks import Batch, BlockRef, DistinctBlocks
from vllm_aio.connector.worker.block_io.direct import DirectPath
from vllm_aio.connector.worker.block_io.in_place import InPlacePath
from vllm_aio.connector.worker.block_io.labels import ValueLabels
from vllm_aio.connector.worker.block_io.mapped_slots import MappedSlots
from vllm_aio.connector.worker.block_io.staged import StagedPath
from vllm_aio.device.accelerator import Device
from vllm_aio.device.block_layout import BlockLayout, LayerCache
from vllm_aio.device.staging import StagingBuffer
from vllm_aio.log import get_logger
from vllm_aio.pool.entry import HEADER_BYTES, EntryHeader

__all__ = [
    "Batch", "BlockIO", "BlockRef", "CopyHandoff", "DirectPath", "DistinctBlocks", "InPlacePath", "Loaded",
    "StagedPath", "ValueLabels", "open_block_io",
]

logger = get_logger(__name__)


def open_block_io(
    kv_caches: Mapping[str, LayerCache],
    layer_names: Sequence[str],
    num_blocks: int,
    backend: Backend,
    header: EntryHeader,
    staging_bytes: int,
    timeout: float,
) -> BlockIO:
    """The ``BlockIO`` over these cache tensors, on the one path they and ``backend`` allow.

    The direct path wherever ``MappedSlots.open`` can map the backend's slots
    for the device. Else the in-place path where the backend copies the
    cache's own memory (a host cache; a device cache on a backend whose
    ``segment_memory`` has device memory), its header and save staging in
    that same memory. Else the staged path: one page-locked staging buffer
    per direction. The memory the backend copies between is registered with
    it once, as host or device memory. The worker, the tests and the
    benchmarks all build their ``BlockIO`` here.
    """
    layout = BlockLayout(kv_caches, layer_names, num_blocks)
    device = Device(layout.device)
    labels = ValueLabels(header, layout)
    slots = MappedSlots.open(backend.slots(), layout, device)
    if slots is not None:
        return DirectPath(labels, device, slots)
    if device.is_host or Memory.DEVICE in backend.segment_memory():
        on_device = not device.is_host
        headers = StagingBuffer(device, _header_bytes(layout, staging_bytes), on_device)
        saves = StagingBuffer(device, staging_bytes, on_device)
        _register(backend, layout.memory_spans(), (headers, saves), Memory.DEVICE if on_device else Memory.HOST)
        if on_device:
            logger.info("vllm_aio: device-direct: the KV cache's device memory is registered with %s, values move "
                        "between it and the store without host staging (unverified on an NPU: docs/ascend.md)",
                        type(backend).__name__)
        return InPlacePath(labels, device, layout, backend, headers, saves, timeout)
    loads, saves = StagingBuffer(device, staging_bytes), StagingBuffer(device, staging_bytes)
    _register(backend, [], (loads, saves), Memory.HOST)
    return StagedPath(labels, device, layout, backend, loads, saves, timeout)


def _header_bytes(layout: BlockLayout, staging_bytes: int) -> int:
    """Header staging for two loads' chunks at once (the receiving and the forward thread), each
    of the most values a chunk holds: values of the smallest unit, one layer."""
    smallest = HEADER_BYTES + min(layout.layer_bytes(i) for i in range(len(layout.planes)))
    return min(staging_bytes, 2 * HEADER_BYTES * chunk_rows(smallest))


def _register(backend: Backend, spans: list[tuple[int, int]], buffers: Sequence[StagingBuffer], memory: Memory) -> None:
    for address, size in spans + [(b.address, b.capacity) for b in buffers]:
        backend.register_memory(address, size, memory)
