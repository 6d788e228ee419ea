"""Moves one batch of blocks, for one value unit, between the KV cache and the pool.

``open_block_io`` picks one of three data paths once, for the worker's
cache and backend:

* ``DirectPath`` (``direct.py``): the backend keeps values in slots of a host
  mapping the device can map (the embedded pool on the CPU and on CUDA);
  values move straight between the slots and the cache;
* ``HostCachePath`` (``host_cache.py``): the KV cache is host memory (CPU)
  and the backend copies into and out of it;
* ``StagedPath`` (``staged.py``): an accelerator's cache with a pool it cannot
  map (Mooncake, Memcache); values pass through page-locked staging.

Each is a ``BlockIO`` (``base.py``): what callers hold, whichever path runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vllm_aio.backends import Backend
from vllm_aio.connector.block_io.base import BlockIO, CopyHandoff, Loaded
from vllm_aio.connector.block_io.blocks import Batch, BlockRef, DistinctBlocks
from vllm_aio.connector.block_io.direct import DirectPath
from vllm_aio.connector.block_io.host_cache import HostCachePath
from vllm_aio.connector.block_io.labels import ValueLabels
from vllm_aio.connector.block_io.staged import StagedPath
from vllm_aio.connector.block_layout import BlockLayout, LayerCache
from vllm_aio.connector.mapped_slots import MappedSlots
from vllm_aio.connector.staging import StagingBuffer
from vllm_aio.device import Device
from vllm_aio.pool.entry import EntryHeader

__all__ = [
    "Batch", "BlockIO", "BlockRef", "CopyHandoff", "DirectPath", "DistinctBlocks", "HostCachePath", "Loaded",
    "StagedPath", "ValueLabels", "open_block_io",
]


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
    for the device. Otherwise one staging buffer per direction (page-locked on
    accelerators), and the memory the backend will copy between registered
    with it once: the staging buffers, and on the CPU the KV cache itself,
    which the backend reads and writes in place. The worker, the tests and the
    benchmarks all build their ``BlockIO`` here.
    """
    layout = BlockLayout(kv_caches, layer_names, num_blocks)
    device = Device(layout.device)
    labels = ValueLabels(header, layout)
    slots = MappedSlots.open(backend.slots(), layout, device)
    if slots is not None:
        return DirectPath(labels, device, slots)
    loads, saves = StagingBuffer(device, staging_bytes), StagingBuffer(device, staging_bytes)
    spans = layout.memory_spans() if device.is_host else []
    for address, size in spans + [(s.address, s.capacity) for s in (loads, saves)]:
        backend.register_memory(address, size)
    path = HostCachePath if device.is_host else StagedPath
    return path(labels, device, layout, backend, loads, saves, timeout)
