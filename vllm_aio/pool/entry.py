"""The header in front of every stored value: whose bytes these are.

A key already names the namespace, shard and block, but a key is only a
promise: a pool shared between deployments, a slot reused under another key,
a writer with a different layout or a rank loading another rank's shard would
all hand back bytes of the right length and the wrong meaning, and attention
would read them silently (the SGLang incident: reloaded
pages landed on the wrong owner). So every value starts with a fixed header
naming what the writer stored, and a reader accepts a value only when the
header equals the one it would have written itself for that key; otherwise the
block is a load error and vLLM recomputes it.

Layout (64 bytes, little endian): magic, the namespace digest (model, dtypes,
block size, KV layout, attention ISA, parallel shape, salt), the owning shard,
the layer (-1: every layer), block size in tokens, payload bytes, and the
first 8 bytes of the block hash.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

HEADER_BYTES = 64
HASH_PREFIX_BYTES = 8  # the header's last field: the first bytes of the block hash
NAMESPACE_PREFIX_BYTES = 20  # magic and namespace digest, the header's first fields
_MAGIC = b"vaio"
_SHARD_BYTES = 24
_FORMAT = f"<4s16s{_SHARD_BYTES}siII{HASH_PREFIX_BYTES}s"
assert struct.calcsize(_FORMAT) == HEADER_BYTES


@dataclass(frozen=True)
class EntryHeader:
    namespace_digest: str  # 16 hex characters
    shard: str  # the owner's shard id, e.g. "pp0.dcp0.h1" (pool/ownership.py)
    layer: int  # -1 when the value holds every layer
    block_size: int
    payload_bytes: int

    def __post_init__(self) -> None:
        if len(self.shard.encode()) > _SHARD_BYTES:
            raise ValueError(f"shard id {self.shard!r} is longer than {_SHARD_BYTES} bytes")

    def pack(self, block_hash: bytes) -> bytes:
        return struct.pack(
            _FORMAT,
            _MAGIC,
            self.namespace_digest.encode(),
            self.shard.encode(),
            self.layer,
            self.block_size,
            self.payload_bytes,
            block_hash[:8],
        )


def namespace_prefix(namespace_digest: str) -> bytes:
    """The bytes every value stored under ``namespace_digest`` starts with (NAMESPACE_PREFIX_BYTES of them)."""
    return _MAGIC + namespace_digest.encode().ljust(16, b"\0")[:16]


def namespace_of(prefix: bytes) -> str | None:
    """The namespace digest a value's first NAMESPACE_PREFIX_BYTES name; None for a value with no header."""
    if prefix[:4] != _MAGIC:
        return None
    return prefix[4:NAMESPACE_PREFIX_BYTES].rstrip(b"\0").decode(errors="replace")


def describe(raw: bytes) -> str:
    """What a stored header says, for the log line of a refused value."""
    magic, digest, shard, layer, block_size, payload, _ = struct.unpack(_FORMAT, raw)
    if magic != _MAGIC:
        return "no vllm_aio header"
    owner = shard.rstrip(b"\0").decode(errors="replace")
    return (
        f"namespace={digest.decode(errors='replace')} shard={owner} "
        f"layer={layer} block_size={block_size} payload={payload}"
    )
