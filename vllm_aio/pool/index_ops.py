"""The host pool's per-key index work, compiled: its hash index and its block records.

``SharedHostPool`` (``host_pool.py``) keeps the layout, the lock and the
semantics; these functions do the loops over keys on the arrays it passes in,
views of its shared mapping:

* ``index``: ``(table, key_hi, key_lo)``: buckets -> slot (``EMPTY``: none),
  open-addressed with linear probing from ``key_lo & mask``, and each slot's key id;
* ``records``: ``(group_hi, group_lo, group_parts)``: the block records, a
  second open-addressed table (``parts`` 0: empty bucket);
* ``slot_groups``: ``(slot_group_hi, slot_group_lo)``: each slot's block
  record id (``hi`` 0: its key has no record).

Both tables delete by backward shift, so a probe stops at the first empty
bucket and no tombstone ever piles up. The callers hold the pool's lock.

``mixed_ids`` turns block hashes into the two 64-bit ids that both tables
are keyed by (``ids.py``).

Why compiled: a commit, and in a full pool every save's eviction, touched
both tables once per key, and in Python that cost more a value than copying
the value takes; mixing a prompt's ids in numpy cost more than the lookup
itself. The loops are numba-compiled on first call and cached on disk as
``host_copy.py``'s are. They keep the GIL: they run under the pool's lock,
and a call that released it waited to get it back while another thread of
the process ran Python, holding the lock that every other process waits for.
Compiling every function here costs seconds once per machine (the first
reserve, commit and eviction of a process); later processes load them from
the cache. numba's ``np.partition`` alone took longer to compile than all the
rest, so eviction's selection stays numpy's (``Eviction.victims``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

EMPTY = -1  # an index bucket without a slot
# Slot states (``SharedHostPool``'s ``state`` array).
FREE, WRITING, READY = 0, 1, 2

Arrays3 = tuple[np.ndarray, np.ndarray, np.ndarray]
Arrays2 = tuple[np.ndarray, np.ndarray]

# splitmix64's finaliser constants (``_mix``).
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


@njit(cache=True)
def _find(index: Arrays3, hi: int, lo: int) -> tuple[int, int]:
    """(bucket, slot) of the key, or (the first empty bucket on its probe path, -1)."""
    table, key_hi, key_lo = index
    mask = len(table) - 1
    bucket = lo & mask
    while True:
        slot = table[bucket]
        if slot == EMPTY:
            return bucket, -1
        if key_lo[slot] == lo and key_hi[slot] == hi:
            return bucket, slot
        bucket = (bucket + 1) & mask


@njit(cache=True)
def _unindex(index: Arrays3, bucket: int) -> None:
    """Empty a bucket with backward shift, keeping linear probing valid."""
    table, _, key_lo = index
    mask = len(table) - 1
    hole, probe = bucket, (bucket + 1) & mask
    while table[probe] != EMPTY:
        slot = table[probe]
        # Move the entry back if the hole lies on its probe path (between its home and it).
        if (probe - (key_lo[slot] & mask)) & mask >= (probe - hole) & mask:
            table[hole] = slot
            hole = probe
        probe = (probe + 1) & mask
    table[hole] = EMPTY


@njit(cache=True)
def _find_record(records: Arrays3, hi: int, lo: int) -> int:
    """The bucket holding the record, or the empty bucket where it would go."""
    group_hi, group_lo, parts = records
    mask = len(parts) - 1
    bucket = lo & mask
    while parts[bucket] and not (group_lo[bucket] == lo and group_hi[bucket] == hi):
        bucket = (bucket + 1) & mask
    return bucket


@njit(cache=True)
def _drop_record(records: Arrays3, bucket: int) -> None:
    """Empty a record's bucket with backward shift (as ``_unindex``)."""
    group_hi, group_lo, parts = records
    mask = len(parts) - 1
    hole, probe = bucket, (bucket + 1) & mask
    while parts[probe]:
        if (probe - (group_lo[probe] & mask)) & mask >= (probe - hole) & mask:
            parts[hole], group_hi[hole], group_lo[hole] = parts[probe], group_hi[probe], group_lo[probe]
            hole = probe
        probe = (probe + 1) & mask
    parts[hole] = 0


@njit(cache=True)
def _count_part(records: Arrays3, hi: int, lo: int, delta: int) -> None:
    """A READY value of record ``(hi, lo)`` appeared (+1) or went (-1); a record counting 0 goes."""
    if hi == 0:  # not a block key
        return
    group_hi, group_lo, parts = records
    bucket = _find_record(records, hi, lo)
    if parts[bucket] == 0:  # the block's first part
        group_hi[bucket], group_lo[bucket] = hi, lo
    parts[bucket] += delta
    if parts[bucket] == 0:
        _drop_record(records, bucket)


@njit(cache=True)
def find_slots(index: Arrays3, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """The slot of every key id (``EMPTY``: absent)."""
    slots = np.empty(len(lo), dtype=np.int64)
    for i in range(len(lo)):
        slots[i] = _find(index, hi[i], lo[i])[1]
    return slots


@njit(cache=True)
def record_parts(records: Arrays3, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """The count of every record id (0: no record)."""
    parts = records[2]
    found = np.empty(len(lo), dtype=np.int64)
    for i in range(len(lo)):
        found[i] = parts[_find_record(records, hi[i], lo[i])]
    return found


@njit(cache=True)
def publish(
    index: Arrays3, records: Arrays3, slot_groups: Arrays2, state: np.ndarray, last_used: np.ndarray,
    slots: np.ndarray, clock: int,
) -> tuple[np.ndarray, int]:
    """Index each WRITING slot under the key id it holds and make it READY: (stored, clock).

    A slot whose key is indexed already (another writer, or an earlier slot
    of this batch) is not stored but FREE. Each stored slot takes the next
    tick of ``clock`` in batch order and counts in its block's record.
    """
    stored = np.zeros(len(slots), dtype=np.bool_)
    table, key_hi, key_lo = index
    group_hi, group_lo = slot_groups
    for i in range(len(slots)):
        slot = slots[i]
        bucket, found = _find(index, key_hi[slot], key_lo[slot])
        if found >= 0:
            state[slot] = FREE
            continue
        table[bucket] = slot
        state[slot] = READY
        clock += 1
        last_used[slot] = clock
        _count_part(records, group_hi[slot], group_lo[slot], 1)
        stored[i] = True
    return stored, clock


@njit(cache=True)
def drop(index: Arrays3, records: Arrays3, slot_groups: Arrays2, slots: np.ndarray) -> None:
    """Take READY slots out of the index and their blocks' records; their state is the caller's."""
    _, key_hi, key_lo = index
    group_hi, group_lo = slot_groups
    for slot in slots:
        bucket, found = _find(index, key_hi[slot], key_lo[slot])
        assert found == slot, "a READY slot is missing from the index"
        _unindex(index, bucket)
        _count_part(records, group_hi[slot], group_lo[slot], -1)


@njit(cache=True)
def eviction_order(
    state: np.ndarray, retention: np.ndarray, lease_until: np.ndarray, last_used: np.ndarray, now: int
) -> tuple[np.ndarray, np.ndarray]:
    """(READY slots, their eviction order: lowest first), in one pass over the slots.

    Lowest class first; within a class, values leased (``lease_until`` after
    ``now``) last; least recently used first otherwise. The clock stays far
    below 2**48 ticks, so one integer orders all three.
    """
    ready = np.empty(len(state), dtype=np.int64)
    order = np.empty(len(state), dtype=np.int64)
    n = 0
    for slot in range(len(state)):
        if state[slot] == READY:
            leased = 1 if lease_until[slot] > now else 0
            ready[n], order[n] = slot, (retention[slot] << 49) | (leased << 48) | last_used[slot]
            n += 1
    return ready[:n], order[:n]


@njit(cache=True)
def _mix(x: np.uint64) -> np.uint64:
    """splitmix64's finaliser: a bijection that spreads any bits over all 64 (home buckets)."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


@njit(cache=True)
def mixed_ids(words: np.ndarray, seed_hi: np.uint64, seed_lo: np.uint64) -> tuple[np.ndarray, np.ndarray]:
    """Two 64-bit ids per row of ``words`` (uint64, one hash a row): every word goes
    through ``_mix`` in turn, into both ids, from the seeds."""
    hi = np.empty(words.shape[0], dtype=np.uint64)
    lo = np.empty(words.shape[0], dtype=np.uint64)
    for i in range(words.shape[0]):
        h, l_ = seed_hi, seed_lo
        for k in range(words.shape[1]):
            h = _mix(h ^ words[i, k])
            l_ = _mix(l_ ^ words[i, k] ^ h)
        hi[i], lo[i] = h, l_
    return hi, lo
