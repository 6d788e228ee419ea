"""What the scheduler half tells the worker half each step (pickled across processes).

Plain dataclasses, importing neither vLLM nor torch: the scheduler half builds
them in vLLM's engine-core process and every worker reads them. vLLM passes
the step's metadata through without looking inside (its ``KVConnectorMetadata``
is an empty marker class).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
class BufferStep:
    """What one step needs from the dynamic buffer (``layer_buffer.py``)."""

    resident: list[int] = field(default_factory=list)  # blocks holding K/V from before the step (loaded)
    written: list[int] = field(default_factory=list)  # blocks the step writes new K/V into (written back)
    zeroed: list[int] = field(default_factory=list)  # new blocks vLLM zeroes before the step
    copies: list[tuple[int, int]] = field(default_factory=list)  # vLLM's copy-on-write (src, dst)


@dataclass
class AioConnectorMetadata:
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    lookups: LookupCounts = field(default_factory=LookupCounts)
    buffer: BufferStep | None = None  # with dynamic_buffer_layers
