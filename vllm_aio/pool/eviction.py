"""Which READY values leave a pool when it needs room, and the log of those that left.

A victim is the least recently used READY value of the lowest retention class, values leased to a
load that has not read them yet going last in their class. Every value taken out (evicted, or
cleared by ``vllm-aio pool clear``) is logged: the k-th writes its block record's id at entry
``k % num_slots``, so any attached process learns which blocks lost a value (``evicted_since``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from vllm_aio.pool import index_ops
from vllm_aio.pool.ids import BlockGroups
from vllm_aio.pool.layout import H_EVICTIONS, H_NUM_READY
from vllm_aio.pool.shm_file import PoolFile

_REGIONS = ("header", "table", "key_hi", "key_lo", "last_used", "retention", "lease_until", "state",
            "slot_group_hi", "slot_group_lo", "group_hi", "group_lo", "group_parts", "evicted_hi", "evicted_lo")


class Eviction:
    """A pool's eviction over its mapping (``file``); ``clock``: lease deadlines in ns."""

    def __init__(self, file: PoolFile, clock: Callable[[], int]) -> None:
        self._file = file
        self._clock = clock
        self._num_slots = file.layout.num_slots
        self._map(file)

    def _map(self, file: PoolFile | None) -> None:
        for region in _REGIONS:
            setattr(self, f"_{region}", None if file is None else file.view(region))
        self._index = (self._table, self._key_hi, self._key_lo)
        self._records = (self._group_hi, self._group_lo, self._group_parts)
        self._slot_groups = (self._slot_group_hi, self._slot_group_lo)

    def close(self) -> None:
        self._map(None)  # numpy views of the mapping would keep it open

    def warm_up(self) -> None:
        """The compiled loops eviction runs, compiled (or loaded from numba's cache) now; nothing changes."""
        with self._file.locked():
            index_ops.eviction_order(self._state, self._retention, self._lease_until, self._last_used, self._clock())
            self.drop(np.zeros(0, dtype=np.int64))

    def victims(self, count: int) -> np.ndarray:
        """Up to ``count`` READY values taken out (under the pool's lock), in slot order: a batch's
        values then lie back to back where they can, so a direct load finds them in runs it moves
        by DMA (``connector/worker/block_io/mapped_slots.py``)."""
        ready, order = index_ops.eviction_order(self._state, self._retention, self._lease_until, self._last_used,
                                                self._clock())
        if not len(ready):
            return ready
        # numpy's partition: numba's took seconds more to compile than all the rest.
        victims = np.sort(ready[np.argpartition(order, min(count, len(ready)) - 1)[:count]])
        self.drop(victims)
        return victims

    def drop(self, slots: np.ndarray) -> None:
        """Take READY values out of the index and the block records (under the pool's lock), logged;
        the caller decides the slots' state."""
        index_ops.drop(self._index, self._records, self._slot_groups, slots)
        # Logged for readers of this pool's evictions (KV events' BlockRemoved, ``backends/local.py``).
        log = (int(self._header[H_EVICTIONS]) + np.arange(len(slots))) % self._num_slots
        self._evicted_hi[log], self._evicted_lo[log] = self._slot_group_hi[slots], self._slot_group_lo[slots]
        # Counted as evictions: the eviction counter is the presence epoch (backends/local.py),
        # which tells schedulers that values they counted may be gone.
        self._header[H_EVICTIONS] += len(slots)
        self._header[H_NUM_READY] -= len(slots)

    def evicted_since(self, seen: int) -> tuple[int, BlockGroups | None]:
        """(evictions so far, the block record ids of the values evicted after the first ``seen``).

        None instead of the ids when more than the log holds were evicted
        since (the whole pool turned over): the caller rechecks its blocks.
        Ids repeat (one per value) and include 0s for values without a record.
        """
        if int(self._header[H_EVICTIONS]) == seen:  # the usual step: no lock, nothing to copy
            return seen, BlockGroups(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        with self._file.locked():
            now = int(self._header[H_EVICTIONS])
            if now - seen > self._num_slots:
                return now, None
            log = np.arange(seen, now) % self._num_slots
            return now, BlockGroups(self._evicted_hi[log], self._evicted_lo[log])
