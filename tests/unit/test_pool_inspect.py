"""``vllm-aio pool ls | stats | clear`` (``vllm_aio.pool.inspect``) against real pools in /dev/shm.

Every test uses pools of its own name and removes them; nothing here touches
a pool it did not make.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import threading
import uuid

import pytest

from vllm_aio.cli import main
from vllm_aio.pool import inspect
from vllm_aio.pool.entry import EntryHeader
from vllm_aio.backends.local import PoolSlots
from vllm_aio.pool.host_pool import SharedHostPool
from vllm_aio.pool.shm_file import SHM_DIR, lock_path, pool_path

SLOT = 64
NS_A, NS_B = "a" * 16, "b" * 16


@pytest.fixture
def new_name():
    made: list[str] = []

    def make() -> str:
        made.append(f"test-inspect-{uuid.uuid4().hex[:12]}")
        return made[-1]

    yield make
    for name in made:
        for path in (pool_path(name), lock_path(name)):
            path.unlink(missing_ok=True)


@pytest.fixture
def pool(new_name):
    pool = SharedHostPool(new_name(), SLOT, 8)
    yield pool
    pool.close()


def entry(namespace: str, tag: bytes) -> bytes:
    """A value as the connector stores it: its header (SLOT bytes here) names the namespace."""
    return EntryHeader(namespace, "pp0.dcp0.h0", -1, 32, 0).pack(tag.ljust(8, b"\0"))


def put(pool: SharedHostPool, key: str, data: bytes) -> None:
    [slot] = PoolSlots(pool).reserve([key])
    ctypes.memmove(pool.slot_address(slot), data, len(data))
    assert pool.commit([slot]) == [True]


def test_ls_shows_size_entries_fill_hits_and_our_pid(pool, capsys):
    put(pool, "k1", entry(NS_A, b"1"))
    put(pool, "k2", entry(NS_A, b"2"))
    PoolSlots(pool).pin_for_read(["k1", "k2", "absent"])

    infos, _ = inspect.list_pools()
    (info,) = [i for i in infos if i.name == pool.name]
    assert (info.snapshot.usage.num_ready, info.snapshot.usage.hits, info.snapshot.usage.lookups) == (2, 2, 3)
    assert info.snapshot.pids == (os.getpid(),) and not info.stale

    assert main(["pool", "ls"]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith(pool.name)]
    assert row.split()[2:6] == ["2", "25.0%", "2/3", "0"]
    assert str(os.getpid()) in row and "in use" in row


def test_stats_counts_values_per_namespace(pool, capsys):
    put(pool, "a1", entry(NS_A, b"1"))
    put(pool, "a2", entry(NS_A, b"2"))
    put(pool, "b1", entry(NS_B, b"1"))
    put(pool, "raw", b"no header".ljust(SLOT, b"\0"))

    assert inspect.namespaces(inspect.read_pool(pool.name).snapshot) == {NS_A: 2, NS_B: 1, "-": 1}
    assert main(["pool", "stats", pool.name]) == 0
    out = capsys.readouterr().out
    assert "entries:       4 (50.0% full" in out
    assert f"{NS_A}  2" in out


def test_reading_a_pool_takes_no_lock_and_changes_nothing(pool):
    put(pool, "k", entry(NS_A, b"1"))
    before = pool.usage()
    # An instance holding the pool's lock (another open file of it, as another process would).
    holder = os.open(lock_path(pool.name), os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        reader = threading.Thread(target=inspect.read_pool, args=(pool.name,), daemon=True)
        reader.start()
        reader.join(30)
        assert not reader.is_alive(), "reading the pool waited for its lock"
    finally:
        fcntl.flock(holder, fcntl.LOCK_UN)
        os.close(holder)
    assert pool.usage() == before  # no lookup counted, no LRU tick, nothing evicted
    assert inspect.read_pool(pool.name).snapshot.pids == (os.getpid(),)  # and no pid entry added


def test_clear_of_one_namespace_keeps_the_rest_and_values_being_written(pool, capsys):
    put(pool, "a1", entry(NS_A, b"1"))
    put(pool, "b1", entry(NS_B, b"1"))
    [writing] = PoolSlots(pool).reserve(["a2"])
    ctypes.memmove(pool.slot_address(writing), entry(NS_A, b"2"), SLOT)

    assert main(["pool", "clear", pool.name, "--namespace", NS_A]) == 0
    assert f"evicted 1 values of namespace {NS_A}" in capsys.readouterr().out
    assert PoolSlots(pool).contains(["a1", "b1"]) == [False, True]
    assert pool.usage().evictions == 1  # the presence epoch tells schedulers something went
    assert pool.commit([writing]) == [True]  # the put in flight completes
    assert PoolSlots(pool).contains(["a2"]) == [True]
    assert pool_path(pool.name).exists()


def test_a_reader_that_pinned_a_cleared_value_sees_it_changed(pool):
    put(pool, "k", entry(NS_A, b"1"))
    [(slot, version)] = PoolSlots(pool).pin_for_read(["k"])
    assert inspect.clear(pool.name).evicted == 1
    assert not pool.still_valid(slot, version)


def _attach_and_die(name: str) -> None:
    pid = os.fork()
    if pid == 0:  # the child attaches and exits without detaching, as a killed instance does
        SharedHostPool(name, SLOT, 8)
        os._exit(0)
    os.waitpid(pid, 0)  # reaped: a zombie still answers kill(pid, 0)


def test_a_pool_whose_processes_died_is_listed_stale_and_removed_by_clear(new_name, capsys):
    name = new_name()
    _attach_and_die(name)
    (info,) = [i for i in inspect.list_pools()[0] if i.name == name]
    assert info.stale and info.snapshot.dead_pids == 1

    assert main(["pool", "clear", name]) == 0
    assert "no live process used it: removed" in capsys.readouterr().out
    assert not pool_path(name).exists() and not lock_path(name).exists()


def test_files_that_are_not_pools_are_reported_and_never_cleared(new_name, capsys):
    name, tiny, orphan = new_name(), new_name(), new_name()
    pool_path(name).write_bytes(b"\0" * 4096)
    pool_path(tiny).write_bytes(b"\0" * 5)  # shorter than a header
    for path in (pool_path(name), pool_path(tiny)):
        path.chmod(0o600)
    lock_path(orphan).touch()

    assert main(["pool", "ls"]) == 0
    out = capsys.readouterr().out
    assert f"unreadable: {pool_path(name)} is not a vllm_aio pool" in out
    assert f"lock file without a pool (left over, or a pool being created): {orphan}" in out
    assert main(["pool", "clear", name]) == 1
    assert "is not a vllm_aio pool" in capsys.readouterr().err
    assert pool_path(name).read_bytes() == b"\0" * 4096


def test_clear_refuses_a_missing_pool_and_a_malformed_namespace(pool, capsys):
    assert main(["pool", "clear", f"{pool.name}-missing"]) == 1
    assert "no pool" in capsys.readouterr().err
    assert not (SHM_DIR / f"vllm_aio.{pool.name}-missing").exists()
    assert main(["pool", "clear", pool.name, "--namespace", "model-x"]) == 1
    assert "expected the 16 hex digits" in capsys.readouterr().err
