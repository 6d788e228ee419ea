"""Unit tests of ``vllm_aio.backends.local.LocalBackend``: what the embedded pool does beyond the contract.

The contract every backend keeps (round trips, missing keys, wrong sizes,
repeated keys, close) is in ``test_backend_contract.py``. Here: its statuses
(EXISTS), LRU eviction and capacity, readers racing evictions, multi-threaded
copies, sharing between backends and processes. Values are scattered over
several segments (as a KV block is over layers); pools are a few slots so that
eviction is exercised. Every test uses a pool name of its own and checks
nothing is left in /dev/shm after close.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import random
import threading
import uuid

import numpy as np
import pytest

from vllm_aio.device import host_copy
from vllm_aio.backends import local
from vllm_aio.backends.base import Status
from vllm_aio.backends.local import LocalBackend
from vllm_aio.pool.shm_file import SHM_DIR, pool_path
from vllm_aio.pool.keys import BlockParts

SEGMENT_SIZES = (100, 28, 256, 128)  # a value scattered over 4 regions
VALUE = sum(SEGMENT_SIZES)


def leftovers(name: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"vllm_aio.{name}*"))


@pytest.fixture
def name():
    name = f"test-{uuid.uuid4().hex[:16]}"
    yield name
    for path in SHM_DIR.glob(f"vllm_aio.{name}*"):  # only after a failed test
        path.unlink(missing_ok=True)


def open_backend(name: str, slots: int, value: int = VALUE, seal: bool = False) -> LocalBackend:
    return LocalBackend(name, slots * value, value, seal=seal)


def payload(key: str, size: int = VALUE) -> np.ndarray:
    """Deterministic bytes of a key's value."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def segments_of(buf: np.ndarray, sizes=SEGMENT_SIZES) -> list[tuple[int, int]]:
    out, pos = [], 0
    for size in sizes:
        out.append((buf.ctypes.data + pos, size))
        pos += size
    return out


def put(backend: LocalBackend, keys: list[str], size: int = VALUE) -> list[Status]:
    bufs = [payload(k, size) for k in keys]
    sizes = SEGMENT_SIZES if size == VALUE else (size,)
    return backend.batch_put(keys, [segments_of(b, sizes) for b in bufs])


def get(backend: LocalBackend, keys: list[str], size: int = VALUE) -> tuple[list[Status], list[np.ndarray]]:
    bufs = [np.full(size, 0xEE, dtype=np.uint8) for _ in keys]
    sizes = SEGMENT_SIZES if size == VALUE else (size,)
    return backend.batch_get(keys, [segments_of(b, sizes) for b in bufs]), bufs


# ---- statuses and sizes ------------------------------------------------------------


def test_segments_may_split_a_value_differently_on_put_and_get(name):
    backend = open_backend(name, slots=4)
    try:
        put(backend, ["k"])
        out = np.zeros(VALUE, dtype=np.uint8)
        sizes = (1, VALUE - 2, 1)
        assert backend.batch_get(["k"], [segments_of(out, sizes)]) == [Status.OK]
        assert np.array_equal(out, payload("k"))
    finally:
        backend.close()


def test_put_of_existing_key_reports_exists_without_copying(name):
    backend = open_backend(name, slots=4)
    try:
        put(backend, ["k"])
        other = payload("something else")
        assert backend.batch_put(["k"], [segments_of(other)]) == [Status.EXISTS]
        statuses, [buf] = get(backend, ["k"])
        assert statuses == [Status.OK]
        assert np.array_equal(buf, payload("k"))
        assert backend.pool.usage().num_ready == 1
    finally:
        backend.close()


def test_put_with_wrong_total_size_does_not_leak_its_slot(name):
    backend = open_backend(name, slots=4)
    try:
        put(backend, ["bad"], size=VALUE - 1)
        assert put(backend, [f"k{i}" for i in range(4)]) == [Status.OK] * 4
        usage = backend.pool.usage()
        assert (usage.num_ready, usage.evictions) == (4, 0)
    finally:
        backend.close()


# ---- LRU eviction and capacity -----------------------------------------------------


def test_lru_keeps_key_touched_by_batch_exists_and_evicts_oldest_untouched(name):
    backend = open_backend(name, slots=4)
    try:
        for key in ["k0", "k1", "k2", "k3"]:
            put(backend, [key])
        backend.batch_exists(["k0"])
        assert put(backend, ["k4"]) == [Status.OK]
        assert backend.batch_exists(["k0", "k1", "k2", "k3", "k4"]) == [True, False, True, True, True]
        assert backend.pool.usage().evictions == 1
    finally:
        backend.close()


def test_lru_keeps_key_touched_by_get(name):
    backend = open_backend(name, slots=2)
    try:
        put(backend, ["k0"])
        put(backend, ["k1"])
        get(backend, ["k0"])
        put(backend, ["k2"])
        assert backend.batch_exists(["k0", "k1", "k2"]) == [True, False, True]
    finally:
        backend.close()


def test_lru_keeps_key_touched_by_a_repeated_put(name):
    backend = open_backend(name, slots=2)
    try:
        put(backend, ["k0"])
        put(backend, ["k1"])
        assert put(backend, ["k0"]) == [Status.EXISTS]
        put(backend, ["k2"])
        assert backend.batch_exists(["k0", "k1", "k2"]) == [True, False, True]
    finally:
        backend.close()


def test_evictions_count_every_evicted_key(name):
    backend = open_backend(name, slots=3)
    try:
        put(backend, [f"a{i}" for i in range(3)])
        assert backend.pool.usage().evictions == 0
        put(backend, [f"b{i}" for i in range(2)])
        assert backend.pool.usage().evictions == 2
        put(backend, [f"c{i}" for i in range(3)])
        usage = backend.pool.usage()
        assert (usage.evictions, usage.num_ready) == (5, 3)
    finally:
        backend.close()


def test_presence_epoch_moves_with_every_eviction_and_only_then(name):
    backend = open_backend(name, slots=2)
    try:
        put(backend, ["k0", "k1"])
        epoch = backend.presence_epoch()
        get(backend, ["k0"])
        put(backend, ["k0"])
        assert backend.presence_epoch() == epoch
        put(backend, ["k2"])
        assert backend.presence_epoch() == epoch + 1
    finally:
        backend.close()


def test_leased_blocks_outlast_every_unleased_value_of_their_class(name):
    parts = BlockParts("0123456789abcdef", ("h0", "h1"), (0, 1))  # 2 shards x 2 layers
    hashes = [hashlib.sha256(f"b{i}".encode()).digest() for i in range(2)]
    backend = open_backend(name, 12)
    try:
        assert all(s.stored for s in put(backend, [k for h in hashes for k in parts.keys(h)]))
        backend.lease_blocks(parts, hashes, seconds=60)
        for i in range(12):  # three times the room the leased blocks leave, a save at a time
            put(backend, [f"flood{i}"])
        assert backend.count_complete_blocks(parts, hashes) == 2
    finally:
        backend.close()


def test_batch_larger_than_empty_pool_stores_what_fits_and_reports_no_space(name):
    keys = [f"k{i}" for i in range(7)]
    backend = open_backend(name, slots=4)
    try:
        assert put(backend, keys) == [Status.OK] * 4 + [Status.NO_SPACE] * 3
        assert backend.batch_exists(keys) == [True] * 4 + [False] * 3
        statuses, bufs = get(backend, keys[:4])
        assert statuses == [Status.OK] * 4
        assert all(np.array_equal(b, payload(k)) for k, b in zip(keys, bufs))
    finally:
        backend.close()


def test_batch_larger_than_full_pool_evicts_everything_old_and_reports_no_space(name):
    backend = open_backend(name, slots=3)
    try:
        put(backend, ["old0", "old1", "old2"])
        new = [f"new{i}" for i in range(5)]
        assert put(backend, new) == [Status.OK] * 3 + [Status.NO_SPACE] * 2
        assert backend.batch_exists(["old0", "old1", "old2"]) == [False] * 3
        assert backend.batch_exists(new) == [True] * 3 + [False] * 2
    finally:
        backend.close()


def test_gauges_read_the_pools_fill_and_its_evictions_since_it_was_created(name):
    backend = open_backend(name, slots=4)
    try:
        assert backend.gauges() == {"pool_used_bytes": 0.0, "pool_capacity_bytes": 4.0 * VALUE,
                                    "pool_stored_values": 0.0, "pool_evicted_values": 0.0}
        put(backend, [f"k{i}" for i in range(4)])
        put(backend, ["k4", "k5"])  # two evicted
        gauges = backend.gauges()
        assert (gauges["pool_used_bytes"], gauges["pool_stored_values"]) == (4.0 * VALUE, 4.0)
        assert gauges["pool_evicted_values"] == 2.0
    finally:
        backend.close()
    assert backend.gauges() == {}  # closed: nothing to read


def test_gauges_count_what_every_attachment_evicted(name):
    first, second = open_backend(name, slots=2), open_backend(name, slots=2)
    try:
        put(second, ["a", "b"])
        put(second, ["c"])
        assert first.gauges()["pool_evicted_values"] == 1.0
        assert first.gauges()["pool_stored_values"] == 2.0
    finally:
        first.close()
        second.close()


# ---- a reader racing an eviction ---------------------------------------------------


def test_slot_evicted_and_rewritten_after_pin_is_no_longer_valid(name):
    reader = open_backend(name, slots=4)
    writer = open_backend(name, slots=4)
    try:
        put(reader, ["victim"])
        [(slot, version)] = reader.slots().pin_for_read(["victim"])
        put(writer, [f"new{i}" for i in range(4)])  # evicts every slot, the victim's too
        assert not reader.pool.still_valid(slot, version)
    finally:
        reader.close()
        writer.close()
    assert leftovers(name) == []


def test_get_of_slot_evicted_and_rewritten_during_copy_is_corrupt(name, monkeypatch):
    reader = open_backend(name, slots=4)
    writer = open_backend(name, slots=4)
    real_copy_many = local.copy_many
    evicting = threading.Lock()

    def copy_while_another_process_evicts(*args, **kwargs):
        if evicting.acquire(blocking=False):  # the reader's copy; not the writer's own put
            put(writer, [f"new{i}" for i in range(4)])
        real_copy_many(*args, **kwargs)

    try:
        put(reader, ["victim"])
        monkeypatch.setattr(local, "copy_many", copy_while_another_process_evicts)
        statuses, _ = get(reader, ["victim"])
        assert statuses == [Status.CORRUPT]
    finally:
        reader.close()
        writer.close()


# ---- large batches, copied by several threads ------------------------------------------

BIG = host_copy.MIN_BYTES_PER_THREAD // 2  # per value: a batch of 8 is enough for 4 copy threads
BIG_SIZES = (BIG // 2 - 64, BIG // 8 + 64, BIG // 4, BIG // 8)  # over 4 unequal segments


@pytest.fixture
def four_copy_threads(monkeypatch):
    """Copies as on a machine of >= 4 cores."""
    host_copy.shutdown_copy_threads()
    monkeypatch.setattr(host_copy, "copy_threads", lambda: 4)


def test_large_batch_is_copied_by_several_threads_byte_for_byte(name, four_copy_threads):
    keys = [f"big{i}" for i in range(8)]
    backend = open_backend(name, slots=8, value=BIG)
    try:
        src = [payload(k, BIG) for k in keys]
        assert backend.batch_put(keys, [segments_of(b, BIG_SIZES) for b in src]) == [Status.OK] * 8
        dst = [np.full(BIG, 0xEE, dtype=np.uint8) for _ in keys]
        # Split differently on the way back: piece boundaries fall elsewhere.
        assert backend.batch_get(keys[::-1], [segments_of(b, BIG_SIZES[::-1]) for b in dst]) == [Status.OK] * 8
    finally:
        backend.close()
    assert [t for t in threading.enumerate() if t.name.startswith("vllm_aio-copy")]
    for key, buf in zip(keys[::-1], dst):
        assert np.array_equal(buf, payload(key, BIG)), key


def test_slot_evicted_while_several_threads_copy_is_corrupt_alone(name, four_copy_threads, monkeypatch):
    keys = [f"big{i}" for i in range(8)]
    reader = open_backend(name, slots=8, value=BIG)
    writer = open_backend(name, slots=8, value=BIG)
    real_copy_many = local.copy_many

    def copy_while_another_process_evicts(*args, **kwargs):
        # Between pin and copy: a writer evicts the LRU key, the first one
        # pinned by this get, and takes its slot (reserve bumps its version).
        [slot] = writer.slots().reserve(["intruder"])
        assert slot is not None and slot >= 0
        writer.pool.abandon([slot])
        real_copy_many(*args, **kwargs)

    try:
        src = [payload(k, BIG) for k in keys]
        assert reader.batch_put(keys, [segments_of(b, BIG_SIZES) for b in src]) == [Status.OK] * 8
        monkeypatch.setattr(local, "copy_many", copy_while_another_process_evicts)
        statuses, dst = get(reader, keys, size=BIG)
    finally:
        reader.close()
        writer.close()
    assert statuses == [Status.CORRUPT] + [Status.OK] * 7
    for key, buf in zip(keys[1:], dst[1:]):
        assert np.array_equal(buf, payload(key, BIG)), key


def test_put_whose_copy_fails_frees_its_reserved_slots(name, monkeypatch):
    backend = open_backend(name, slots=4)

    def failing_copy_many(*args, **kwargs):
        raise OSError("copy failed")

    try:
        monkeypatch.setattr(local, "copy_many", failing_copy_many)
        with pytest.raises(OSError):
            put(backend, ["a", "b"])
        monkeypatch.undo()
        assert backend.batch_exists(["a", "b"]) == [False, False]
        assert put(backend, [f"k{i}" for i in range(4)]) == [Status.OK] * 4
        assert backend.pool.usage().evictions == 0
    finally:
        backend.close()


# ---- attachments in one process -----------------------------------------------------


def test_two_backends_on_one_name_share_values(name):
    a = open_backend(name, slots=4)
    b = open_backend(name, slots=4)
    try:
        put(a, ["k"])
        assert b.batch_exists(["k"]) == [True]
        statuses, [buf] = get(b, ["k"])
        assert statuses == [Status.OK] and np.array_equal(buf, payload("k"))
        assert put(b, ["k"]) == [Status.EXISTS]
    finally:
        a.close()
        b.close()


def test_pool_file_survives_until_the_last_backend_closes(name):
    a = open_backend(name, slots=4)
    b = open_backend(name, slots=4)
    put(a, ["k"])
    a.close()
    assert pool_path(name).exists()
    assert get(b, ["k"])[0] == [Status.OK]
    b.close()
    assert leftovers(name) == []


def test_sealed_backend_leaves_no_name_and_still_serves_other_attachments(name):
    a = open_backend(name, slots=4)
    b = open_backend(name, slots=4, seal=True)
    try:
        assert leftovers(name) == []
        put(a, ["k"])
        assert get(b, ["k"])[0] == [Status.OK]
    finally:
        a.close()
        b.close()
    assert leftovers(name) == []


# ---- other processes -----------------------------------------------------------------


def _child_put(name: str, keys: list[str], barrier, results) -> None:
    backend = open_backend(name, slots=256)
    try:
        bufs = [payload(k) for k in keys]
        segs = [segments_of(b) for b in bufs]
        if barrier is not None:
            barrier.wait(60)
        results.put([s.value for s in backend.batch_put(keys, segs)])
    finally:
        backend.close()


def test_value_put_by_a_spawned_child_is_read_by_the_parent(name):
    ctx = mp.get_context("spawn")
    parent = open_backend(name, slots=256)
    try:
        results = ctx.Queue()
        child = ctx.Process(target=_child_put, args=(name, ["from-child"], None, results))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert results.get(timeout=10) == ["ok"]
        statuses, [buf] = get(parent, ["from-child"])
        assert statuses == [Status.OK]
        assert np.array_equal(buf, payload("from-child"))
    finally:
        parent.close()
    assert leftovers(name) == []


def test_concurrent_puts_of_same_keys_from_two_processes_store_each_key_once(name):
    keys = [f"shared{i}" for i in range(64)]
    ctx = mp.get_context("spawn")
    parent = open_backend(name, slots=256)
    try:
        barrier, results = ctx.Barrier(2), ctx.Queue()
        children = [ctx.Process(target=_child_put, args=(name, keys, barrier, results)) for _ in range(2)]
        for child in children:
            child.start()
        for child in children:
            child.join(60)
        assert [c.exitcode for c in children] == [0, 0]
        first, second = results.get(timeout=10), results.get(timeout=10)
        for key, a, b in zip(keys, first, second):
            assert sorted([a, b]) == ["exists", "ok"], key
        statuses, bufs = get(parent, keys)
        assert statuses == [Status.OK] * len(keys)
        assert all(np.array_equal(buf, payload(k)) for k, buf in zip(keys, bufs))
        usage = parent.pool.usage()
        assert (usage.num_ready, usage.evictions) == (len(keys), 0)
    finally:
        parent.close()
    assert leftovers(name) == []


# ---- the index against a model -------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_puts_gets_and_evictions_match_an_lru_model(name, seed):
    """2000 random batched operations on an 8-slot pool (16-bucket index).

    The model is exact LRU over the same events the pool counts as a use: a
    hit of batch_exists, of batch_get and of a repeated put, and a commit.
    Keys collide heavily in 16 buckets, so evictions exercise the
    backward-shift delete of the linear-probing index.
    """
    rng = random.Random(seed)
    slots, size = 8, 24
    sizes = (7, 17)
    universe = [f"key-{seed}-{i}" for i in range(40)]
    backend = LocalBackend(name, slots * size, size, seal=False)
    model: dict[str, int] = {}  # key -> last use
    clock = evictions = 0

    def use(key: str) -> None:
        nonlocal clock
        clock += 1
        model[key] = clock

    try:
        for step in range(2000):
            keys = rng.sample(universe, rng.randint(1, 5))
            op = rng.random()
            if op < 0.45:  # put, some values of the wrong size
                bad = {k for k in keys if rng.random() < 0.1}
                bufs = [payload(k, size - 1 if k in bad else size) for k in keys]
                segs = [[(b.ctypes.data, b.size)] if k in bad else segments_of(b, sizes) for k, b in zip(keys, bufs)]
                got = backend.batch_put(keys, segs)
                want, missing = {}, []
                for k in keys:
                    if k in model:
                        use(k)
                        want[k] = Status.EXISTS
                    else:
                        missing.append(k)
                free = slots - len(model)
                n_evict = min(max(0, len(missing) - free), len(model))
                for victim in sorted(model, key=model.__getitem__)[:n_evict]:
                    del model[victim]
                evictions += n_evict
                granted = missing[: free + n_evict]
                for k in missing[len(granted):]:
                    want[k] = Status.NO_SPACE
                for k in granted:
                    if k in bad:
                        want[k] = Status.ERROR
                    else:
                        want[k] = Status.OK
                        use(k)
                assert got == [want[k] for k in keys], f"step {step}: put {keys}"
            elif op < 0.7:
                got = backend.batch_exists(keys)
                want = []
                for k in keys:
                    want.append(k in model)
                    if k in model:
                        use(k)
                assert got == want, f"step {step}: exists {keys}"
            else:
                bufs = [np.full(size, 0xEE, dtype=np.uint8) for _ in keys]
                got = backend.batch_get(keys, [segments_of(b, sizes) for b in bufs])
                for k, status, buf in zip(keys, got, bufs):
                    if k in model:
                        use(k)
                        assert status == Status.OK, f"step {step}: get {k}"
                        assert np.array_equal(buf, payload(k, size)), f"step {step}: bytes of {k}"
                    else:
                        assert status == Status.MISSING, f"step {step}: get {k}"
                        assert (buf == 0xEE).all()
            usage = backend.pool.usage()
            assert (usage.num_ready, usage.evictions) == (len(model), evictions), f"step {step}"
        assert backend.batch_exists(universe) == [k in model for k in universe]
    finally:
        backend.close()
    assert leftovers(name) == []


# In a fresh interpreter: another test of this process may have compiled the loops already.
_FIRST_REQUEST = """
import uuid
from numba.core.registry import CPUDispatcher
from vllm_aio.backends.local import LocalBackend
from vllm_aio.pool import index_ops
from vllm_aio.pool.keys import BlockParts

# The public ones: the private ones are compiled into their callers.
loops = {n: f for n, f in vars(index_ops).items() if isinstance(f, CPUDispatcher) and not n.startswith("_")}
backend = LocalBackend(f"warm-{uuid.uuid4().hex[:8]}", 2 * 4160, 4160, seal=True)
compiled = {n: len(f.signatures) for n, f in loops.items()}
slots, hashes = backend.slots(), [bytes([i]) * 32 for i in range(3)]
parts = BlockParts("ns", ("sh",), (None,))
backend.count_complete_blocks(parts, hashes)
slots.commit(slots.reserve_blocks("ns", "sh", None, hashes[:2]))
backend.count_complete_blocks(parts, hashes)
slots.pin_blocks("ns", "sh", None, hashes)
slots.commit(slots.reserve_blocks("ns", "sh", None, hashes[2:]))  # a full pool: evicts
after = {n: len(f.signatures) for n, f in loops.items()}
backend.close()
print(sorted(n for n, count in compiled.items() if not count), sorted(n for n in loops if after[n] != compiled[n]))
"""


def test_opening_the_pool_compiles_every_loop_a_lookup_save_load_or_eviction_runs():
    """The first request then compiles nothing: lazily, its lookup and save each waited for it with the
    GIL held (0.13 s from numba's cache, seconds without)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FIRST_REQUEST], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    not_compiled, compiled_later = out.stdout.strip().splitlines()[-1].split("] [")
    assert not_compiled == "[", f"not compiled at open: {not_compiled}]"
    assert compiled_later == "]", f"compiled in a request: [{compiled_later}"
