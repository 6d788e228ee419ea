"""A bounded host-memory block store shared by the processes of one machine, keyed by ids: one file
in ``/dev/shm`` (``shm_file.py``, ``layout.py``) that the scheduler and every worker map, fixed-size
slots, block records counting each block's stored parts, leases, retention classes and eviction
(``eviction.py``). Index and metadata change under the pool's lock; copies run outside it, and a
reader rechecks a slot's version after its copy. The design: ``docs/architecture.md``, "The
embedded pool's store".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from vllm_aio.pool import index_ops
from vllm_aio.pool.eviction import Eviction
from vllm_aio.pool.ids import BlockGroups, ValueIds, namespace_groups, value_ids
from vllm_aio.pool.index_ops import FREE, READY, WRITING
from vllm_aio.pool.layout import H_CLOCK, H_HITS, H_LOOKUPS, H_NEXT_UNUSED, H_NUM_READY, PoolUsage, usage_of
from vllm_aio.pool.shm_file import PoolFile

# ``reserve_ids``, per value: instead of a slot, "stored already" or "no room".
SLOT_STORED, SLOT_NO_ROOM = -2, -1


def slots_for(pool_bytes: int, slot_size: int) -> int:
    return max(1, pool_bytes // slot_size)


class SharedHostPool:
    """Attach to (or create) the pool ``name``; values are ``slot_size`` bytes.

    ``clock``: lease deadlines in ns, one clock for every process of the host (a test passes its own).
    """

    def __init__(self, name: str, slot_size: int, num_slots: int, create: bool = True,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        """``create=False``: attach only, FileNotFoundError if no pool of that name exists."""
        self.name = name
        self._file = PoolFile(name, slot_size, num_slots, create)
        self._clock = clock
        self.layout = self._file.layout
        self._map_arrays(self._file)
        self._eviction = Eviction(self._file, clock)
        self._data_addr = self._data.ctypes.data
        self._closed = False

    def _map_arrays(self, file: PoolFile | None) -> None:
        """The metadata arrays and the slots as numpy views of the mapping (None: drop them)."""
        for region in ("header", "table", "key_hi", "key_lo", "version", "last_used", "retention", "lease_until",
                       "state", "slot_group_hi", "slot_group_lo", "group_hi", "group_lo", "group_parts", "data"):
            setattr(self, f"_{region}", None if file is None else file.view(region))
        # The groups of arrays ``index_ops`` works on.
        self._index = (self._table, self._key_hi, self._key_lo)
        self._records = (self._group_hi, self._group_lo, self._group_parts)
        self._slot_groups = (self._slot_group_hi, self._slot_group_lo)

    def warm_up(self) -> None:
        """Every compiled loop over keys (``index_ops``) compiled, or loaded from numba's cache, now,
        for the argument types the pool's operations pass, and nothing of the pool changed.

        Lazily, the first lookup, save and eviction of a process each paid for it in a request's
        step (0.13 s a process from the cache here, seconds where nothing is cached yet), with
        the GIL held: in an engine whose worker shares the scheduler's process, the whole step.
        """
        blocks = [bytes(32)]  # vLLM's block hashes are 32 bytes (sha256, sha256_cbor)
        value_ids("", "", None, blocks)
        none = ValueIds(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        no_blocks = BlockGroups(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        namespace_groups("", False, blocks)
        self.pin_ids(none)
        self.reserve_ids(none, no_blocks)
        self.commit([])
        self.block_parts(no_blocks)
        self._eviction.warm_up()

    def seal(self) -> None:
        """Unlink the pool's name now (``PoolFile.seal``); attached processes keep their mappings."""
        self._file.seal()

    def close(self) -> None:
        """Detach; the last process attached unlinks the pool."""
        if self._closed:
            return
        self._closed = True
        self._file.detach()
        self._map_arrays(None)  # numpy views of the mapping would keep it open
        self._eviction.close()
        self._file.unmap()

    # ---- allocation ------------------------------------------------------
    def _allocate(self, count: int) -> np.ndarray:
        """Up to ``count`` slots in WRITING state: unused, then free, then LRU."""
        header, state = self._header, self._state
        start = int(header[H_NEXT_UNUSED])
        stop = min(start + count, self.layout.num_slots)
        header[H_NEXT_UNUSED] = stop
        slots = np.arange(start, stop)
        if len(slots) < count:
            slots = np.concatenate((slots, np.flatnonzero(state[:start] == FREE)[: count - len(slots)]))
        if len(slots) < count:
            slots = np.concatenate((slots, self._eviction.victims(count - len(slots))))
        state[slots] = WRITING
        self._version[slots] += 1
        return slots

    # ---- public API --------------------------------------------------------
    @property
    def slot_size(self) -> int:
        return self.layout.slot_size

    def usage(self) -> PoolUsage:
        return usage_of(self._header)

    def evict_values(self, prefix: bytes = b"", batch: int = 4096) -> int:
        """Evict every READY value whose bytes start with ``prefix`` (all of them for ``b""``); how many went.

        For ``vllm-aio pool clear`` on a pool in use: slots being written or
        reserved are left alone, and a reader that pinned an evicted value sees
        its slot changed, as after an LRU eviction. The lock is held for one
        ``batch`` at a time, so running instances wait for a batch at most.
        """
        size, evicted, start = self.layout.slot_size, 0, 0
        rows = self._data.reshape(self.layout.num_slots, size)
        wanted = np.frombuffer(prefix, dtype=np.uint8)
        while start < self.layout.num_slots:
            stop = start + batch
            with self._file.locked():
                ready = start + np.flatnonzero(self._state[start:stop] == READY)
                if len(wanted):
                    ready = ready[(rows[ready, : len(wanted)] == wanted).all(axis=1)]
                self._eviction.drop(ready)
                self._state[ready] = FREE
            evicted += len(ready)
            start = stop
        return evicted

    def writing_slots(self) -> int:
        """Slots being written or reserved (a migration's slots until commit or watchdog)."""
        return int(np.count_nonzero(self._state == WRITING))

    def read_headers(self, slots: Sequence[int], length: int) -> list[bytes]:
        """The first ``length`` bytes of each slot (the value headers a migration's commit checks)."""
        size = self.layout.slot_size
        return [bytes(self._data[slot * size : slot * size + length]) for slot in slots]

    def reserve_ids(self, ids: ValueIds, groups: BlockGroups, retention: int = 0) -> np.ndarray:
        """Per value: a WRITING slot to fill, ``SLOT_STORED`` if stored already, ``SLOT_NO_ROOM`` if there is no room.

        The slot records its value's id and its block's record id (``groups``,
        hi 0: none), so ``commit`` needs only the slot. ``retention``: the
        storing request's class; a stored value keeps the higher of its class
        and this one.
        """
        hi, lo = ids.hi, ids.lo
        with self._file.locked():
            found = index_ops.find_slots(self._index, ids.hi, ids.lo)
            stored = found >= 0
            hits = found[stored]
            self._touch(hits)
            self._retention[hits] = np.maximum(self._retention[hits], retention)
            missing = np.flatnonzero(~stored)
            slots = self._allocate(len(missing))
            self._retention[slots] = retention
            filled = missing[: len(slots)]
            self._key_hi[slots], self._key_lo[slots] = hi[filled], lo[filled]
            self._slot_group_hi[slots], self._slot_group_lo[slots] = groups.hi[filled], groups.lo[filled]
        result = np.full(len(lo), SLOT_NO_ROOM, dtype=np.int64)
        result[stored] = SLOT_STORED
        result[filled] = slots
        return result

    def commit(self, slots: Sequence[int] | np.ndarray) -> list[bool]:
        """Publish filled slots; False where the key was stored first (by another writer or an
        earlier slot of this batch): that slot is freed.

        Each slot's key is the one ``reserve`` recorded in it: a WRITING slot
        is owned by its writer (no allocation or eviction touches it), so
        its key id cannot have changed since.
        """
        slots = np.asarray(slots, dtype=np.int64)
        with self._file.locked():
            stored, clock = index_ops.publish(self._index, self._records, self._slot_groups, self._state,
                                              self._last_used, slots, int(self._header[H_CLOCK]))
            self._header[H_CLOCK] = clock
            self._header[H_NUM_READY] += int(np.count_nonzero(stored))
        return stored.tolist()

    def abandon(self, slots: Sequence[int] | np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        with self._file.locked():
            self._state[slots] = FREE

    def pin_ids(self, ids: ValueIds) -> tuple[np.ndarray, np.ndarray]:
        """(slots, versions) to copy from and recheck (slot -1: absent); the hits' LRU refreshed in order.

        One compiled probe loop: a layerwise load pins every block of a step
        once per layer, and a per-key probe in Python cost more than copying
        a value takes.
        """
        with self._file.locked():
            slots = index_ops.find_slots(self._index, ids.hi, ids.lo)
            hit = slots >= 0
            hits = slots[hit]
            self._touch(hits)
            versions = np.where(hit, self._version[np.where(hit, slots, 0)], -1)
            self._header[H_LOOKUPS] += len(slots)
            self._header[H_HITS] += len(hits)
        return slots, versions

    def lease_ids(self, ids: ValueIds, seconds: float) -> int:
        """Evict these values last in their class for ``seconds`` (absent ids are skipped); how many are held.

        A lease only ever grows (another holder may need it longer) and ends by
        time alone: its holder, a scheduler that promised the values to a load,
        may die without a word, and a count would then hold them forever.
        """
        until = self._clock() + int(seconds * 1e9)
        with self._file.locked():
            slots = index_ops.find_slots(self._index, ids.hi, ids.lo)
            held = slots[slots >= 0]
            self._lease_until[held] = np.maximum(self._lease_until[held], until)
        return len(held)

    def unchanged(self, slots: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """``still_valid`` of many pins at once (a bool array)."""
        return (self._version[slots] == versions) & (self._state[slots] == READY)

    def _touch(self, slots: np.ndarray) -> None:
        """Make these slots the most recently used, one LRU tick each, in order."""
        clock = int(self._header[H_CLOCK])
        self._last_used[slots] = clock + 1 + np.arange(len(slots))
        self._header[H_CLOCK] = clock + len(slots)

    def complete_blocks(self, groups: BlockGroups, parts: int) -> int:
        """How many leading blocks have at least ``parts`` READY values (every part of them): one probe
        a block. It holds while no eviction happens (``usage().evictions``, the presence epoch)."""
        complete = self.block_parts(groups) >= parts
        return len(complete) if complete.all() else int(np.argmin(complete))

    def block_parts(self, groups: BlockGroups) -> np.ndarray:
        """How many READY values each block has (its record's count; 0 without a record)."""
        with self._file.locked():
            return index_ops.record_parts(self._records, groups.hi, groups.lo)

    def evicted_since(self, seen: int) -> tuple[int, BlockGroups | None]:
        """(evictions so far, the block record ids of the values evicted after the first ``seen``): ``Eviction``'s."""
        return self._eviction.evicted_since(seen)

    def still_valid(self, slot: int, version: int) -> bool:
        """Whether a slot read since ``pin_ids`` was not reused meanwhile."""
        return int(self._version[slot]) == version and int(self._state[slot]) == READY

    def region(self) -> tuple[int, int]:
        """(address, bytes) of the slot data in this process's mapping."""
        return self._data_addr, self.layout.num_slots * self.layout.slot_size

    def slot_address(self, slot: int | np.ndarray) -> int | np.ndarray:
        """The address of a slot (or of each slot of an array) in this process's mapping."""
        return self._data_addr + slot * self.layout.slot_size
