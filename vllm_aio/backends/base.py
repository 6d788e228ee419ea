"""The contract every pooled store implements.

A value is the bytes of one KV block (of one rank, possibly of one layer),
scattered over several device or host regions: the worker passes, per key, a
list of ``(address, size)`` segments and the backend copies between those
segments and its own memory. Addresses make the contract identical for the
embedded pool (memcpy), Mooncake (``batch_put_from_multi_buffers``) and
Memcache, and let zero-copy backends register the KV cache once.

Every call is batched and returns one typed ``Status`` per key. The keys of one
put or get batch are distinct (``connector/block_io.py`` reads a key shared by
several blocks once): a store may mishandle a repeat (Mooncake answers success
for both and fills one destination), so a backend answers a repeat ``ERROR``
without running it (``distinct_only``). A backend never
raises for a per-key condition (missing, pool full, short value); it raises only
when it cannot serve at all (e.g. closed), which the caller turns into misses.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

Segment = tuple[int, int]  # (address, size in bytes)


class Status(enum.Enum):
    OK = "ok"
    # put: the key was already stored; the existing value is kept (success).
    EXISTS = "exists"
    # put: no room even after eviction; the value was not stored (not an error).
    NO_SPACE = "no_space"
    # get: the key is absent (never stored, evicted, pool restarted).
    MISSING = "missing"
    # get: the stored value's length differs from the segments' total, or it
    # was overwritten while being read; nothing trustworthy was copied.
    CORRUPT = "corrupt"
    # get (set by the connector): the value's header names another owner,
    # layer, layout or block; it is refused, never used.
    FOREIGN = "foreign"
    # any call: the store failed or timed out for this key.
    ERROR = "error"

    @property
    def stored(self) -> bool:
        """True when, after a put, the key holds a value."""
        return self in (Status.OK, Status.EXISTS)


class Backend(ABC):
    """A pooled store of fixed-layout KV blocks, keyed by strings."""

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present now (it may be evicted right after)."""

    @abstractmethod
    def batch_put(
        self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]
    ) -> list[Status]:
        """Store each key's value, gathered from its segments in order."""

    @abstractmethod
    def batch_get(
        self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]
    ) -> list[Status]:
        """Copy each key's value into its segments in order."""

    def register_memory(self, address: int, size: int) -> None:
        """Announce a region that segments will point into (KV cache, staging).

        Backends that copy with the CPU need nothing; RDMA-style backends pin
        and register the region once here instead of on every transfer.
        """

    @abstractmethod
    def close(self) -> None:
        """Release everything the backend holds; later calls fail."""


BatchOp = Callable[[Sequence[str], Sequence[Sequence[Segment]]], list[Status]]


def distinct_only(op: BatchOp, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
    """``op`` on the first occurrence of each key; a repeated key is answered ``ERROR``."""
    if len(keys) != len(segments):
        raise ValueError(f"{len(keys)} keys but {len(segments)} segment lists")
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    if len(first) == len(keys):
        return op(keys, segments)
    keep = sorted(first.values())
    out = [Status.ERROR] * len(keys)
    for i, status in zip(keep, op([keys[i] for i in keep], [segments[i] for i in keep])):
        out[i] = status
    return out
