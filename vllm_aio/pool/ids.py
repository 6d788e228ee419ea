"""The 128-bit ids the embedded pool is keyed by, mixed from keys and block hashes.

The pool (``host_pool.py``) knows no strings: its hash index is keyed by a
value's id, its block records by a block's record id, each two int64 words.
This module is the one place those ids are made:

* ``value_ids``: the id of each block key ``block_key(namespace, shard, hash,
  tag)`` (``pool/keys.py``), mixed from the hashes' bytes without building the
  keys (what the direct path and the scheduler's leases ask about);
* ``key_ids``: the id of any string key; a block key gets its ``value_ids``,
  so a reader holding only the hashes finds what a writer stored by key;
* ``namespace_groups``/``key_groups``: the record id of each value's block,
  shared by every shard and layer of that block, which the pool counts.

Mixing runs in compiled code (``index_ops.mixed_ids``), a batch at a time:
a prompt's thousands of blocks cost no hash call per block.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_aio.pool import index_ops
from vllm_aio.pool.keys import block_of_key, parse_block_key

_U64 = np.dtype("<u8")


@dataclass(frozen=True)
class ValueIds:
    """Index ids of values (``value_ids``, ``key_ids``): two int64 columns."""

    hi: np.ndarray
    lo: np.ndarray

    def __len__(self) -> int:
        return len(self.lo)

    @classmethod
    def concat(cls, parts: Sequence["ValueIds"]) -> "ValueIds":
        return cls(np.concatenate([p.hi for p in parts]), np.concatenate([p.lo for p in parts]))


@dataclass(frozen=True)
class BlockGroups:
    """Record ids of blocks (``namespace_groups``): two int64 columns, ``hi`` never 0 (0: no record)."""

    hi: np.ndarray
    lo: np.ndarray


@functools.lru_cache(maxsize=64)  # a pool sees a handful of namespaces; reserve asks per key
def _group_salt(namespace_digest: str, layered: bool) -> np.ndarray:
    digest = hashlib.blake2b(f"{namespace_digest}:{int(layered)}".encode(), digest_size=16).digest()
    return np.frombuffer(digest, dtype=_U64)


@functools.lru_cache(maxsize=4096)  # (namespace, shard, unit): a few hundred per deployment
def _value_salt(namespace_digest: str, shard: str, tag: int | None) -> np.ndarray:
    text = f"value:{namespace_digest}:{shard}:{'' if tag is None else tag}"
    return np.frombuffer(hashlib.blake2b(text.encode(), digest_size=16).digest(), dtype=_U64)


def _mixed(salt: np.ndarray, hashes: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Two 64-bit ids per hash from its bytes and ``salt`` (``(2,)``), with no hash call.

    Every word of the hash goes through splitmix64's finaliser in turn
    (``index_ops.mixed_ids``; an xor fold would let hashes with structure
    collide: equal or swapped words), with the hash's length in the seed.
    Grouped by length, so an id never depends on the other hashes of the
    batch (vLLM's are all one size).
    """
    lengths = set(map(len, hashes))
    if len(lengths) == 1 and (size := lengths.pop()) % 8 == 0:
        # The common case, in plain Python and compiled code only: numpy's sort
        # (``np.unique``) releases the GIL, and getting it back can wait long.
        return _mixed_words(salt, size, b"".join(hashes), len(hashes))
    sizes = np.fromiter(map(len, hashes), dtype=np.int64, count=len(hashes))
    hi, lo = np.zeros(len(hashes), dtype=np.uint64), np.zeros(len(hashes), dtype=np.uint64)
    for size in np.unique(sizes).tolist():
        at = np.flatnonzero(sizes == size)
        width = -(-size // 8) * 8
        raw = b"".join(hashes[i].ljust(width, b"\0") for i in at.tolist())
        hi[at], lo[at] = _mixed_words(salt, size, raw, len(at))
    return hi, lo


def _mixed_words(salt: np.ndarray, size: int, raw: bytes, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``_mixed`` of ``count`` hashes of ``size`` bytes, zero-padded to whole words in ``raw``."""
    words = np.frombuffer(raw, dtype=_U64).reshape(count, -1)
    return index_ops.mixed_ids(words, salt[0] ^ np.uint64(size), salt[1] ^ np.uint64(size << 32))


def namespace_groups(namespace_digest: str, layered: bool, hashes: Sequence[bytes]) -> BlockGroups:
    """The record ids of one namespace's blocks (what the scheduler asks about)."""
    hi, lo = _mixed(_group_salt(namespace_digest, layered), hashes)
    return BlockGroups((hi | np.uint64(1)).view(np.int64), lo.view(np.int64))


def value_ids(namespace_digest: str, shard: str, tag: int | None, hashes: Sequence[bytes]) -> ValueIds:
    """The ids of the block keys ``block_key(namespace_digest, shard, hash, tag)``, from the hashes' bytes."""
    hi, lo = _mixed(_value_salt(namespace_digest, shard, tag), hashes)
    return ValueIds(hi.view(np.int64), lo.view(np.int64))


def key_ids(keys: Sequence[str]) -> ValueIds:
    """Every key's id: a block key's is ``value_ids`` of its fields; any other key is hashed whole (blake2b)."""
    hi, lo = np.zeros(len(keys), dtype=np.int64), np.zeros(len(keys), dtype=np.int64)
    groups: dict[tuple[str, str, int | None], tuple[list[int], list[bytes]]] = {}
    others: list[int] = []
    for i, key in enumerate(keys):
        fields = parse_block_key(key)
        if fields is None:
            others.append(i)
        else:
            at, hashes = groups.setdefault(fields[:3], ([], []))
            at.append(i)
            hashes.append(fields[3])
    for (digest, shard, tag), (at, hashes) in groups.items():
        ids = value_ids(digest, shard, tag, hashes)
        hi[at], lo[at] = ids.hi, ids.lo
    if others:
        raw = b"".join([hashlib.blake2b(keys[i].encode(), digest_size=16).digest() for i in others])
        words = (np.frombuffer(raw, dtype=_U64).reshape(-1, 2) >> np.uint64(1)).astype(np.int64)
        hi[others], lo[others] = words[:, 0], words[:, 1]
    return ValueIds(hi, lo)


def key_groups(keys: Sequence[str]) -> BlockGroups:
    """Per key, the record id of its block; hi 0 for a key that is not a block key."""
    hashes: list[bytes] = []
    positions: dict[tuple[str, bool], list[int]] = {}  # (digest, layered) -> indices into hashes
    where: list[int] = []  # the key of each hash
    for i, key in enumerate(keys):
        block = block_of_key(key)
        if block is not None:
            positions.setdefault(block[:2], []).append(len(hashes))
            hashes.append(block[2])
            where.append(i)
    hi, lo = np.zeros(len(keys), dtype=np.int64), np.zeros(len(keys), dtype=np.int64)
    at = np.asarray(where, dtype=np.int64)
    for (digest, layered), idx in positions.items():  # one namespace per batch, in practice
        groups = namespace_groups(digest, layered, [hashes[i] for i in idx])
        hi[at[idx]], lo[at[idx]] = groups.hi, groups.lo
    return BlockGroups(hi, lo)
