"""Pool keys: which bytes a key names, so incompatible bytes never meet.

A key is ``aio:{namespace}:{shard}:{block hash}``:

* ``namespace`` digests everything that changes the meaning of a block's
  bytes for a whole deployment: model, dtypes, block size, KV layout, the CPU
  attention ISA path (the CPU kernel packs blocks per instruction set), the
  parallel shape, the KV cache group and the user's salt.
* ``shard`` names the slice of the block one rank holds (its TP/PCP/DCP/PP
  coordinates); every shard must be present for a block to count as a hit.
* the block hash is vLLM's chained ``request.block_hashes`` entry, so a key
  identifies the whole prefix up to and including that block.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Namespace:
    model: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    kv_layout: str
    attn_isa: str
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    group: int
    salt: str

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RankCoord:
    """Where a rank sits in the parallel layout: what slice of KV it holds."""

    tp: int = 0
    pp: int = 0
    pcp: int = 0
    dcp: int = 0

    @property
    def shard(self) -> str:
        return f"tp{self.tp}.pp{self.pp}.pcp{self.pcp}.dcp{self.dcp}"


def all_rank_coords(ns: Namespace) -> list[RankCoord]:
    """Every rank's coordinates: a block is a hit only if all shards exist."""
    return [
        RankCoord(tp, pp, pcp, dcp)
        for pp in range(ns.pp_size)
        for pcp in range(ns.pcp_size)
        for tp in range(ns.tp_size)
        for dcp in [tp % ns.dcp_size]
    ]


def block_key(namespace_digest: str, shard: str, block_hash: bytes) -> str:
    return f"aio:{namespace_digest}:{shard}:{block_hash.hex()}"
