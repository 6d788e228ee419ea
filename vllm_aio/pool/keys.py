"""Pool keys: which bytes a key names, so incompatible bytes never meet.

A key is ``aio:{namespace}:{shard}:{block hash}[:L{layer}]``:

* ``namespace`` digests everything that changes the meaning of a block's
  bytes for a whole deployment: model, dtypes, block size, KV layout, the CPU
  attention ISA path (the CPU kernel packs blocks per instruction set), the
  parallel shape, the KV cache group and the user's salt.
* ``shard`` names the bytes one rank holds (``pool/ownership.py``): ranks with
  identical bytes share it; every shard must be present for a block to hit.
* the block hash is vLLM's chained ``request.block_hashes`` entry, so a key
  identifies the whole prefix up to and including that block.
* with layerwise transfer (``use_layerwise``) each layer of a block is a value
  of its own, keyed ``...:{block hash}:L{layer}``.
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
class Unit:
    """The layers one stored value holds: every layer, or one (layerwise)."""

    layers: tuple[int, ...]
    tag: int | None  # the layer named in the key and header; None: every layer


def block_key(namespace_digest: str, shard: str, block_hash: bytes, layer: int | None = None) -> str:
    """The key of a block of every layer, or of one layer (layerwise transfer)."""
    key = f"aio:{namespace_digest}:{shard}:{block_hash.hex()}"
    return key if layer is None else f"{key}:L{layer}"
