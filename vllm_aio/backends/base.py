"""The contract every pooled store implements: a value is one KV block's bytes (of one rank, maybe
one layer) as ``(address, size)`` segments of host memory, or of device memory a backend says it
takes; every call is batched and answers one typed ``Status`` per key, never raising for a per-key
condition; the scheduler asks at block granularity (``count_complete_blocks``,
``presence_epoch``). The rules in full: ``docs/backends.md``, "The contract".
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol

from vllm_aio.device.segment import Segment
from vllm_aio.pool.keys import BlockParts

# Keys per exists call of the default block lookup: bounded calls, and one
# that stops soon after the first missing block.
_LOOKUP_KEYS = 4096


class Memory(enum.Enum):
    """What a segment points to (see the module docstring)."""

    HOST = "host"  # RAM the CPU addresses: pageable, page-locked or shared
    DEVICE = "device"  # memory of this process's accelerator (e.g. NPU HBM)


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
    # put (set by the connector): never offered to the store, because the puts of
    # earlier saves still held the staging it needed. A save that cannot keep up
    # is dropped, never waited for.
    DROPPED = "dropped"

    @property
    def stored(self) -> bool:
        """True when, after a put, the key holds a value."""
        return self in (Status.OK, Status.EXISTS)


class Backend(ABC):
    """A pooled store of fixed-layout KV blocks, keyed by strings."""

    # The ``medium`` of the KV cache events about this store's blocks
    # (``connector/events.py``), next to vLLM's own "GPU" and "CPU".
    event_medium = "POOL"

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present now (it may be evicted right after)."""

    def count_complete_blocks(self, parts: BlockParts, hashes: Sequence[bytes]) -> int:
        """How many of the blocks, from the first, have every part stored (stops at the first that has not).

        Exact here: every part's key, a bounded ``batch_exists`` at a time.
        Backends override it with something cheaper; see the module docstring
        for what a cheaper answer may promise.
        """
        per_call = max(1, _LOOKUP_KEYS // parts.count)
        for start in range(0, len(hashes), per_call):
            chunk = hashes[start : start + per_call]
            present = self.batch_exists([key for h in chunk for key in parts.keys(h)])
            for i in range(len(chunk)):
                if not all(present[i * parts.count : (i + 1) * parts.count]):
                    return start + i
        return len(hashes)

    def lease_blocks(self, parts: BlockParts, hashes: Sequence[bytes], seconds: float) -> None:
        """Keep every part of these blocks from eviction for about ``seconds``: the
        scheduler promised them to a load the workers have not run yet.

        Where the store allows: the embedded pool leases the values for
        ``seconds``; Mooncake's master leases each key it is asked about for its
        own ``--default_kv_lease_ttl``; others (the default) cannot, and a value
        evicted before the load fails it, which vLLM recomputes.
        """

    def presence_epoch(self) -> int | None:
        """A number that changes whenever a stored value may have gone (eviction, removal).

        While it is unchanged, blocks found complete are still complete, so the
        scheduler need not ask about them again. None: the store cannot tell,
        and an answer holds only at the moment it was given.
        """
        return None

    @abstractmethod
    def batch_put(
        self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], retention: int = 0
    ) -> list[Status]:
        """Store each key's value, gathered from its segments in order.

        ``retention``: the retention class of the requests that stored them
        (0: the lowest; from vLLM priorities, ``priority_cutoffs``). A store
        that can keep some values longer does so for higher classes (the
        embedded pool evicts the lowest class first; Mooncake soft-pins class
        1 and above); others store them like any value.
        """

    @abstractmethod
    def batch_get(
        self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]
    ) -> list[Status]:
        """Copy each key's value into its segments in order."""

    def register_memory(self, address: int, size: int, memory: Memory = Memory.HOST) -> None:
        """Announce a region that segments will point into (KV cache, staging), and its kind.

        Backends that copy with the CPU need nothing; RDMA-style backends pin
        and register the region once here instead of on every transfer.
        A kind outside ``segment_memory`` raises ``ValueError``.
        """
        check_memory(self, memory)

    def segment_memory(self) -> frozenset[Memory]:
        """Which memory segments may point to: host memory always, device memory where the store can."""
        return frozenset({Memory.HOST})

    def wants_registration(self) -> bool:
        """Whether ``register_memory`` matters: the store moves bytes without a
        CPU copy (zero-copy, RDMA-style) from memory registered with it once.
        False: the backend copies with the CPU and registering does nothing."""
        return False

    def slots(self) -> "KeyedSlotStore | None":
        """The store's values as fixed-size slots of one host mapping that the caller copies
        into and out of itself (a device kernel reading the mapping: no copy through the
        backend); None where values live anywhere else (the default)."""
        return None

    def block_watch(self) -> "BlockWatch | None":
        """A watch over blocks the caller announced, telling when one loses a value (a KV
        event ``BlockRemoved``); None where the store cannot say what it evicted (the default)."""
        return None

    def shared_store(self) -> str | None:
        """A name equal on every instance that reads and writes these same values
        (one Mooncake master, one Memcache meta service, one named embedded pool
        on one host), so a migration between two such instances moves no bytes;
        None: the values are this instance's own (the default)."""
        return None

    def take_counters(self) -> dict[str, int]:
        """What the backend counted since the last call, by names of ``connector/stats.py``'s
        ``COUNTERS`` (e.g. which tier served a hit); the worker adds them to its stats."""
        return {}

    def gauges(self) -> dict[str, float]:
        """Point-in-time readings of the store (fill, evictions), exported as gauges; none by default."""
        return {}

    def describe(self) -> str:
        """One line for the start-up log: where the values go (pool, service, protocol, ...)."""
        return type(self).__name__

    @abstractmethod
    def close(self) -> None:
        """Release everything the backend holds; later calls fail."""


class SlotStore(Protocol):
    """Values kept as fixed-size slots in one region of host memory, found by block hash (``Backend.slots``).

    What the direct path uses: a reader pins (slot, version) pairs, copies,
    and asks ``unchanged`` afterwards; a writer reserves slots (invisible and
    never evicted until ``commit`` or ``abandon``), fills them and commits.
    Hashes of one call are distinct, as keys are for ``Backend``'s batches.
    """

    @property
    def slot_size(self) -> int: ...

    def region(self) -> tuple[int, int]:
        """(address, bytes) of the slots: slot i starts at address + i * slot_size."""

    def pin_blocks(self, namespace_digest: str, shard: str, tag: int | None, hashes: Sequence[bytes]):
        """The values of the block keys of ``hashes`` (``pool/keys.block_key``), found from the
        hashes alone: two integer arrays (slots, versions), slot -1 where absent."""

    def unchanged(self, slots, versions):
        """Whether each pinned slot still holds the value pinned at that version: a boolean array."""

    def reserve_blocks(self, namespace_digest: str, shard: str, tag: int | None, hashes: Sequence[bytes],
                       retention: int = 0):
        """Slots to fill for the block keys of ``hashes`` (as ``pin_blocks``): an integer array, per
        hash a slot, ``SLOT_STORED`` if already stored or ``SLOT_NO_ROOM`` (``pool/host_pool.py``;
        ``retention`` as for ``Backend.batch_put``)."""

    def commit(self, slots) -> list[bool]:
        """Publish filled slots (a sequence or an integer array); False where another writer,
        or an earlier slot of the batch, stored the value first."""

    def abandon(self, slots) -> None:
        """Give reserved slots (a sequence or an integer array) back unfilled."""


class KeyedSlotStore(SlotStore, Protocol):
    """A ``SlotStore`` whose values are also named by string key: what a migration moves them through."""

    def pin_for_read(self, keys: Sequence[str]) -> list[tuple[int, int] | None]:
        """Per key: (slot, version), or None if absent."""

    def reserve(self, keys: Sequence[str], retention: int = 0) -> list[int | None]:
        """Per key: a slot to fill, None if already stored, -1 if there is no room."""

    def read_headers(self, slots: Sequence[int], length: int) -> list[bytes]:
        """The first ``length`` bytes of each slot (a migration checks what a peer wrote)."""

    def writing_slots(self) -> int:
        """Slots reserved and not yet committed or abandoned."""


class BlockWatch(Protocol):
    """Announced blocks whose presence a store follows as values leave it (``Backend.block_watch``).

    Used from one thread (the scheduler's). Its cost follows what changed:
    the blocks added, the values evicted since the last look, never the pool's size.
    """

    def add(self, parts: BlockParts, hashes: Sequence[bytes]) -> list[bytes]:
        """Watch those of the blocks that have every part stored now and are not watched yet; returns them."""

    def take_gone(self) -> list[bytes]:
        """Watched blocks that lost a part since the last call; no longer watched."""

    def clear(self) -> list[bytes]:
        """Stop watching every block; returns them."""


def check_memory(backend: Backend, memory: Memory) -> None:
    """Raise ``ValueError`` unless ``backend``'s segments may point to ``memory``."""
    if memory not in backend.segment_memory():
        accepted = ", ".join(sorted(m.value for m in backend.segment_memory()))
        raise ValueError(f"{type(backend).__name__}: segments cannot point to {memory.value} memory (only {accepted})")


BatchOp = Callable[[Sequence[str], Sequence[Sequence[Segment]]], list[Status]]


def distinct_only(
    op: BatchOp,
    keys: Sequence[str],
    segments: Sequence[Sequence[Segment]],
    value_bytes: int | None = None,
    wrong_size: Status = Status.ERROR,
) -> list[Status]:
    """``op`` on the first occurrence of each key; a repeated key is answered ``ERROR``.

    With ``value_bytes`` (the size of every value of the pool), a key whose
    segments total another size is answered ``wrong_size`` without being run:
    a put stores nothing (``ERROR``), a get copies nothing (``CORRUPT``).
    """
    if len(keys) != len(segments):
        raise ValueError(f"{len(keys)} keys but {len(segments)} segment lists")
    out = [Status.ERROR] * len(keys)
    seen: set[str] = set()
    keep: list[int] = []
    for i, (key, segs) in enumerate(zip(keys, segments)):
        if key in seen:
            continue
        seen.add(key)
        if value_bytes is not None and sum(n for _, n in segs) != value_bytes:
            out[i] = wrong_size
        else:
            keep.append(i)
    if len(keep) == len(keys):
        return op(keys, segments)
    if keep:
        for i, status in zip(keep, op([keys[i] for i in keep], [segments[i] for i in keep])):
            out[i] = status
    return out
