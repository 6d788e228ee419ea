"""The ``Backend`` contract (``vllm_aio/backends/base.py``): one suite, run on every backend.

- ``local``: the embedded shared-memory pool;
- ``memory``: the in-memory reference backend (``memory_backend.py``);
- ``mooncake``: a real master and memory owner on loopback (``mooncake_fixtures.py``;
  under ``CI`` a missing prerequisite fails, elsewhere it skips);
- ``memcache``: the Memcache backend over its fake client (``memcache_fake.py``);
- ``tiered``: the embedded pool in front of the in-memory backend (``backends/tiered.py``).

Each backend is opened as the connector opens it (``backends.open_backend``, for a
pool of values of one size), except Memcache, whose client is the fake.
What only one backend does (return codes, eviction, a dead service) is tested
in ``test_<backend>_backend.py``.
"""

from __future__ import annotations

import ctypes
import random
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.memcache_fake import FakeDistributedObjectStore, FakeMetaPort, FakeMetaService, write_local_conf
from harness.memory_backend import MemoryBackend
from vllm_aio import backends
from vllm_aio.backends import Backend, Memory, Status
from vllm_aio.backends.local_settings import LocalSettings
from vllm_aio.backends.memcache import MemcacheBackend
from vllm_aio.backends.memcache_settings import MemcacheSettings
from vllm_aio.backends.tiered import TieredBackend
from vllm_aio.device.segment import Segment
from vllm_aio.pool.keys import BlockParts

pytest_plugins = ["harness.mooncake_fixtures"]

KINDS = ("local", "memory", "mooncake", "memcache", "tiered")
UNTOUCHED = 0xEE  # what a destination holds before a get

Opener = Callable[..., Backend]  # (value_bytes, shared=True) -> an open backend


@pytest.fixture(scope="module")
def shared_backends() -> Iterator[dict[tuple[str, int], Backend]]:
    """Backends that outlive a test: a Mooncake client takes ~1 s to close."""
    backends: dict[tuple[str, int], Backend] = {}
    yield backends
    for backend in backends.values():
        backend.close()


@pytest.fixture(params=KINDS)
def open_backend(request: pytest.FixtureRequest, tmp_path: Path,
                 shared_backends: dict[tuple[str, int], Backend]) -> Iterator[Opener]:
    """Opens backends of one kind for a pool of ``value_bytes`` values; closes them after the test.

    ``shared=False``: a backend of the test's own (to close, for instance).
    """
    kind = request.param
    opened: list[Backend] = []
    if kind == "mooncake":
        mooncake_settings = request.getfixturevalue("mooncake_settings")
    if kind == "memcache":
        port = FakeMetaPort()
        request.addfinalizer(port.down)
        conf = write_local_conf(tmp_path / "mmc-local.conf", port.port, port.port)
        memcache_settings = MemcacheSettings.load({}, environ={"MMC_LOCAL_CONFIG_PATH": str(conf)})

    def open_(value_bytes: int, shared: bool = True) -> Backend:
        if kind == "mooncake" and shared and (kind, value_bytes) in shared_backends:
            return shared_backends[(kind, value_bytes)]
        if kind == "local":
            backend = backends.open_backend(LocalSettings(local_pool_size=64 * value_bytes),
                                            f"contract-{uuid.uuid4().hex[:12]}", value_bytes, for_scheduler=False)
        elif kind == "memory":
            backend = MemoryBackend(value_bytes)
        elif kind == "tiered":
            local = backends.open_backend(LocalSettings(local_pool_size=64 * value_bytes),
                                          f"contract-{uuid.uuid4().hex[:12]}", value_bytes, for_scheduler=False)
            backend = TieredBackend(local, MemoryBackend(value_bytes), value_bytes, "memory",
                                    write_through=False, queue_size=64)
        elif kind == "mooncake":
            backend = backends.open_backend(mooncake_settings, "unused", value_bytes, for_scheduler=False)
        else:
            store = FakeDistributedObjectStore(FakeMetaService())
            backend = MemcacheBackend(memcache_settings, value_bytes=value_bytes, store_factory=lambda: store)
        if kind == "mooncake" and shared:
            shared_backends[(kind, value_bytes)] = backend
        else:
            opened.append(backend)
        return backend

    yield open_
    for backend in opened:
        backend.close()


def unique(n: int) -> list[str]:
    prefix = uuid.uuid4().hex
    return [f"{prefix}-{i}" for i in range(n)]


class Values:
    """``n`` values of ``parts`` segments of ``part`` bytes each, scattered as a block over layers:
    segment j of value i sits at (j * n + i) * part, in a source and a destination buffer."""

    def __init__(self, backend: Backend, n: int, parts: int = 4, part: int = 1024) -> None:
        self.n, self.parts, self.part = n, parts, part
        size = n * parts * part
        rng = random.Random(size)
        self.src = (ctypes.c_ubyte * size).from_buffer_copy(rng.randbytes(size))
        self.dst = (ctypes.c_ubyte * size).from_buffer_copy(bytes([UNTOUCHED]) * size)
        if backend.wants_registration():
            for buf in (self.src, self.dst):
                backend.register_memory(ctypes.addressof(buf), size)

    @property
    def value_bytes(self) -> int:
        return self.parts * self.part

    def segments(self, buf: ctypes.Array, first: int = 0, count: int | None = None) -> list[list[Segment]]:
        base = ctypes.addressof(buf)
        count = self.n - first if count is None else count
        return [[(base + (j * self.n + i) * self.part, self.part) for j in range(self.parts)]
                for i in range(first, first + count)]

    def _bytes(self, buf: ctypes.Array, i: int) -> bytes:
        base = ctypes.addressof(buf)
        return b"".join(ctypes.string_at(base + (j * self.n + i) * self.part, self.part) for j in range(self.parts))

    def same(self, i: int, j: int | None = None) -> bool:
        """Whether destination value ``i`` holds source value ``j`` (default: ``i``)."""
        return self._bytes(self.dst, i) == self._bytes(self.src, i if j is None else j)

    def untouched(self, i: int) -> bool:
        return self._bytes(self.dst, i) == bytes([UNTOUCHED]) * self.value_bytes


# -- the contract ---------------------------------------------------------------------------


def test_only_ok_and_exists_count_as_stored() -> None:
    assert {s for s in Status if s.stored} == {Status.OK, Status.EXISTS}


@pytest.mark.parametrize(("parts", "part"), [(1, 8192), (4, 2048), (4, 65536)])
def test_multi_segment_values_round_trip(open_backend: Opener, parts: int, part: int) -> None:
    # Mooncake moves each layout its own way: one buffer, staged, multi-buffer.
    backend = open_backend(parts * part)
    values, keys = Values(backend, 8, parts, part), unique(8)
    assert backend.batch_put(keys, values.segments(values.src)) == [Status.OK] * 8
    assert backend.batch_exists(keys) == [True] * 8
    # In another order, into other destinations: value i of the batch is key 7 - i.
    assert backend.batch_get(keys[::-1], values.segments(values.dst)) == [Status.OK] * 8
    assert all(values.same(i, 7 - i) for i in range(8))


def test_batch_exists_answers_each_key_in_order(open_backend: Opener) -> None:
    backend = open_backend(4096)
    values, (a, b, c, d) = Values(backend, 2), unique(4)
    assert backend.batch_put([a, c], values.segments(values.src)) == [Status.OK] * 2
    assert backend.batch_exists([a, b, c, d]) == [True, False, True, False]
    assert backend.batch_exists([d, c, b, a]) == [False, True, False, True]


def test_empty_batches_answer_nothing(open_backend: Opener) -> None:
    backend = open_backend(4096)
    assert backend.batch_exists([]) == [] and backend.batch_put([], []) == [] and backend.batch_get([], []) == []


def test_get_of_a_missing_key_is_missing_and_leaves_its_destination_untouched(open_backend: Opener) -> None:
    backend = open_backend(4096)
    values, (absent, present) = Values(backend, 2), unique(2)
    assert backend.batch_put([present], values.segments(values.src, 1, 1)) == [Status.OK]
    assert backend.batch_get([absent, present], values.segments(values.dst)) == [Status.MISSING, Status.OK]
    assert values.untouched(0) and values.same(1)


def test_get_of_a_wrong_total_size_is_corrupt_and_copies_nothing(open_backend: Opener) -> None:
    backend = open_backend(4096)
    values, keys = Values(backend, 3), unique(3)
    assert backend.batch_put(keys, values.segments(values.src)) == [Status.OK] * 3
    segments = values.segments(values.dst)
    shorter, longer = segments[0][:-1], segments[1] + [(ctypes.addressof(values.dst), 64)]
    assert backend.batch_get(keys, [shorter, longer, segments[2]]) == [Status.CORRUPT, Status.CORRUPT, Status.OK]
    assert values.untouched(0) and values.same(2)


def test_put_of_a_wrong_total_size_stores_nothing_and_fails_alone(open_backend: Opener) -> None:
    backend = open_backend(4096)
    values, keys = Values(backend, 3), unique(3)
    segments = values.segments(values.src)
    statuses = backend.batch_put(keys, [segments[0][:-1], segments[1], segments[2] + segments[0][-1:]])
    assert [s.stored for s in statuses] == [False, True, False]
    assert backend.batch_exists(keys) == [False, True, False]


def test_a_key_repeated_in_one_batch_is_an_error_after_its_first_occurrence(open_backend: Opener) -> None:
    backend = open_backend(4096)
    values, [key] = Values(backend, 2), unique(1)
    assert backend.batch_put([key, key], values.segments(values.src)) == [Status.OK, Status.ERROR]
    assert backend.batch_get([key, key], values.segments(values.dst)) == [Status.OK, Status.ERROR]
    assert values.same(0) and values.untouched(1)


def test_a_put_of_a_stored_key_keeps_the_first_value(open_backend: Opener) -> None:
    backend = open_backend(4096)
    values, [key] = Values(backend, 2), unique(1)
    assert backend.batch_put([key], values.segments(values.src, 0, 1)) == [Status.OK]
    [again] = backend.batch_put([key], values.segments(values.src, 1, 1))
    assert again.stored  # OK or EXISTS: stores differ, callers need only this
    assert backend.batch_get([key], values.segments(values.dst, 0, 1)) == [Status.OK]
    assert values.same(0)


def test_calls_after_close_raise(open_backend: Opener) -> None:
    backend = open_backend(4096, shared=False)
    values = Values(backend, 1)
    backend.close()
    backend.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="closed"):
        backend.batch_exists(["k"])
    with pytest.raises(RuntimeError, match="closed"):
        backend.batch_put(["k"], values.segments(values.src))
    with pytest.raises(RuntimeError, match="closed"):
        backend.batch_get(["k"], values.segments(values.dst))


def test_segments_may_point_to_host_memory_and_other_kinds_are_refused(open_backend: Opener) -> None:
    backend = open_backend(4096)
    assert Memory.HOST in backend.segment_memory()
    buf = ctypes.create_string_buffer(8192)
    backend.register_memory(ctypes.addressof(buf), 8192, Memory.HOST)
    for memory in set(Memory) - backend.segment_memory():
        with pytest.raises(ValueError, match=f"cannot point to {memory.value} memory"):
            backend.register_memory(ctypes.addressof(buf), 8192, memory)


def test_describe_is_one_line(open_backend: Opener) -> None:
    line = open_backend(4096).describe()
    assert line and "\n" not in line


def block_parts() -> BlockParts:
    return BlockParts(uuid.uuid4().hex[:16], ("pp0.dcp0.h0", "pp0.dcp0.h1"), (0, 1))


def test_complete_blocks_counts_leading_blocks_with_every_part_stored(open_backend: Opener) -> None:
    backend, parts = open_backend(4096), block_parts()
    hashes = [random.randbytes(32) for _ in range(4)]
    keys = [key for h in hashes[:2] + hashes[3:] for key in parts.keys(h)]  # block 2: no part at all
    values = Values(backend, len(keys))
    assert backend.batch_put(keys, values.segments(values.src)) == [Status.OK] * len(keys)
    assert backend.count_complete_blocks(parts, hashes) == 2
    assert backend.count_complete_blocks(parts, hashes[3:]) == 1
    assert backend.count_complete_blocks(parts, []) == 0


@pytest.mark.parametrize("open_backend", ["local", "memory"], indirect=True)
def test_exact_stores_stop_at_a_block_missing_any_one_part(open_backend: Opener) -> None:
    # Remote stores probe one part per block (test_remote.py); a missing other part fails at load.
    backend, parts = open_backend(4096), block_parts()
    hashes = [random.randbytes(32) for _ in range(3)]
    keys = [key for h in hashes for key in parts.keys(h)]
    del keys[5]  # block 1, one part
    values = Values(backend, len(keys))
    assert backend.batch_put(keys, values.segments(values.src)) == [Status.OK] * len(keys)
    assert backend.count_complete_blocks(parts, hashes) == 1


def test_presence_epoch_is_a_number_or_none_and_steady_without_evictions(open_backend: Opener) -> None:
    backend = open_backend(4096)
    values, keys = Values(backend, 2), unique(2)
    before = backend.presence_epoch()
    assert before is None or isinstance(before, int)
    backend.batch_put(keys, values.segments(values.src))
    assert backend.presence_epoch() == before
