"""The dynamic buffer as one participant of the worker's per-step hooks, chosen once at registration.

``open_buffer`` answers ``NoBuffer`` (every layer resident on the device) or
``BufferHooks`` over a ``LayerBuffer``; either tells the pool which caches it
moves blocks to and from (the device's, or the buffer's host copy of every layer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm_aio import vllm_compat
from vllm_aio.buffer.layer_buffer import LayerBuffer
from vllm_aio.buffer.remap import check_backends
from vllm_aio.log import get_logger
from vllm_aio.shared.deployment import Deployment
from vllm_aio.shared.metadata import AioConnectorMetadata

logger = get_logger(__name__)


class BufferHooks:
    """The buffer's hooks. Each runs only in steps the scheduler planned for the buffer (vLLM also
    runs forwards without the connector's metadata, e.g. to profile)."""

    def __init__(self, buffer: LayerBuffer, layer_names: Sequence[str]) -> None:
        self.buffer = buffer
        self._index = {name: i for i, name in enumerate(layer_names)}

    @property
    def pool_caches(self) -> tuple[Mapping[str, torch.Tensor], int]:
        """What the pool moves blocks to and from: vLLM's blocks of the host copy (not the private ones)."""
        return self.buffer.host_caches, self.buffer.num_blocks

    def begin_step(self, meta: AioConnectorMetadata, forward_context: object = None) -> None:
        if meta.buffer is not None:
            self.buffer.begin_step(meta.buffer, forward_context)

    def after_layer(self, layer_name: str, meta: AioConnectorMetadata) -> None:
        if meta.buffer is not None and layer_name in self._index:
            layer = self._index[layer_name]
            self.buffer.layer_done(layer)
            self.buffer.before_layer(layer + 1)

    def end_step(self, meta: AioConnectorMetadata) -> None:
        if meta.buffer is not None:
            self.buffer.end_step()  # saves read the host copy after this

    def close(self) -> None:
        self.buffer.close()


class NoBuffer:
    """Every layer resident on the device: the hooks have nothing to do."""

    def __init__(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        self.pool_caches = (kv_caches, num_blocks)

    def begin_step(self, meta: AioConnectorMetadata, forward_context: object = None) -> None:
        pass

    def after_layer(self, layer_name: str, meta: AioConnectorMetadata) -> None:
        pass

    def end_step(self, meta: AioConnectorMetadata) -> None:
        pass

    def close(self) -> None:
        pass


def open_buffer(dep: Deployment, staging_bytes: int, kv_caches: Mapping[str, Any], num_blocks: int,
                vllm_config: Any = None) -> BufferHooks | NoBuffer:
    """The buffer's participant for the registered ``kv_caches``: refuses, here at start, a vLLM
    without the internals it needs and attention backends its resident blocks cannot remap
    (``vllm_config``: where the attention layers are found)."""
    if not dep.buffer_count:
        return NoBuffer(kv_caches, num_blocks)
    vllm_compat.require_buffer_internals("transfer_mode dynamic_buffer")
    if dep.resident_blocks:
        check_backends(vllm_compat.attention_backends(vllm_config, kv_caches))
    buffer = LayerBuffer(kv_caches, dep.layer_names, num_blocks, dep.buffer_count, staging_bytes,
                         resident_blocks=dep.resident_blocks, block_tokens=dep.block_size)
    logger.info(
        "vllm_aio: dynamic buffer: %d layers on %d device buffers; host copy of every layer %.2f GiB%s",
        len(dep.layer_names), dep.buffer_count, buffer.host_bytes / 2**30,
        "" if buffer.device.is_host else " (page-locked)",
    )
    return BufferHooks(buffer, dep.layer_names)
