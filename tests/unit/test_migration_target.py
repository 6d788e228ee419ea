"""Unit tests of ``vllm_aio.migration.target``: reservations in a real embedded pool, commit, watchdog.

The clock is the test's, so the watchdog's moments are exact; the pool is a
real ``SharedHostPool`` in /dev/shm. End to end (two vLLM servers) lives in
``test_e2e_migration.py``.
"""

from __future__ import annotations

import ctypes
import uuid

import pytest

from vllm_aio.migration.target import MigrationRefused, MigrationTarget
from vllm_aio.backends.local import PoolSlots
from vllm_aio.pool.host_pool import SharedHostPool
from vllm_aio.pool.shm_file import SHM_DIR

SLOT, SLOTS, TIMEOUT, GRACE, HEADER = 256, 64, 10.0, 6.0, 16


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool():
    name = f"test-{uuid.uuid4().hex[:16]}"
    p = SharedHostPool(name, SLOT, SLOTS)
    yield PoolSlots(p)  # what the embedded backend's ``slots()`` hands a migration
    p.close()
    for path in SHM_DIR.glob(f"vllm_aio*{name}*"):
        path.unlink(missing_ok=True)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def target(pool, clock):
    t = MigrationTarget(pool, TIMEOUT, GRACE, clock)
    yield t
    t.close()


def header(key: str) -> bytes:
    return key.encode().ljust(HEADER, b"\0")[:HEADER]


def blocks(n: int, parts: int = 2) -> list[list[str]]:
    tag = uuid.uuid4().hex[:6]
    return [[f"k{tag}-{b}-{p}" for p in range(parts)] for b in range(n)]


def write(pool: PoolSlots, slot: int, data: bytes) -> None:
    ctypes.memmove(pool.region()[0] + slot * pool.slot_size, data, len(data))


def allocate(target, keys, migration_id=None):
    return target.allocate(migration_id, 3, keys, [[header(k) for k in block] for block in keys])


def test_allocate_reserves_a_slot_per_part_invisible_to_lookups(pool, target):
    keys = blocks(3)
    res = allocate(target, keys)
    assert all(s >= 0 for block in res.slots for s in block)
    assert pool.writing_slots() == 6
    assert pool.contains([k for block in keys for k in block]) == [False] * 6


def test_allocate_skips_parts_the_pool_already_holds(pool, target):
    keys = blocks(2)
    [slot] = pool.reserve([keys[1][0]])
    pool.commit([slot])
    res = allocate(target, keys)
    assert res.slots[1][0] == -1 and res.slots[0][0] >= 0 and res.slots[1][1] >= 0


def test_repeated_allocate_of_one_id_returns_the_same_reservation(pool, target):
    keys = blocks(2)
    first = allocate(target, keys, "m1")
    again = allocate(target, keys, "m1")
    assert again.slots == first.slots and pool.writing_slots() == 4


def test_commit_publishes_the_blocks_whose_values_landed(pool, target):
    keys = blocks(2)
    res = allocate(target, keys)
    for block, slots in zip(keys, res.slots):
        for key, slot in zip(block, slots):
            write(pool, slot, header(key))
    answer = target.commit(res.migration_id, HEADER)
    assert answer["committed_blocks"] == 2 and answer["problem"] is None
    assert pool.contains([k for block in keys for k in block]) == [True] * 4


def test_commit_stops_at_the_first_block_with_a_part_not_written(pool, target):
    keys = blocks(3)
    res = allocate(target, keys)
    for b in (0, 2):  # block 1 never written
        for key, slot in zip(keys[b], res.slots[b]):
            write(pool, slot, header(key))
    answer = target.commit(res.migration_id, HEADER)
    assert answer["committed_blocks"] == 1 and "block 4" in answer["problem"]
    assert pool.contains(keys[0]) == [True, True]
    assert pool.contains(keys[2]) == [False, False]  # after the gap: never published


def test_commit_without_the_transfer_publishes_nothing(pool, target):
    keys = blocks(2)
    res = allocate(target, keys)
    answer = target.commit(res.migration_id, HEADER)
    assert answer["committed_blocks"] == 0 and "does not hold the expected value" in answer["problem"]
    assert not any(pool.contains([k for block in keys for k in block]))


def test_a_value_written_for_another_key_is_not_published(pool, target):
    keys = blocks(1)
    res = allocate(target, keys)
    write(pool, res.slots[0][0], header(keys[0][0]))
    write(pool, res.slots[0][1], header("someone-else"))
    assert target.commit(res.migration_id, HEADER)["committed_blocks"] == 0


def test_commit_twice_gives_the_same_answer(pool, target):
    keys = blocks(1)
    res = allocate(target, keys)
    for key, slot in zip(keys[0], res.slots[0]):
        write(pool, slot, header(key))
    assert target.commit(res.migration_id, HEADER) == target.commit(res.migration_id, HEADER)


def test_unknown_migration_id_is_rejected(target):
    with pytest.raises(MigrationRefused) as err:
        target.commit("nope", HEADER)
    assert err.value.status == 404


def test_watchdog_frees_an_uncommitted_reservation_once_late_writes_cannot_land(pool, target, clock):
    before = pool.writing_slots()
    allocate(target, blocks(4))
    clock.now += TIMEOUT + GRACE - 0.1
    target.sweep()
    assert pool.writing_slots() == before + 8  # expired, but a batch sent before the deadline may still land
    clock.now += 0.2
    target.sweep()
    assert pool.writing_slots() == before


def test_commit_after_the_watchdog_is_rejected(target, clock):
    res = allocate(target, blocks(1))
    clock.now += TIMEOUT
    with pytest.raises(MigrationRefused) as err:
        target.commit(res.migration_id, HEADER)
    assert err.value.status == 410 and "migration_watchdog_timeout" in str(err.value)


def test_aborted_slots_return_only_when_a_late_write_can_no_longer_land(pool, target, clock):
    res = allocate(target, blocks(2))
    assert target.abort(res.migration_id)["state"] == "aborted"
    target.sweep()
    assert pool.writing_slots() == 4  # the source may still be writing until its deadline
    clock.now += TIMEOUT + GRACE
    target.sweep()
    assert pool.writing_slots() == 0
    with pytest.raises(MigrationRefused) as err:
        target.commit(res.migration_id, HEADER)
    assert err.value.status == 409


def test_slots_after_a_partial_commit_are_held_until_the_deadline(pool, target, clock):
    keys = blocks(2)
    res = allocate(target, keys)
    for key, slot in zip(keys[0], res.slots[0]):
        write(pool, slot, header(key))
    target.commit(res.migration_id, HEADER)
    assert pool.writing_slots() == 2
    clock.now += TIMEOUT + GRACE
    target.sweep()
    assert pool.writing_slots() == 0


def test_oversized_allocation_is_refused_and_reserves_nothing(pool, target):
    with pytest.raises(MigrationRefused) as err:
        allocate(target, blocks(SLOTS // 2 // 2 + 1))
    assert err.value.status == 507 and "local_pool_size" in str(err.value)
    assert pool.writing_slots() == 0


def test_answers_are_forgotten_after_a_while(target, clock):
    res = allocate(target, blocks(1))
    clock.now += 3 * TIMEOUT
    target.sweep()
    with pytest.raises(MigrationRefused) as err:
        target.reservation(res.migration_id)
    assert err.value.status == 404


def test_an_expired_migration_answers_410_until_a_timeout_after_its_slots_are_back_in_the_pool(pool, clock):
    target = MigrationTarget(pool, TIMEOUT, 5 * TIMEOUT, clock)  # a late-write grace longer than the memory
    try:
        res = allocate(target, blocks(1))
        clock.now += TIMEOUT + 4 * TIMEOUT  # expired, slots still held: past 3 timeouts from the allocation
        target.sweep()
        assert pool.writing_slots() > 0
        with pytest.raises(MigrationRefused) as err:
            target.reservation(res.migration_id)
        assert err.value.status == 410
        clock.now += TIMEOUT
        target.sweep()
        assert pool.writing_slots() == 0
        for status in (410, 404):  # back in the pool: still known for one timeout
            with pytest.raises(MigrationRefused) as err:
                target.reservation(res.migration_id)
            assert err.value.status == status
            clock.now += TIMEOUT
            target.sweep()
    finally:
        target.close()
