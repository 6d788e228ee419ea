"""Unit tests of ``vllm_aio.pool.host_pool.SharedHostPool``: index, slots, block records, lifecycle.

Behaviour seen through the ``Backend`` contract (statuses, LRU, concurrency)
is tested in ``test_local_backend.py``; this file covers the pool's own API
and its life in ``/dev/shm`` (attach, seal, close, sweep of dead pools), and
the ids of ``pool/ids.py``. The pool is keyed by ids: values named by string
key or block hash go through the embedded backend's ``PoolSlots``.
Every test uses a pool name of its own and checks nothing is left behind.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time
import uuid

import fcntl
import numpy as np
import pytest

from vllm_aio.backends.local import PoolSlots
from vllm_aio.pool import shm_file
from vllm_aio.pool.host_pool import SLOT_NO_ROOM, SLOT_STORED, SharedHostPool, slots_for
from vllm_aio.pool.ids import BlockGroups, ValueIds, key_ids, namespace_groups, value_ids
from vllm_aio.pool.keys import BlockParts, block_key
from vllm_aio.pool.layout import MAGIC, Layout, PoolUsage
from vllm_aio.pool.shm_file import SHM_DIR, lock_path, pool_path

SLOT = 64


def leftovers(name: str) -> list[str]:
    return sorted(p.name for p in (pool_path(name), lock_path(name)) if p.exists())


@pytest.fixture
def new_name():
    """Makes unique pool names; removes whatever a failed test left in /dev/shm."""
    made: list[str] = []

    def make() -> str:
        made.append(f"test-{uuid.uuid4().hex[:16]}")
        return made[-1]

    yield make
    for name in made:
        for path in SHM_DIR.glob(f"vllm_aio.{name}*"):
            path.unlink(missing_ok=True)
        lock_path(name).unlink(missing_ok=True)  # a refused attach leaves ours behind


@pytest.fixture
def name(new_name) -> str:
    return new_name()


def reserve(pool: SharedHostPool, keys: list[str], retention: int = 0) -> list[int | None]:
    return PoolSlots(pool).reserve(keys, retention)


def contains(pool: SharedHostPool, keys: list[str]) -> list[bool]:
    return PoolSlots(pool).contains(keys)


def pin(pool: SharedHostPool, keys: list[str]) -> list[tuple[int, int] | None]:
    return PoolSlots(pool).pin_for_read(keys)


def store(pool: SharedHostPool, key: str, data: bytes) -> bool | None:
    """reserve + copy + commit one key: True stored, False lost/no room, None already there."""
    [slot] = reserve(pool, [key])
    if slot is None:
        return None
    if slot < 0:
        return False
    ctypes.memmove(pool.slot_address(slot), data, len(data))
    [won] = pool.commit([slot])
    return won


def load(pool: SharedHostPool, key: str) -> bytes | None:
    [pinned] = pin(pool, [key])
    if pinned is None:
        return None
    slot, version = pinned
    data = ctypes.string_at(pool.slot_address(slot), pool.slot_size)
    assert pool.still_valid(slot, version)
    return data


def value(tag: str) -> bytes:
    return (tag.encode() * SLOT)[:SLOT]


# ---- sizing ----------------------------------------------------------------


def test_slots_for_divides_pool_bytes_by_slot_size_and_keeps_at_least_one():
    assert slots_for(1000, 100) == 10
    assert slots_for(1099, 100) == 10
    assert slots_for(10, 100) == 1


@pytest.mark.parametrize("num_slots", [1, 7, 8, 9, 1000])
def test_index_table_is_a_power_of_two_at_most_half_full(num_slots):
    size = Layout(SLOT, num_slots).table_size
    assert size & (size - 1) == 0
    assert size >= 2 * num_slots


def test_slot_data_starts_page_aligned(name):
    pool = SharedHostPool(name, SLOT, 4)
    try:
        assert pool.slot_address(0) % 4096 == 0
        assert pool.slot_address(3) - pool.slot_address(0) == 3 * SLOT
    finally:
        pool.close()


def test_pool_file_size_covers_metadata_and_all_slots(name):
    pool = SharedHostPool(name, SLOT, 5)
    try:
        layout = Layout(SLOT, 5)
        assert pool_path(name).stat().st_size == layout.file_bytes
        assert layout.file_bytes >= 5 * SLOT + 8 * layout.table_size
    finally:
        pool.close()


# ---- index and slots ---------------------------------------------------------


def test_committed_value_reads_back_through_pin(name):
    pool = SharedHostPool(name, SLOT, 4)
    try:
        assert store(pool, "a", value("a")) is True
        assert load(pool, "a") == value("a")
    finally:
        pool.close()


def test_reserve_of_stored_key_returns_none(name):
    pool = SharedHostPool(name, SLOT, 4)
    try:
        store(pool, "a", value("a"))
        assert reserve(pool, ["a"]) == [None]
    finally:
        pool.close()


def test_reserved_but_uncommitted_key_is_not_visible(name):
    pool = SharedHostPool(name, SLOT, 4)
    try:
        [slot] = reserve(pool, ["a"])
        assert slot is not None and slot >= 0
        assert contains(pool, ["a"]) == [False]
        assert pin(pool, ["a"]) == [None]
        pool.abandon([slot])
    finally:
        pool.close()


def test_pin_for_read_of_absent_key_is_none(name):
    pool = SharedHostPool(name, SLOT, 4)
    try:
        store(pool, "a", value("a"))
        assert pin(pool, ["b", "a"])[0] is None
    finally:
        pool.close()


def test_contains_reports_each_key_in_order(name):
    pool = SharedHostPool(name, SLOT, 4)
    try:
        store(pool, "a", value("a"))
        store(pool, "c", value("c"))
        assert contains(pool, ["a", "b", "c"]) == [True, False, True]
    finally:
        pool.close()


def test_second_commit_of_same_key_loses_and_frees_its_slot(name):
    pool = SharedHostPool(name, SLOT, 4)
    try:
        [s1] = reserve(pool, ["a"])
        [s2] = reserve(pool, ["a"])  # a second writer before the first commits
        assert s1 != s2
        assert pool.commit([s1]) == [True]
        assert pool.commit([s2]) == [False]
        assert pool.usage().num_ready == 1
        for i in range(3):  # the three other slots, the lost one included
            assert store(pool, f"k{i}", value(str(i))) is True
        assert pool.usage().evictions == 0
    finally:
        pool.close()


def test_commit_publishes_each_slot_under_the_key_reserve_recorded(name):
    pool = SharedHostPool(name, SLOT, 4)
    try:
        slots = reserve(pool, ["a", "b", "c"])
        for key, slot in zip("abc", slots):
            ctypes.memmove(pool.slot_address(slot), value(key), SLOT)
        assert pool.commit([slots[2], slots[0]]) == [True, True]  # any subset, any order
        assert contains(pool, ["a", "b", "c"]) == [True, False, True]
        assert load(pool, "a") == value("a") and load(pool, "c") == value("c")
        pool.abandon([slots[1]])
    finally:
        pool.close()


def test_commit_counts_ready_slots_and_ticks_lru_in_batch_order(name):
    pool = SharedHostPool(name, SLOT, 3)
    try:
        assert pool.commit(reserve(pool, ["a", "b", "c"])) == [True] * 3
        assert pool.usage().num_ready == 3
        assert store(pool, "d", value("d")) is True  # evicts the first committed: "a"
        assert contains(pool, ["a", "b", "c", "d"]) == [False, True, True, True]
    finally:
        pool.close()


def test_evicted_slots_are_handed_out_in_slot_order(name):
    pool = SharedHostPool(name, SLOT, 4)
    try:
        for key in "abcd":  # slots 0..3
            assert store(pool, key, value(key)) is True
        contains(pool, ["c", "a", "d", "b"])  # LRU order: slots 2, 0, 3, 1
        slots = reserve(pool, ["w", "x", "y"])  # evicts c, a, d
        assert slots == [0, 2, 3]  # back to back where possible, so copies merge
        assert contains(pool, ["a", "b", "c", "d"]) == [False, True, False, False]
        pool.abandon(slots)
    finally:
        pool.close()


def test_eviction_takes_the_lowest_retention_class_first_and_lru_within_it(name):
    pool = SharedHostPool(name, SLOT, 4)
    try:
        assert pool.commit(reserve(pool, ["high1", "high2"], retention=1)) == [True, True]
        assert pool.commit(reserve(pool, ["low1", "low2"])) == [True, True]
        contains(pool, ["low2", "low1"])  # the low-class keys are now the most recently used
        for key in ("x", "y"):
            assert store(pool, key, value(key)) is True
        assert contains(pool, ["high1", "high2", "low1", "low2", "x", "y"]) == [True, True, False, False, True, True]
        assert store(pool, "z", value("z")) is True  # only class 0 is evicted while there is some: x
        assert contains(pool, ["high1", "high2", "x", "y", "z"]) == [True, True, False, True, True]
    finally:
        pool.close()


def test_a_key_stored_again_by_a_higher_class_is_kept_at_the_higher_class(name):
    pool = SharedHostPool(name, SLOT, 2)
    try:
        assert store(pool, "shared", value("s")) is True
        assert reserve(pool, ["shared"], retention=2) == [None]  # already stored: its class rises
        assert reserve(pool, ["shared"], retention=0) == [None]  # and never falls
        for key in ("a", "b", "c"):
            assert store(pool, key, value(key)) is True
        assert contains(pool, ["shared"]) == [True]
    finally:
        pool.close()


def test_a_leased_value_is_evicted_last_in_its_class_until_its_lease_ends(name):
    now = [10**12]
    pool = SharedHostPool(name, SLOT, 3, clock=lambda: now[0])
    try:
        for key in ("a", "b", "c"):
            assert store(pool, key, value(key)) is True
        assert pool.lease_ids(key_ids(["a"]), seconds=5) == 1
        assert store(pool, "d", value("d")) is True  # evicts "b": "a", older, is leased
        assert contains(pool, ["a", "b"]) == [True, False]
        now[0] += 5 * 10**9 + 1
        contains(pool, ["c", "d"])  # "a" is now the least recently used, and its lease is over
        assert store(pool, "e", value("e")) is True
        assert contains(pool, ["a", "c", "d", "e"]) == [False, True, True, True]
    finally:
        pool.close()


def test_a_lease_never_refuses_a_save_nor_outranks_a_retention_class(name):
    pool = SharedHostPool(name, SLOT, 2, clock=lambda: 10**12)
    try:
        assert pool.commit(reserve(pool, ["high"], retention=1)) == [True]
        assert store(pool, "low", value("low")) is True
        pool.lease_ids(key_ids(["low"]), seconds=60)
        assert store(pool, "x", value("x")) is True  # the leased low-class value goes, the high one stays
        assert contains(pool, ["high", "low", "x"]) == [True, False, True]
        pool.lease_ids(key_ids(["high", "x"]), seconds=60)
        assert store(pool, "y", value("y")) is True  # every value leased: still stored
        assert pool.lease_ids(key_ids(["absent"]), seconds=1) == 0
    finally:
        pool.close()


def test_a_lease_is_never_shortened_by_a_later_one(name):
    now = [10**12]
    pool = SharedHostPool(name, SLOT, 2, clock=lambda: now[0])
    try:
        for key in ("a", "b"):
            assert store(pool, key, value(key)) is True
        pool.lease_ids(key_ids(["a"]), seconds=10)
        pool.lease_ids(key_ids(["a"]), seconds=1)
        now[0] += 2 * 10**9
        assert store(pool, "c", value("c")) is True  # the first holder's lease still runs: "b" goes
        assert contains(pool, ["a", "b"]) == [True, False]
    finally:
        pool.close()


def test_abandoned_slot_is_reused_before_any_eviction(name):
    pool = SharedHostPool(name, SLOT, 2)
    try:
        store(pool, "a", value("a"))
        [slot] = reserve(pool, ["b"])
        pool.abandon([slot])
        assert store(pool, "c", value("c")) is True
        assert pool.usage().evictions == 0
        assert contains(pool, ["a", "c"]) == [True, True]
    finally:
        pool.close()


def test_reserve_beyond_capacity_with_nothing_evictable_returns_minus_one(name):
    pool = SharedHostPool(name, SLOT, 2)
    try:
        slots = reserve(pool, ["a", "b", "c"])
        assert sorted(slots[:2]) == [0, 1]
        assert slots[2] == -1
        pool.abandon(slots[:2])
    finally:
        pool.close()


def test_still_valid_holds_for_an_undisturbed_slot(name):
    pool = SharedHostPool(name, SLOT, 2)
    try:
        store(pool, "a", value("a"))
        [(slot, version)] = pin(pool, ["a"])
        assert pool.still_valid(slot, version)
    finally:
        pool.close()


def test_still_valid_fails_once_the_slot_is_evicted_and_reused(name):
    pool = SharedHostPool(name, SLOT, 1)
    try:
        store(pool, "a", value("a"))
        [(slot, version)] = pin(pool, ["a"])
        assert store(pool, "b", value("b")) is True  # evicts "a", reuses its slot
        assert not pool.still_valid(slot, version)
    finally:
        pool.close()


def test_usage_counts_ready_slots_bytes_evictions_and_lookups(name):
    pool = SharedHostPool(name, SLOT, 2)
    try:
        assert pool.usage() == PoolUsage(num_slots=2, num_ready=0, slot_size=SLOT, evictions=0,
                                                   lookups=0, hits=0)
        for key in "abc":
            store(pool, key, value(key))
        assert load(pool, "c") == value("c") and load(pool, "a") is None  # "a" was evicted
        usage = pool.usage()
        assert (usage.num_ready, usage.evictions, usage.bytes_used) == (2, 1, 2 * SLOT)
        assert (usage.lookups, usage.hits) == (2, 1)
    finally:
        pool.close()


# ---- lifecycle in /dev/shm -----------------------------------------------------


def test_a_new_pool_holds_all_its_memory_from_the_start(name):
    # Pages allocated on first write would be a SIGBUS mid-step once /dev/shm fills up.
    pool = SharedHostPool(name, SLOT, 64)
    try:
        st = os.stat(pool_path(name))
        assert st.st_blocks * 512 >= st.st_size
    finally:
        pool.close()


def test_a_pool_dev_shm_cannot_hold_fails_at_start_naming_local_pool_size_and_leaves_nothing(name, monkeypatch):
    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shm_file.os, "posix_fallocate", full)
    with pytest.raises(RuntimeError, match=r"local_pool_size: could not allocate .*No space left on device"):
        SharedHostPool(name, SLOT, 64)
    assert leftovers(name) == []


def test_first_attach_creates_the_pool_file_and_its_lock(name):
    pool = SharedHostPool(name, SLOT, 4)
    try:
        assert leftovers(name) == [f"vllm_aio.{name}", f"vllm_aio_lock.{name}"]
    finally:
        pool.close()
    assert leftovers(name) == []


def test_two_attachments_in_one_process_share_data(name):
    a = SharedHostPool(name, SLOT, 4)
    b = SharedHostPool(name, SLOT, 4)
    try:
        store(a, "k", value("k"))
        assert load(b, "k") == value("k")
    finally:
        a.close()
        b.close()


def test_pool_file_survives_until_the_last_attachment_closes(name):
    a = SharedHostPool(name, SLOT, 4)
    b = SharedHostPool(name, SLOT, 4)
    store(a, "k", value("k"))
    a.close()
    assert pool_path(name).exists()
    assert load(b, "k") == value("k")
    b.close()
    assert leftovers(name) == []


def test_seal_unlinks_the_name_while_attachments_keep_working(name):
    a = SharedHostPool(name, SLOT, 4)
    b = SharedHostPool(name, SLOT, 4)
    try:
        a.seal()
        assert leftovers(name) == []
        store(a, "k", value("k"))
        assert load(b, "k") == value("k")
        store(b, "j", value("j"))
        assert load(a, "j") == value("j")
    finally:
        a.close()
        b.close()
    assert leftovers(name) == []


def test_attach_after_seal_creates_a_new_empty_pool(name):
    a = SharedHostPool(name, SLOT, 4)
    store(a, "k", value("k"))
    a.seal()
    b = SharedHostPool(name, SLOT, 4)
    try:
        assert contains(b, ["k"]) == [False]
    finally:
        a.close()
        b.close()
    assert leftovers(name) == []


def test_close_twice_is_harmless(name):
    pool = SharedHostPool(name, SLOT, 4)
    pool.close()
    pool.close()
    assert leftovers(name) == []


def test_attach_with_other_slot_size_fails_naming_local_pool_name(name):
    pool = SharedHostPool(name, SLOT, 4)
    try:
        # The line an instance of another model or parallelism stops with at start.
        with pytest.raises(RuntimeError, match=rf"{name}.*give instances with different models or parallelism "
                                                "different local_pool_name values"):
            SharedHostPool(name, 2 * SLOT, 4)
        assert store(pool, "k", value("k")) is True  # the existing pool is untouched
    finally:
        pool.close()
    assert leftovers(name) == []


def test_failed_attach_leaks_no_file_descriptor(name):
    pool = SharedHostPool(name, SLOT, 4)
    try:
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(RuntimeError):
            SharedHostPool(name, 2 * SLOT, 4)
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        pool.close()


def test_attaching_adopts_the_existing_slot_count(name):
    a = SharedHostPool(name, SLOT, 4)
    b = SharedHostPool(name, SLOT, 100)
    try:
        assert b.usage().num_slots == 4
    finally:
        a.close()
        b.close()


def test_file_that_is_not_a_pool_is_refused(name):
    pool_path(name).write_bytes(b"\0" * 4096)
    pool_path(name).chmod(0o600)
    try:
        with pytest.raises(RuntimeError, match="not a vllm_aio pool"):
            SharedHostPool(name, SLOT, 4)
    finally:
        pool_path(name).unlink()
        lock_path(name).unlink(missing_ok=True)


def test_calls_after_close_raise(name):
    pool = SharedHostPool(name, SLOT, 4)
    pool.close()
    with pytest.raises(Exception):
        contains(pool, ["k"])


# ---- sweeping pools of dead processes ----------------------------------------------


def _create_pool_and_hang(name: str, ready) -> None:
    pool = SharedHostPool(name, SLOT, 4)  # noqa: F841 - kept mapped until killed
    ready.set()
    time.sleep(120)


def test_pool_whose_processes_all_died_is_swept_when_a_new_pool_is_created(new_name):
    dead, fresh = new_name(), new_name()
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_create_pool_and_hang, args=(dead, ready))
    child.start()
    try:
        assert ready.wait(60), "child did not create its pool"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)  # reaped: a zombie still answers kill(pid, 0)
    assert leftovers(dead) == [f"vllm_aio.{dead}", f"vllm_aio_lock.{dead}"]
    pool = SharedHostPool(fresh, SLOT, 4)
    try:
        assert leftovers(dead) == []
    finally:
        pool.close()
    assert leftovers(fresh) == []


def test_pool_with_a_live_process_is_not_swept(new_name):
    alive, fresh = new_name(), new_name()
    a = SharedHostPool(alive, SLOT, 4)
    b = SharedHostPool(fresh, SLOT, 4)
    try:
        assert pool_path(alive).exists()
    finally:
        a.close()
        b.close()


def test_pool_being_created_is_not_swept_by_a_concurrent_creator(new_name):
    # A creator maps its file and lists its pid before the magic goes in: until
    # then the file shows no live pid, and a sweeper must leave it alone.
    first, second = new_name(), new_name()
    pool_path(first).write_bytes(b"\0" * 8 * (16 + 256))  # header and pid table, all zero: no magic yet
    pool_path(first).chmod(0o600)
    pool = SharedHostPool(second, SLOT, 4)
    try:
        assert pool_path(first).exists()
    finally:
        pool.close()
        pool_path(first).unlink()


def test_attacher_racing_the_last_close_locks_the_lock_file_later_attachers_lock(name, monkeypatch):
    last = SharedHostPool(name, SLOT, 4)
    lock_file = os.fspath(lock_path(name))
    real_open = os.open
    armed = [True]

    def open_then_last_close(path, *args, **kwargs):
        fd = real_open(path, *args, **kwargs)
        if armed[0] and os.fspath(path) == lock_file:
            armed[0] = False
            last.close()  # the last attached process detaches right after this open
        return fd

    monkeypatch.setattr(shm_file.os, "open", open_then_last_close)
    racer = SharedHostPool(name, SLOT, 4)
    monkeypatch.undo()
    later = SharedHostPool(name, SLOT, 4)  # attaches through the lock file at the path now
    held = os.open(lock_file, os.O_RDWR)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        done = threading.Event()
        t = threading.Thread(target=lambda: (racer.commit(reserve(racer, ["a"])), done.set()))
        t.start()
        assert not done.wait(0.3)  # the racer waits for the lock of the file at the path
        fcntl.flock(held, fcntl.LOCK_UN)
        t.join(10)
        assert done.is_set() and contains(later, ["a"]) == [True]
    finally:
        os.close(held)
        racer.close()
        later.close()


# ---- block records ----------------------------------------------------------------

DIGEST = "0123456789abcdef"
PARTS = BlockParts(DIGEST, ("pp0.dcp0.h0", "pp0.dcp0.h1"), (0, 1, 2))  # 2 shards x 3 layers


def block_hashes(n: int, tag: str = "b") -> list[bytes]:
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(n)]


def put_keys(pool: SharedHostPool, keys: list[str]) -> None:
    assert all(pool.commit([s for s in reserve(pool, keys) if s is not None]))


def complete(pool: SharedHostPool, hashes: list[bytes], parts: BlockParts = PARTS) -> int:
    return pool.complete_blocks(namespace_groups(parts.namespace_digest, parts.layered, hashes), parts.count)


def test_a_block_is_complete_once_every_part_is_committed(name):
    pool = SharedHostPool(name, SLOT, 64)
    hashes = block_hashes(3)
    keys = [k for h in hashes for k in PARTS.keys(h)]
    slots = reserve(pool, keys)
    assert complete(pool, hashes) == 0  # reserved, not yet committed
    pool.commit(slots[:-1])  # every part but the last block's last
    assert complete(pool, hashes) == 2
    pool.commit(slots[-1:])
    assert complete(pool, hashes) == 3
    pool.close()


def test_lookup_stops_at_the_first_block_missing_a_part(name):
    pool = SharedHostPool(name, SLOT, 64)
    hashes = block_hashes(4)
    put_keys(pool, [k for i, h in enumerate(hashes) for k in PARTS.keys(h) if i != 1 or "h1" not in k])
    assert complete(pool, hashes) == 1  # block 1 lacks shard h1; blocks 2-3 are complete but follow it
    assert complete(pool, hashes[2:]) == 2
    pool.close()


def test_evicting_any_part_makes_its_block_incomplete(name):
    pool = SharedHostPool(name, SLOT, PARTS.count * 2)  # room for two blocks
    hashes = block_hashes(3)
    put_keys(pool, PARTS.keys(hashes[0]) + PARTS.keys(hashes[1]))
    assert complete(pool, hashes[:2]) == 2
    put_keys(pool, [PARTS.keys(hashes[2])[0]])  # evicts the least recently used part: block 0's first
    assert pool.usage().evictions == 1
    assert complete(pool, hashes[:2]) == 0
    assert complete(pool, hashes[1:2]) == 1
    pool.close()


def test_records_are_apart_per_namespace_and_per_kind_of_value(name):
    pool = SharedHostPool(name, SLOT, 64)
    [h] = block_hashes(1)
    whole = BlockParts(DIGEST, PARTS.shards, (None,))
    other = BlockParts("fedcba9876543210", PARTS.shards, PARTS.tags)
    put_keys(pool, PARTS.keys(h))
    assert complete(pool, [h], PARTS) == 1
    assert complete(pool, [h], whole) == 0  # layer values never count for whole-block values
    assert complete(pool, [h], other) == 0
    put_keys(pool, whole.keys(h))
    assert (complete(pool, [h], whole), complete(pool, [h], PARTS)) == (1, 1)
    pool.close()


def test_keys_that_are_not_block_keys_have_no_record(name):
    pool = SharedHostPool(name, SLOT, 4)
    put_keys(pool, ["k1", "aio:not:a:hexhash", "aio:x:y"])
    assert complete(pool, block_hashes(2)) == 0
    put_keys(pool, ["k2", "k3"])  # evicts two of them without touching any record
    assert pool.usage().evictions == 1
    pool.close()


def test_records_are_shared_by_every_process_attached(name):
    first = SharedHostPool(name, SLOT, 64)
    second = SharedHostPool(name, SLOT, 64)
    hashes = block_hashes(2)
    put_keys(first, PARTS.keys(hashes[0]))
    put_keys(second, PARTS.keys(hashes[1]))
    assert complete(first, hashes) == complete(second, hashes) == 2
    second.close()
    first.close()


def test_many_blocks_colliding_in_the_record_table_are_each_found(name):
    # A full table's worth of records, inserted and half evicted: linear probing and backward-shift deletion.
    parts = BlockParts(DIGEST, ("pp0.dcp0.h0",), (None,))
    pool = SharedHostPool(name, SLOT, 512)
    hashes = block_hashes(768)
    for start in range(0, 768, 256):  # the last batch evicts the first
        put_keys(pool, [parts.keys(h)[0] for h in hashes[start : start + 256]])
    assert complete(pool, hashes[256:], parts) == 512
    assert all(complete(pool, [h], parts) == 0 for h in hashes[:256])
    pool.close()


def test_hashes_of_other_sizes_get_distinct_records(name):
    pool = SharedHostPool(name, SLOT, 64)
    short, long_ = [b"a", b"ab", b"abc"], [bytes(range(40)), bytes(range(1, 41))]
    parts = BlockParts(DIGEST, ("pp0.dcp0.h0",), (None,))
    put_keys(pool, [parts.keys(h)[0] for h in short + long_])
    assert complete(pool, short + long_, parts) == 5
    assert complete(pool, [b"abd", bytes(range(2, 42))], parts) == 0
    pool.close()


def test_a_block_key_is_found_from_its_hash_alone(name):
    from vllm_aio.pool.keys import block_key

    pool = SharedHostPool(name, SLOT, 8)
    try:
        hashes = [hashlib.sha256(bytes([i])).digest() for i in range(4)]  # as vLLM's block hashes
        keys = [block_key("0123456789abcdef", "pp0.dcp0.h0", h, 3) for h in hashes]
        pool.commit(reserve(pool, keys[:2] + ["not-a-block-key"]))
        slots, versions = PoolSlots(pool).pin_blocks("0123456789abcdef", "pp0.dcp0.h0", 3, hashes)
        pinned = pin(pool, keys)
        assert [None if s < 0 else (s, v) for s, v in zip(slots.tolist(), versions.tolist())] == pinned
        assert slots[2] == slots[3] == -1 and pinned[0] is not None
        # Another layer, shard or namespace names other values.
        assert (PoolSlots(pool).pin_blocks("0123456789abcdef", "pp0.dcp0.h0", 4, hashes)[0] == -1).all()
        assert (PoolSlots(pool).pin_blocks("0123456789abcdef", "pp0.dcp0.h1", 3, hashes)[0] == -1).all()
        assert pool.unchanged(slots[:2], versions[:2]).all()
        pool.commit(reserve(pool, [f"evict{i}" for i in range(8)]))  # evicts and rewrites every slot
        assert not pool.unchanged(slots[:2], versions[:2]).any()
    finally:
        pool.close()


STRUCTURED = [b"A" * 16 + b"B" * 16, b"B" * 16 + b"A" * 16, b"A" * 32, b"B" * 32, b"ab", b"ab\0"]
# swapped halves, equal halves, padding; then the equal words that once made block records collide
STRUCTURED += [bytes([i]) * 32 for i in range(6)]
ID_FUNCTIONS = {
    "value_ids": lambda hashes: value_ids("0123456789abcdef", "pp0.dcp0.h0", 0, hashes),
    "block_records": lambda hashes: namespace_groups("0123456789abcdef", False, hashes),
}


@pytest.mark.parametrize("ids_of", ID_FUNCTIONS.values(), ids=ID_FUNCTIONS.keys())
def test_ids_tell_apart_hashes_with_structure(ids_of):
    ids = ids_of(STRUCTURED)
    assert len(set(zip(ids.hi.tolist(), ids.lo.tolist()))) == len(STRUCTURED)


@pytest.mark.parametrize("ids_of", ID_FUNCTIONS.values(), ids=ID_FUNCTIONS.keys())
def test_an_id_does_not_depend_on_the_rest_of_its_batch(ids_of):
    hashes = [f"req:{i}".encode() for i in (0, 10, 100, 1000)] + [hashlib.sha256(b"x").digest()]
    together = ids_of(hashes)
    for i, h in enumerate(hashes):
        alone = ids_of([h])
        assert (alone.hi[0], alone.lo[0]) == (together.hi[i], together.lo[i])


def test_a_block_with_structured_hash_is_complete_only_once_stored(name):
    pool = SharedHostPool(name, SLOT, 16)
    try:
        hashes = [bytes([i]) * 32 for i in range(6)]
        pool.commit(reserve(pool, [block_key("0123456789abcdef", "pp0.dcp0.h0", hashes[0])]))
        assert pool.complete_blocks(namespace_groups("0123456789abcdef", False, hashes), 1) == 1
    finally:
        pool.close()


# ---- files another local user may have planted ---------------------------------------
OTHER_UID = 65534  # nobody


def plant(path, data: bytes = b"\0" * 4096, mode: int = 0o666, uid: int | None = None) -> None:
    path.write_bytes(data)
    path.chmod(mode)
    if uid is not None:
        os.chown(path, uid, uid)


def needs_root():
    if os.geteuid() != 0:
        pytest.skip("planting a file owned by another uid needs root")


def test_created_pool_and_lock_files_are_private_to_this_user(name):
    pool = SharedHostPool(name, SLOT, 4)
    try:
        for path in (pool_path(name), lock_path(name)):
            st = os.stat(path)
            assert st.st_uid == os.geteuid() and st.st_mode & 0o077 == 0, oct(st.st_mode)
    finally:
        pool.close()


@pytest.mark.parametrize("which", ["pool", "lock"])
def test_a_file_another_user_planted_is_refused(name, which):
    needs_root()
    path = pool_path(name) if which == "pool" else lock_path(name)
    plant(path, mode=0o600, uid=OTHER_UID)
    try:
        with pytest.raises(RuntimeError, match=f"owned by uid {OTHER_UID}"):
            SharedHostPool(name, SLOT, 4)
        assert path.read_bytes() == b"\0" * 4096  # not written
    finally:
        path.unlink(missing_ok=True)


def test_a_pool_file_readable_by_others_is_refused(name):
    plant(pool_path(name), mode=0o666)
    try:
        with pytest.raises(RuntimeError, match="mode 0666"):
            SharedHostPool(name, SLOT, 4)
    finally:
        pool_path(name).unlink()
        lock_path(name).unlink(missing_ok=True)


@pytest.mark.parametrize("which", ["pool", "lock"])
def test_a_symlink_of_our_name_is_not_followed(name, which, tmp_path):
    path = pool_path(name) if which == "pool" else lock_path(name)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"secret")
    path.symlink_to(target)
    try:
        with pytest.raises(RuntimeError, match="symbolic link"):
            SharedHostPool(name, SLOT, 4)
    finally:
        path.unlink()
        lock_path(name).unlink(missing_ok=True)
    assert target.read_bytes() == b"secret"


def test_a_pool_of_an_older_version_gets_a_clear_error(name):
    head = np.zeros(16, dtype=np.int64)
    head[0] = 0x41494F504F4F4C31  # "AIOPOOL1"
    plant(pool_path(name), head.tobytes() + b"\0" * 4096, mode=0o600)
    try:
        with pytest.raises(RuntimeError, match="older vllm_aio version"):
            SharedHostPool(name, SLOT, 4)
    finally:
        pool_path(name).unlink()
        lock_path(name).unlink(missing_ok=True)


def test_sweeping_dead_pools_leaves_other_users_files_alone(name, new_name):
    needs_root()
    head = np.zeros(16 + 256, dtype=np.int64)
    head[0], head[16] = MAGIC, 2**22 + 12345  # a pool whose only pid is dead
    theirs = pool_path(new_name())
    plant(theirs, head.tobytes(), mode=0o600, uid=OTHER_UID)
    try:
        SharedHostPool(name, SLOT, 4).close()  # creating a pool sweeps dead ones
        assert theirs.exists()
    finally:
        theirs.unlink()


# ---- saves by block hash, batches, churn -------------------------------------------


def test_reserve_blocks_answers_as_reserve_of_the_block_keys_would(name):
    shard, tag = "pp0.dcp0.h0", 3
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(6)]
    keys = [block_key(DIGEST, shard, h, tag) for h in hashes]
    pool = SharedHostPool(name, SLOT, 8)
    try:
        put_keys(pool, keys[:3])  # stored through the string keys
        slots = PoolSlots(pool).reserve_blocks(DIGEST, shard, tag, hashes)
        assert (slots[:3] == SLOT_STORED).all() and (slots[3:] >= 0).all()
        assert pool.commit(slots[3:]) == [True] * 3  # an array, as the direct path passes it
        # The same ids as the strings': every key is found where reserve_blocks put it, and stored.
        assert [slot for slot, _ in pin(pool, keys)][3:] == slots[3:].tolist()
        assert reserve(pool, keys) == [None] * 6
        # And the same block records: each block has its one part.
        assert complete(pool, hashes, BlockParts(DIGEST, (shard,), (tag,))) == 6
        # No room: every slot reserved (the stored values evicted for it), and both say so alike.
        writing = PoolSlots(pool).reserve_array([f"w{i}" for i in range(8)])
        assert PoolSlots(pool).reserve_blocks(DIGEST, shard, tag, hashes).tolist() == [SLOT_NO_ROOM] * 6
        assert reserve(pool, keys) == [-1] * 6
        pool.abandon(writing)
    finally:
        pool.close()


def test_a_batch_committing_one_key_twice_stores_it_once(name):
    [h] = block_hashes(1)
    key = block_key(DIGEST, "pp0.dcp0.h0", h)
    pool = SharedHostPool(name, SLOT, 4)
    try:
        [first], [second] = reserve(pool, [key]), reserve(pool, [key])  # two writers, neither committed
        assert pool.commit([first, second]) == [True, False]
        assert pool.usage().num_ready == 1
        assert pool.block_parts(namespace_groups(DIGEST, False, [h])).tolist() == [1]  # counted once
        # The loser's slot is free again: three more values fit without an eviction.
        assert sorted(PoolSlots(pool).reserve_array(["a", "b", "c"]).tolist()) == sorted({0, 1, 2, 3} - {first})
        assert pool.usage().evictions == 0
    finally:
        pool.close()


class PoolModel:
    """What a pool of ``num_slots`` slots should hold, in plain Python: READY keys by last use, reservations."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.last_used: dict[str, int] = {}  # READY keys
        self.pending: dict[int, str] = {}  # reserved slot -> its key
        self.clock = self.evictions = self.lookups = self.hits = 0

    def touch(self, key: str) -> None:
        self.clock += 1
        self.last_used[key] = self.clock

    def reserve(self, keys: list[str]) -> tuple[list[str], list[str]]:
        """(the keys that get a slot, those stored already: the same batch may evict them); the rest: no room."""
        missing = [k for k in keys if k not in self.last_used]
        stored = [k for k in keys if k in self.last_used]
        for key in keys:
            if key in self.last_used:
                self.touch(key)
        free = self.num_slots - len(self.last_used) - len(self.pending)
        evicted = sorted(self.last_used, key=self.last_used.__getitem__)[: max(0, len(missing) - free)]
        for key in evicted:
            del self.last_used[key]
        self.evictions += len(evicted)
        return missing[: free + len(evicted)], stored

    def commit(self, slots: list[int]) -> list[bool]:
        out = []
        for slot in slots:
            key = self.pending.pop(slot)
            out.append(key not in self.last_used)
            if out[-1]:
                self.touch(key)
        return out

    def pin(self, keys: list[str]) -> list[bool]:
        found = [k in self.last_used for k in keys]
        for key in (k for k, f in zip(keys, found) if f):
            self.touch(key)
        self.lookups, self.hits = self.lookups + len(keys), self.hits + sum(found)
        return found

    def evict_all(self) -> None:
        self.evictions += len(self.last_used)
        self.last_used.clear()


@pytest.mark.parametrize("seed", range(4))
def test_records_and_index_stay_exact_through_random_saves_and_evictions(name, seed):
    rng = np.random.default_rng(seed)
    parts = BlockParts(DIGEST, ("pp0.dcp0.h0",), (0, 1, 2))
    hashes = block_hashes(10, tag=f"r{seed}")
    keys = {(h, t): block_key(DIGEST, parts.shards[0], h, t) for h in hashes for t in parts.tags}
    groups = namespace_groups(DIGEST, True, hashes)
    pool, model = SharedHostPool(name, SLOT, 16), PoolModel(16)
    try:
        for _ in range(300):
            op = rng.choice(["reserve", "reserve_blocks", "commit", "abandon", "pin", "evict_all"],
                            p=[0.3, 0.3, 0.2, 0.05, 0.13, 0.02])
            if op == "reserve":
                chosen = [list(keys.values())[i] for i in rng.choice(len(keys), rng.integers(1, 9), replace=False)]
                slots = reserve(pool, chosen)
            elif op == "reserve_blocks":
                tag = int(rng.choice(parts.tags))
                picked = [hashes[i] for i in rng.choice(len(hashes), rng.integers(1, 7), replace=False)]
                chosen = [keys[h, tag] for h in picked]
                slots = [None if s == SLOT_STORED else s
                         for s in PoolSlots(pool).reserve_blocks(DIGEST, parts.shards[0], tag, picked).tolist()]
            if op in ("reserve", "reserve_blocks"):
                granted, stored = model.reserve(chosen)
                assert [k for k, s in zip(chosen, slots) if s is not None and s >= 0] == granted
                assert [k for k, s in zip(chosen, slots) if s is None] == stored
                model.pending.update((s, k) for k, s in zip(chosen, slots) if s is not None and s >= 0)
            elif op == "commit" and model.pending:
                batch = list(rng.permutation(list(model.pending))[: rng.integers(1, len(model.pending) + 1)])
                assert pool.commit(np.asarray(batch)) == model.commit([int(s) for s in batch])
            elif op == "abandon" and model.pending:
                slot = int(rng.choice(list(model.pending)))
                pool.abandon([slot])
                del model.pending[slot]
            elif op == "pin":
                asked = list(keys.values())
                assert [p is not None for p in pin(pool, asked)] == model.pin(asked)
            elif op == "evict_all":
                pool.evict_values()
                model.evict_all()
            stored = [sum(keys[h, t] in model.last_used for t in parts.tags) for h in hashes]
            assert pool.block_parts(groups).tolist() == stored
            complete_now = [n == parts.count for n in stored] + [False]
            assert pool.complete_blocks(groups, parts.count) == complete_now.index(False)
            usage = pool.usage()
            assert (usage.num_ready, usage.evictions, usage.lookups, usage.hits) == (
                len(model.last_used), model.evictions, model.lookups, model.hits)
        assert pool.writing_slots() == len(model.pending)
    finally:
        pool.close()


def test_every_key_stays_findable_through_churn_in_a_tiny_table_of_collisions(name):
    # 8 slots: a 16-bucket table. Every id's home is one of 3 buckets, and every
    # block record's too: long probe runs that eviction deletes from the middle of.
    pool = SharedHostPool(name, SLOT, 8)
    rng = np.random.default_rng(0)
    universe = np.arange(40, dtype=np.int64)
    lo = universe * 16 + universe % 3  # homes 0, 1, 2
    hi = universe + 1
    pair = universe // 2  # two values per record
    groups = BlockGroups(pair * 2 + 1, pair * 16 + pair % 3)
    try:
        stored: set[int] = set()
        for _ in range(200):
            batch = rng.choice(universe, rng.integers(1, 6), replace=False)
            slots = pool.reserve_ids(ValueIds(hi[batch], lo[batch]), BlockGroups(groups.hi[batch], groups.lo[batch]))
            fresh = slots >= 0
            won = pool.commit(slots[fresh])
            stored |= set(batch[slots == SLOT_STORED].tolist()) | set(batch[fresh][won].tolist())
            present = pool.pin_ids(ValueIds(hi, lo))[0] >= 0
            stored &= set(universe[present].tolist())  # what eviction took
            assert set(universe[present].tolist()) == stored and len(stored) == pool.usage().num_ready <= 8
            # Each record counts exactly the values of its ids that are found.
            parts = pool.block_parts(groups)
            assert (parts == np.bincount(pair, weights=present)[pair]).all()
    finally:
        pool.close()


def test_a_free_lock_is_taken_without_the_blocking_flock_call(name, monkeypatch):
    # fcntl.flock releases the GIL, and getting it back can wait for another thread's
    # Python: the pool takes a free lock with a call that keeps the GIL instead.
    pool = SharedHostPool(name, SLOT, 4)
    try:
        def blocking_flock(fd, op):
            raise AssertionError("the lock was free: no blocking flock call")

        monkeypatch.setattr(shm_file.fcntl, "flock", blocking_flock)
        pool.commit(reserve(pool, ["a"]))
        assert contains(pool, ["a", "b"]) == [True, False]
    finally:
        monkeypatch.undo()
        pool.close()


def test_a_lock_held_elsewhere_is_waited_for(name):
    pool = SharedHostPool(name, SLOT, 4)
    other = os.open(lock_path(name), os.O_RDWR)  # its own open file: a lock of its own
    try:
        fcntl.flock(other, fcntl.LOCK_EX)
        released = []

        def release() -> None:
            time.sleep(0.3)
            released.append(True)
            fcntl.flock(other, fcntl.LOCK_UN)

        t = threading.Thread(target=release)
        t.start()
        pool.commit(reserve(pool, ["a"]))  # blocks until the other holder lets go
        assert released == [True]
        t.join()
    finally:
        os.close(other)
        pool.close()
