"""What the scheduler half tells the worker half each step (pickled across processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from vllm_aio.connector.layer_buffer import BufferStep


@dataclass
class BlockTransfer:
    """Blocks of one request to move between vLLM's KV cache and the pool."""

    req_id: str
    block_ids: list[int]  # vLLM block ids (the request's only KV cache group)
    block_hashes: list[bytes]  # vLLM's chained hash of each block, same order
    first_index: int  # position of block_ids[0] in the request: decides its owner rank


@dataclass
class LookupCounts:
    """Pool lookups of requests admitted since the previous step, and promised hits that failed."""

    hit_tokens: int = 0
    miss_tokens: int = 0
    # Hit tokens of earlier steps whose load failed (vLLM recomputed them).
    failed_hit_tokens: int = 0


@dataclass
class AioConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    lookups: LookupCounts = field(default_factory=LookupCounts)
    buffer: BufferStep | None = None  # with dynamic_buffer_layers
