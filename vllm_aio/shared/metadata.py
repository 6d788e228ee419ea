"""What the scheduler half tells the worker half each step (pickled across processes).

Plain dataclasses, importing neither vLLM nor torch: the scheduler half builds
them in vLLM's engine-core process and every worker reads them. vLLM passes
the step's metadata through without looking inside (its ``KVConnectorMetadata``
is an empty marker class).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class BlockTransfer:
    """Blocks of one request to move between vLLM's KV cache and the pool.

    Compact on the wire, because each step's metadata is pickled to every
    worker and a 128k-token prompt is 8,192 blocks: the block ids travel as
    one int32 array and the hashes as one ``bytes`` (vLLM's block hashes all
    have one size), not as a Python object per block. Build it with ``of``.
    """

    req_id: str
    block_ids: array  # of "i": vLLM block ids (the request's only KV cache group)
    hashes: bytes  # vLLM's chained hash of each block, concatenated in the same order
    first_index: int  # position of block_ids[0] in the request: decides its owner rank
    retention: int = 0  # saves: the request's retention class (from its priority, ``priority_cutoffs``)
    # Saves: the blocks loaded in this step that the request's forward reads. If one of them
    # fails to load, the KV the request computes is wrong and is not saved (``connector/worker/loads.py`` ``StepLoads``).
    reads: array = field(default_factory=lambda: array("i"))

    @classmethod
    def of(
        cls, req_id: str, block_ids: Sequence[int], block_hashes: Sequence[bytes], first_index: int,
        retention: int = 0,
    ) -> BlockTransfer:
        if len(block_ids) != len(block_hashes):
            raise ValueError(f"{len(block_ids)} block ids but {len(block_hashes)} hashes")
        if len({len(h) for h in block_hashes}) > 1:
            raise ValueError("the block hashes of one transfer must all have one size")
        return cls(req_id, array("i", block_ids), b"".join(block_hashes), first_index, retention)

    def __len__(self) -> int:
        return len(self.block_ids)

    def block_hash(self, i: int) -> bytes:
        size = len(self.hashes) // len(self.block_ids)
        return self.hashes[i * size : (i + 1) * size]

    @property
    def block_hashes(self) -> list[bytes]:
        return [self.block_hash(i) for i in range(len(self.block_ids))]


@dataclass
class LookupCounts:
    """Pool lookups of requests admitted since the previous step, and promised hits that failed."""

    hit_tokens: int = 0
    miss_tokens: int = 0
    # Hit tokens of earlier steps whose load failed (vLLM recomputed them).
    failed_hit_tokens: int = 0


@dataclass
class BufferStep:
    """What one step needs from the dynamic buffer (``buffer/layer_buffer.py``)."""

    resident: list[int] = field(default_factory=list)  # blocks holding K/V from before the step (loaded)
    written: list[int] = field(default_factory=list)  # blocks the step writes new K/V into (written back)
    # Blocks kept on the device in every layer (``buffer/residency.py``): (block id, private slot). Never in
    # ``resident``; those in ``written`` are written back from their private place.
    pinned: list[tuple[int, int]] = field(default_factory=list)
    promoted: list[int] = field(default_factory=list)  # pinned blocks filled from the host copy this step
    zeroed: list[int] = field(default_factory=list)  # new blocks vLLM zeroes before the step
    copies: list[tuple[int, int]] = field(default_factory=list)  # vLLM's copy-on-write (src, dst)


@dataclass
class AioConnectorMetadata:
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    # Blocks of requests preempted at this step's scheduling: saved before the
    # step writes the KV cache, since vLLM may give them to another request now.
    rescues: list[BlockTransfer] = field(default_factory=list)
    lookups: LookupCounts = field(default_factory=LookupCounts)
    buffer: BufferStep | None = None  # with transfer_mode dynamic_buffer
    # The key namespace of this step's loads and saves: it changes at runtime
    # with the weight version (``PoolKeying.set_weight_version``).
    namespace_digest: str = ""


@dataclass(frozen=True)
class WorkerFacts:
    """What a worker knows once its model is built and the scheduler's process cannot derive: sent
    once at start, through vLLM's connector handshake (``get_handshake_metadata`` on each worker,
    ``set_xfer_handshake_metadata`` on the scheduler), before any request is scheduled."""

    # The KV cache layout its attention backend required ("NHD", "HND"). Before vLLM 0.32 the
    # config does not record it, and the scheduler's process, which builds no attention layer,
    # derives the default where a backend asked for another (CPU attention and FlashInfer: HND).
    kv_layout: str
