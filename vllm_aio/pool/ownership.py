"""Which rank stores which KV block, decided identically on every rank.

A rank's KV bytes for one block are named by a *shard id*: its pipeline stage
(layers), its decode-context-parallel rank (token shard) and its KV head
shard. Ranks holding byte-identical KV (heads replicated because the
model has fewer KV heads than TP ranks, or MLA, which counts as one head) share
a shard id, and only one of them must store each block.

That choice must be a fixed split of the request's *full* block list, computed
with no communication and no look at what is already in the pool. vllm-ascend
learned this the hard way (PR #5030): its ranks sliced the block list after a
per-rank "already stored?" query, so replicas saw different lists, disagreed on
who owned which block, and the pool ended up with holes and corrupted data.
Here block ``i`` of a shard is stored by replica ``i % replicas``; block indices
are stable because keys are prefix-chained hashes.

Context parallelism as vLLM 0.32 lays it out (``initialize_model_parallel``
and ``ParallelConfig`` checks): for DCP the ranks of a pipeline stage are
ordered TP-major, PCP-minor, and the DCP groups are consecutive runs of ``dcp_size`` ranks in
that order (vLLM transposes its PCP x TP rank grid to build them), so ``dcp_rank = (tp_rank * pcp_size + pcp_rank) % dcp_size``.
Without PCP that carves DCP out of the TP ranks (``tp_rank % dcp_size``);
with PCP, DCP is 1 (every PCP rank keeps a full replica of the KV cache),
``pcp_size`` (DCP spans the PCP ranks of one TP rank) or ``tp_size x
pcp_size`` (every rank of the stage holds a different token shard). The bytes
a rank holds are therefore named by its stage, its DCP rank and its KV head
shard; the PCP rank is never a shard of its own.
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
        """vLLM's own rules (``ParallelConfig``, ``ModelConfig``), so a rank's DCP rank is known."""
        tp, pcp, dcp = self.tp_size, self.pcp_size, self.dcp_size
        if pcp == 1 and tp % dcp:
            raise ValueError(f"dcp_size={dcp} must divide tp_size={tp}")
        if pcp > 1 and dcp not in (1, pcp, tp * pcp):
            raise ValueError(
                f"dcp_size={dcp} with pcp_size={pcp} must be 1, pcp_size or tp_size x pcp_size ({tp * pcp})"
            )
        if not self.use_mla and dcp > max(1, tp // self.num_kv_heads):
            raise ValueError(
                f"dcp_size={dcp} exceeds tp_size // num_kv_heads (tp_size={tp}, num_kv_heads={self.num_kv_heads})"
            )
        expected = self.dcp_rank_of(self.tp_rank, self.pcp_rank)
        if self.dcp_rank != expected:
            raise ValueError(
                f"dcp_rank={self.dcp_rank} must equal (tp_rank * pcp_size + pcp_rank) % dcp_size = {expected}"
            )

    @property
    def head_replication(self) -> int:
        """TP ranks holding each KV head shard."""
        return self.tp_size if self.use_mla else max(1, self.tp_size // self.num_kv_heads)

    def dcp_rank_of(self, tp_rank: int, pcp_rank: int) -> int:
        """The DCP rank vLLM gives the rank at (tp_rank, pcp_rank) of a stage."""
        return (tp_rank * self.pcp_size + pcp_rank) % self.dcp_size

    def shard_of(self, tp_rank: int, pcp_rank: int) -> tuple[int, int]:
        """(DCP rank, KV head shard index) of the bytes a rank of a stage holds."""
        return self.dcp_rank_of(tp_rank, pcp_rank), tp_rank // self.head_replication


def _shard_id(pp: int, dcp: int, head: int) -> str:
    return f"pp{pp}.dcp{dcp}.h{head}"


class Ownership:
    """Shard naming, block ownership and read order of one rank."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        t = topology
        stage = [(pcp, tp) for pcp in range(t.pcp_size) for tp in range(t.tp_size)]
        mine = t.shard_of(t.tp_rank, t.pcp_rank)
        peers = [(pcp, tp) for pcp, tp in stage if t.shard_of(tp, pcp) == mine]
        self.shard_id: str = _shard_id(t.pp_rank, *mine)
        self.replicas: int = len(peers)
        self.replica_index: int = peers.index((t.pcp_rank, t.tp_rank))
        stage_shards = {t.shard_of(tp, pcp) for pcp, tp in stage}
        self._all_shard_ids = tuple(
            sorted(_shard_id(pp, dcp, head) for pp in range(t.pp_size) for dcp, head in stage_shards)
        )

    def all_shard_ids(self) -> list[str]:
        """Every distinct shard of the deployment, sorted (same on all ranks).

        A block counts as a pool hit only when every one of them is stored: the
        scheduler answers for the whole deployment, and a block skips
        recomputation only if every rank of every pipeline stage can load its part.
        """
        return list(self._all_shard_ids)

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
