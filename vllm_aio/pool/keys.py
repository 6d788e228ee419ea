"""Pool keys: which bytes a key names, so incompatible bytes never meet.

A key is ``aio:{namespace}:{shard}:{block hash}[:L{layer}]``:

* ``namespace`` digests everything that changes the meaning of a block's
  bytes for a whole deployment: model, dtypes, block size, KV layout, the CPU
  attention ISA path (the CPU kernel packs blocks per instruction set), the
  parallel shape, a hybrid model's KV cache groups, the user's salt and the weight version
  (RL trainers update weights in place: KV computed under other weights must
  neither hit nor migrate).
* ``shard`` names the bytes one rank holds (``pool/ownership.py``): ranks with
  identical bytes share it; every shard must be present for a block to hit.
* the block hash is vLLM's chained ``request.block_hashes`` entry, so a key
  identifies the whole prefix up to and including that block; a hybrid
  model's groups append their index to it (``group_block_hashes``).
* with layerwise transfer (``transfer_mode: layerwise``) each layer of a block is a value
  of its own, keyed ``...:{block hash}:L{layer}``.

A block is thus stored as several *parts*, one value per shard and unit
(``BlockParts``); it may be loaded instead of recomputed only when every part
is stored. The parts of one block share its *group*: the namespace, the block
hash and whether values hold one layer (``block_of_key``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
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
    weight_version: str = ""
    # Hybrid models: each KV cache group's kind and layers (``deployment._describe_groups``).
    kv_groups: tuple[str, ...] = ()

    def digest(self) -> str:
        fields = asdict(self)
        if not self.kv_groups:  # left out for one group: keys stored before hybrid support still hit
            del fields["kv_groups"]
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Unit:
    """The layers one stored value holds: every layer, or one (layerwise)."""

    layers: tuple[int, ...]
    tag: int | None  # the layer named in the key and header; None: every layer


def group_block_hashes(block_hashes: Sequence[bytes], group: int | None) -> list[bytes]:
    """The hashes a KV cache group's blocks are keyed by.

    vLLM hashes a token prefix once for every group, but each group stores
    other bytes for it: a hybrid model's group index is appended (8 bytes,
    whole words for the pool's record ids), as vLLM's own prefix cache does.
    ``None``: a model of one group, keyed by the hash alone.
    """
    if group is None:
        return list(block_hashes)
    suffix = group.to_bytes(8, "big")
    return [h + suffix for h in block_hashes]


def block_key(namespace_digest: str, shard: str, block_hash: bytes, layer: int | None = None) -> str:
    """The key of a block of every layer, or of one layer (layerwise transfer)."""
    key = f"aio:{namespace_digest}:{shard}:{block_hash.hex()}"
    return key if layer is None else f"{key}:L{layer}"


def parse_block_key(key: str) -> tuple[str, str, int | None, bytes] | None:
    """(namespace digest, shard, layer tag, block hash) of a block key; None for any other key."""
    fields = key.split(":")
    if fields[0] != "aio" or len(fields) not in (4, 5):
        return None
    if len(fields) == 5 and not (fields[4][:1] == "L" and fields[4][1:].isdigit()):
        return None
    try:
        block_hash = bytes.fromhex(fields[3])
    except ValueError:
        return None
    return fields[1], fields[2], int(fields[4][1:]) if len(fields) == 5 else None, block_hash


def block_of_key(key: str) -> tuple[str, bool, bytes] | None:
    """(namespace digest, one layer per value, block hash) of a block key; None for any other key."""
    fields = key.split(":")
    if fields[0] != "aio" or len(fields) not in (4, 5):
        return None
    try:
        block_hash = bytes.fromhex(fields[3])
    except ValueError:
        return None
    return fields[1], len(fields) == 5, block_hash


@dataclass(frozen=True)
class BlockParts:
    """What each block of a deployment is stored as: one value per shard and unit."""

    namespace_digest: str
    shards: tuple[str, ...]  # every distinct shard of the deployment (``Ownership.all_shard_ids``)
    tags: tuple[int | None, ...]  # the units' tags, in layer order: (None,) for whole blocks

    @property
    def count(self) -> int:
        return len(self.shards) * len(self.tags)

    @property
    def layered(self) -> bool:
        return self.tags[0] is not None

    def keys(self, block_hash: bytes) -> list[str]:
        return [block_key(self.namespace_digest, s, block_hash, t) for s in self.shards for t in self.tags]

    def probe_keys(self, hashes: Sequence[bytes]) -> list[str]:
        """One part standing for each block, for stores that cannot answer per block.

        The last unit, because layerwise saves store layers in order (its
        presence says the earlier layers of that rank were put before it), and
        the shard rotating with the block's position, so a rank whose saves
        fail is caught within a few blocks instead of never.
        """
        digest, shards, tag = self.namespace_digest, self.shards, self.tags[-1]
        return [block_key(digest, shards[i % len(shards)], h, tag) for i, h in enumerate(hashes)]
