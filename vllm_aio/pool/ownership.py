"""Which rank stores which KV block, decided identically on every rank.

A rank's KV bytes for one block are named by a *shard id*: its pipeline stage
(layers), its prefill- and decode-context-parallel ranks (token shards) and its
KV head shard. Ranks holding byte-identical KV (heads replicated because the
model has fewer KV heads than TP ranks, or MLA, which counts as one head) share
a shard id, and only one of them must store each block.

That choice must be a fixed split of the request's *full* block list, computed
with no communication and no look at what is already in the pool. vllm-ascend
learned this the hard way (PR #5030): its ranks sliced the block list after a
per-rank "already stored?" query, so replicas saw different lists, disagreed on
who owned which block, and the pool ended up with holes and corrupted data.
Here block ``i`` of a shard is stored by replica ``i % replicas``; block indices
are stable because keys are prefix-chained hashes.

vLLM carves the DCP group out of the TP group (``dcp_rank = tp_rank %
dcp_size``) and uses ranks that would replicate KV heads to hold different
token shards instead; only what remains is true replication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _check_rank(name: str, rank: int, size: int) -> None:
    if size < 1:
        raise ValueError(f"{name}_size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"{name}_rank={rank} out of range for {name}_size={size}")


@dataclass(frozen=True)
class Topology:
    """The parallel layout of one rank, as vLLM reports it."""

    tp_size: int
    tp_rank: int
    num_kv_heads: int  # total in the model; ignored when use_mla
    use_mla: bool
    pcp_size: int = 1
    pcp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "pcp", "dcp", "pp"):
            _check_rank(name, getattr(self, f"{name}_rank"), getattr(self, f"{name}_size"))
        self._check_heads()
        self._check_dcp()

    def _check_heads(self) -> None:
        if self.use_mla:
            return
        heads, tp = self.num_kv_heads, self.tp_size
        if heads < 1:
            raise ValueError(f"num_kv_heads must be >= 1, got {heads}")
        if heads % tp and tp % heads:
            raise ValueError(f"num_kv_heads={heads} and tp_size={tp}: one must divide the other")

    def _check_dcp(self) -> None:
        tp, dcp = self.tp_size, self.dcp_size
        if tp % dcp:
            raise ValueError(f"dcp_size={dcp} must divide tp_size={tp}")
        if self.dcp_rank != self.tp_rank % dcp:
            raise ValueError(
                f"dcp_rank={self.dcp_rank} must equal tp_rank % dcp_size = {self.tp_rank % dcp}"
            )
        if dcp > self.head_replication:
            raise ValueError(
                f"dcp_size={dcp} exceeds the KV head replication factor "
                f"{self.head_replication} (tp_size={tp}, num_kv_heads={self.num_kv_heads}, "
                f"use_mla={self.use_mla})"
            )

    @property
    def head_replication(self) -> int:
        """TP ranks holding each KV head shard (before DCP splits them)."""
        return self.tp_size if self.use_mla else max(1, self.tp_size // self.num_kv_heads)

    def tp_shard(self, tp_rank: int) -> tuple[int, int]:
        """(dcp rank, KV head shard index) of the bytes a TP rank holds."""
        return tp_rank % self.dcp_size, tp_rank // self.head_replication


def _shard_id(pp: int, pcp: int, dcp: int, head: int) -> str:
    return f"pp{pp}.pcp{pcp}.dcp{dcp}.h{head}"


class Ownership:
    """Shard naming, block ownership and read order of one rank."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        t = topology
        mine = t.tp_shard(t.tp_rank)
        peers = [r for r in range(t.tp_size) if t.tp_shard(r) == mine]
        self.shard_id: str = _shard_id(t.pp_rank, t.pcp_rank, *mine)
        self.replicas: int = len(peers)
        self.replica_index: int = peers.index(t.tp_rank)
        tp_shards = {t.tp_shard(r) for r in range(t.tp_size)}
        self._all_shard_ids = tuple(
            sorted(
                _shard_id(pp, pcp, dcp, head)
                for pp in range(t.pp_size)
                for pcp in range(t.pcp_size)
                for dcp, head in tp_shards
            )
        )

    def all_shard_ids(self) -> list[str]:
        """Every distinct shard of the deployment, sorted (same on all ranks)."""
        return list(self._all_shard_ids)

    def hit_shard_ids(self) -> list[str]:
        """Shards whose keys must all exist for a block to count as a hit.

        The scheduler answers for the whole deployment: a block skips
        recomputation only if every rank of every pipeline stage can load its
        part, so this is every shard, not just this rank's stage.
        """
        return self.all_shard_ids()

    def stores(self, block_index: int) -> bool:
        """Whether this rank writes the block (fixed split over replicas)."""
        return block_index % self.replicas == self.replica_index

    def owned_blocks(self, blocks: int | range) -> list[int]:
        """The blocks, of ``range(blocks)`` or the given range, this rank stores."""
        block_range = range(blocks) if isinstance(blocks, int) else blocks
        return [i for i in block_range if self.stores(i)]

    def read_order(self, block_indices: Sequence[int]) -> list[int]:
        """The blocks rotated so replicas start reading at different places."""
        start = self.replica_index * len(block_indices) // self.replicas
        return list(block_indices[start:]) + list(block_indices[:start])
