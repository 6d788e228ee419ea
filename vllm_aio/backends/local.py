"""The embedded backend: a host-memory pool private to one vLLM instance.

It needs no service: the pool lives in shared memory that the engine-core
process (scheduler) and every worker process map (see ``pool/host_pool.py``
for the mechanism and its cost). Instances on one host share a pool by giving
it the same ``local_pool_name``; otherwise its name is the instance's engine id
and it is sealed (unlinked) once the last of its processes has attached.

The scheduler's block lookups are exact and cost one probe per block, not per
part: the pool keeps a record per block counting its stored parts
(``SharedHostPool.complete_blocks``), and its eviction counter is the
presence epoch.

KV events (``block_watch``): the pool's eviction log says which blocks lost a
value, whichever attached process evicted it; the watch reads the entries
written since its last look, so its cost follows evictions, not the pool's size.

The pool itself knows ids only (``pool/ids.py`` mixes them): ``PoolSlots``
names its values by string key (the ``Backend`` contract, a migration) or by
block hash (the direct path), and is the ``SlotStore`` this backend hands out.

A batch's copies run together after one index operation (``reserve`` or
``pin_for_read``) and before the next (``commit`` or the version checks), in
one ``host_copy.copy_many`` call: compiled loops, on every core for a large
batch.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Sequence

import numpy as np

from vllm_aio.backends.base import Backend, Status, distinct_only
from vllm_aio.backends.segments import FlatSegments
from vllm_aio.device.host_copy import copy_many
from vllm_aio.device.segment import Segment
from vllm_aio.pool import reaper
from vllm_aio.pool.host_pool import SLOT_STORED, SharedHostPool, slots_for
from vllm_aio.pool.ids import BlockGroups, ValueIds, key_groups, key_ids, namespace_groups, value_ids
from vllm_aio.pool.keys import BlockParts

# A put's statuses, as codes into this array: picked for a whole batch with numpy.
_PUT_STATUSES = np.array([Status.OK, Status.EXISTS, Status.NO_SPACE, Status.ERROR], dtype=object)
_OK, _EXISTS, _NO_SPACE, _ERROR = range(4)


class LocalBackend(Backend):
    """Segments point to host memory (the only kind, see ``base.py``), copied by the CPU: nothing to register."""

    event_medium = "LOCAL_POOL"  # host memory of this machine, shared by the instances naming the pool

    def __init__(self, name: str, pool_bytes: int, value_bytes: int, seal: bool, shared: bool = False) -> None:
        self.pool = SharedHostPool(name, value_bytes, slots_for(pool_bytes, value_bytes))
        self._slots = PoolSlots(self.pool)
        self._pool_bytes = pool_bytes
        self._shared = shared
        self._closed = False
        if seal:
            self.pool.seal()
        if shared:  # its processes may all end without detaching (vLLM's default stop, a kill)
            reaper.watch(name)
        self.pool.warm_up()  # opened at engine start: the first request compiles nothing

    def shared_store(self) -> str | None:
        """Instances on one host that name one pool (``local_pool_name``) share its values."""
        return f"local:{socket.gethostname()}:{self.pool.name}" if self._shared else None

    def block_watch(self) -> "PoolWatch":
        self._check_open()
        return PoolWatch(self.pool)

    def gauges(self) -> dict[str, float]:
        """The pool's fill and its evictions since it was created (by every process attached)."""
        if self._closed:
            return {}
        usage = self.pool.usage()
        return {"pool_used_bytes": float(usage.bytes_used), "pool_capacity_bytes": float(usage.capacity_bytes),
                "pool_stored_values": float(usage.num_ready), "pool_evicted_values": float(usage.evictions)}

    def describe(self) -> str:
        return f"pool={self.pool.name} size={self._pool_bytes / 2**30:.2f}GiB"

    def slots(self) -> "PoolSlots":
        """The pool's slots, for device kernels that copy straight from and to them (and migrations)."""
        self._check_open()
        return self._slots

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        return self._slots.contains(keys)

    def count_complete_blocks(self, parts: BlockParts, hashes: Sequence[bytes]) -> int:
        self._check_open()
        groups = namespace_groups(parts.namespace_digest, parts.layered, hashes)
        return self.pool.complete_blocks(groups, parts.count)

    def lease_blocks(self, parts: BlockParts, hashes: Sequence[bytes], seconds: float) -> None:
        self._check_open()
        ids = [value_ids(parts.namespace_digest, shard, tag, hashes) for shard in parts.shards for tag in parts.tags]
        self.pool.lease_ids(ValueIds.concat(ids), seconds)

    def presence_epoch(self) -> int:
        self._check_open()
        return self.pool.usage().evictions  # values leave this pool only by eviction

    def batch_put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], retention: int = 0) -> list[Status]:
        self._check_open()
        return distinct_only(functools.partial(self._put_distinct, retention=retention), keys, segments)

    def _put_distinct(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], retention: int) -> list[Status]:
        values = FlatSegments.of(segments)
        slots = self._slots.reserve_array(keys, retention)
        reserved = slots >= 0
        fits = values.totals() == self.pool.slot_size
        misfits = slots[reserved & ~fits]
        if len(misfits):  # rare: spares the common put a lock round
            self.pool.abandon(misfits)
        positions = np.flatnonzero(reserved & fits)  # the values copied into their slots
        filled = slots[positions]
        codes = np.where(reserved, np.where(fits, _OK, _ERROR), np.where(slots == SLOT_STORED, _EXISTS, _NO_SPACE))
        try:
            # The whole batch at once: a large one is shared by several threads.
            copy_many(*values.gather_copies(positions, self.pool.slot_address(filled)))
        except BaseException:
            self.pool.abandon(filled)  # or the reserved slots stay WRITING, lost for good
            raise
        # Another writer (or an earlier copy in this batch) got there first.
        codes[positions[~np.asarray(self.pool.commit(filled), dtype=bool)]] = _EXISTS
        return _PUT_STATUSES[codes].tolist()

    def batch_get(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        self._check_open()
        return distinct_only(self._get_distinct, keys, segments)

    def _get_distinct(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        values = FlatSegments.of(segments)
        fits = (values.totals() == self.pool.slot_size).tolist()
        out: list[Status] = []
        copied: list[tuple[int, int, int]] = []  # (position in `keys`, slot, version)
        for i, pinned in enumerate(self._slots.pin_for_read(keys)):
            if pinned is None:
                out.append(Status.MISSING)
            elif not fits[i]:
                out.append(Status.CORRUPT)
            else:
                slot, version = pinned
                copied.append((i, slot, version))
                out.append(Status.OK)
        sources = [self.pool.slot_address(slot) for _, slot, _ in copied]
        copy_many(*values.scatter_copies(sources, [i for i, _, _ in copied]))
        # Checked once every copy is done: a slot evicted and rewritten at any
        # time since its pin, during its copy included, shows a new version.
        for i, slot, version in copied:
            if not self.pool.still_valid(slot, version):
                out[i] = Status.CORRUPT  # the bytes copied may be torn
        return out

    def close(self) -> None:
        self._closed = True
        self.pool.close()

    def _check_open(self) -> None:
        if self._closed:  # the pool's mapping and lock are gone
            raise RuntimeError("LocalBackend is closed")


class PoolSlots:
    """The embedded pool's values named by string key or by block hash (``SlotStore``, ``KeyedSlotStore``).

    A key or hash becomes its value's id once per call (``pool/ids.py``); the
    slot a reserve hands out remembers it, so a commit takes only slots.
    """

    def __init__(self, pool: SharedHostPool) -> None:
        self.pool = pool

    @property
    def slot_size(self) -> int:
        return self.pool.slot_size

    def region(self) -> tuple[int, int]:
        return self.pool.region()

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key; a hit refreshes its LRU position."""
        return [pin is not None for pin in self.pin_for_read(keys)]

    def pin_for_read(self, keys: Sequence[str]) -> list[tuple[int, int] | None]:
        """Per key: (slot, version) to copy from and recheck (``still_valid``), or None if absent."""
        if not keys:
            return []
        slots, versions = self.pool.pin_ids(key_ids(keys))
        return [None if slot < 0 else (slot, version) for slot, version in zip(slots.tolist(), versions.tolist())]

    def pin_blocks(
        self, namespace_digest: str, shard: str, tag: int | None, hashes: Sequence[bytes]
    ) -> tuple[np.ndarray, np.ndarray]:
        """``pin_for_read`` of the block keys of ``hashes``, without building them:
        (slots, versions), slot -1 if absent."""
        return self.pool.pin_ids(value_ids(namespace_digest, shard, tag, hashes))

    def still_valid(self, slot: int, version: int) -> bool:
        return self.pool.still_valid(slot, version)

    def unchanged(self, slots: np.ndarray, versions: np.ndarray) -> np.ndarray:
        return self.pool.unchanged(slots, versions)

    def reserve(self, keys: Sequence[str], retention: int = 0) -> list[int | None]:
        """Per key: a WRITING slot to fill, or None if already stored; -1 if no room."""
        return [None if slot == SLOT_STORED else slot for slot in self.reserve_array(keys, retention).tolist()]

    def reserve_array(self, keys: Sequence[str], retention: int = 0) -> np.ndarray:
        """``reserve`` answered as ``reserve_blocks`` is: an array, ``SLOT_STORED`` for None."""
        return self.pool.reserve_ids(key_ids(keys), key_groups(keys), retention)

    def reserve_blocks(
        self, namespace_digest: str, shard: str, tag: int | None, hashes: Sequence[bytes], retention: int = 0
    ) -> np.ndarray:
        """``reserve`` of the block keys of ``hashes``, without building them (as ``pin_blocks``):
        per hash a slot, ``SLOT_STORED`` if stored already, ``SLOT_NO_ROOM`` if there is no room."""
        ids = value_ids(namespace_digest, shard, tag, hashes)
        return self.pool.reserve_ids(ids, namespace_groups(namespace_digest, tag is not None, hashes), retention)

    def commit(self, slots: Sequence[int] | np.ndarray) -> list[bool]:
        return self.pool.commit(slots)

    def abandon(self, slots: Sequence[int] | np.ndarray) -> None:
        self.pool.abandon(slots)

    def read_headers(self, slots: Sequence[int], length: int) -> list[bytes]:
        return self.pool.read_headers(slots, length)

    def writing_slots(self) -> int:
        return self.pool.writing_slots()


class PoolWatch:
    """``BlockWatch`` over the embedded pool: block record ids -> the blocks' hashes, fed by the eviction log."""

    def __init__(self, pool: SharedHostPool) -> None:
        self._pool = pool
        self._seen = pool.usage().evictions  # evictions before the watch began concern nothing watched
        # (hi, lo) record id -> (block hash, parts it needs)
        self._watched: dict[tuple[int, int], tuple[bytes, int]] = {}

    def add(self, parts: BlockParts, hashes: Sequence[bytes]) -> list[bytes]:
        groups = namespace_groups(parts.namespace_digest, parts.layered, hashes)
        counts = self._pool.block_parts(groups).tolist()
        added = []
        for block_hash, hi, lo, count in zip(hashes, groups.hi.tolist(), groups.lo.tolist(), counts):
            if count >= parts.count and (hi, lo) not in self._watched:
                self._watched[hi, lo] = (block_hash, parts.count)
                added.append(block_hash)
        return added

    def take_gone(self) -> list[bytes]:
        self._seen, evicted = self._pool.evicted_since(self._seen)
        if evicted is None:  # the log turned over since the last look: check every watched block
            candidates = list(self._watched)
        else:
            ids = np.unique(np.stack([evicted.hi, evicted.lo], axis=1), axis=0).tolist()  # values -> blocks
            candidates = [key for key in map(tuple, ids) if key in self._watched]
        if not candidates:
            return []
        # A block evicted and stored again since is still there: ask its record.
        ids = np.asarray(candidates, dtype=np.int64).reshape(-1, 2)
        counts = self._pool.block_parts(BlockGroups(ids[:, 0].copy(), ids[:, 1].copy())).tolist()
        return [self._watched.pop(key)[0] for key, count in zip(candidates, counts) if count < self._watched[key][1]]

    def clear(self) -> list[bytes]:
        gone = [block_hash for block_hash, _ in self._watched.values()]
        self._watched.clear()
        return gone
