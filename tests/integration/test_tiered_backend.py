"""The tiered store (``backends/tiered.py``): the embedded pool in front of a distributed one.

Tiers are the in-memory reference backend (``memory_backend.py``) where the
behaviour is the tiered store's own, the embedded pool where its exactness
matters, and a real Mooncake pool on loopback for a master that dies and
comes back (``mooncake_fixtures.py``: under ``CI`` a missing prerequisite fails),
and Memcache over its fake client (``memcache_fake.py``).
The contract every backend keeps is checked for the tiered store too, in
``test_backend_contract.py``.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import threading
import time
import uuid
from collections.abc import Iterator, Sequence

import pytest

from harness.memcache_fake import FakeDistributedObjectStore, FakeMetaPort, FakeMetaService, write_local_conf
from harness.memory_backend import MemoryBackend
from vllm_aio.backends import Backend, Status, open_backend
from vllm_aio.backends.local_settings import LocalSettings
from vllm_aio.backends.memcache import MemcacheBackend
from vllm_aio.backends.tiered import TieredBackend
from vllm_aio.backends.tiered_settings import TieredSettings
from vllm_aio.config import parse_extra_config
from vllm_aio.errors import ConfigError
from vllm_aio.device.segment import Segment
from vllm_aio.pool.keys import BlockParts

pytest_plugins = ["harness.mooncake_fixtures"]

VALUE = 256  # bytes of every value


class Values:
    """``n`` source values (distinct bytes) and ``n`` destinations, one segment each."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.src = (ctypes.c_ubyte * (n * VALUE)).from_buffer_copy(bytes(i % 251 for i in range(n * VALUE)))
        self.dst = (ctypes.c_ubyte * (n * VALUE))()

    def segments(self, buf: ctypes.Array, indices: Sequence[int] | None = None) -> list[list[Segment]]:
        base = ctypes.addressof(buf)
        return [[(base + i * VALUE, VALUE)] for i in (range(self.n) if indices is None else indices)]

    def loaded(self, i: int) -> bool:
        return bytes(self.dst[i * VALUE:(i + 1) * VALUE]) == bytes(self.src[i * VALUE:(i + 1) * VALUE])


def keys(n: int) -> list[str]:
    prefix = uuid.uuid4().hex[:8]
    return [f"{prefix}-{i}" for i in range(n)]


def tiered(local=None, remote=None, write_through: bool = False, queue_size: int = 64) -> TieredBackend:
    return TieredBackend(local or MemoryBackend(VALUE), remote or MemoryBackend(VALUE), VALUE, "memory",
                         write_through=write_through, queue_size=queue_size)


@pytest.fixture
def local_pool() -> Iterator[Backend]:
    """An embedded pool of 64 values, closed after the test."""
    backend = open_backend(LocalSettings(local_pool_size=64 * VALUE), f"tiered-{uuid.uuid4().hex[:12]}", VALUE, False)
    yield backend
    backend.close()


class Down(MemoryBackend):
    """A remote tier whose service can go away: answers as Mooncake does then (ERROR, absent), or raises."""

    def __init__(self, raises: bool = False) -> None:
        super().__init__(VALUE)
        self.down = False
        self.raises = raises

    def _gone(self) -> bool:
        if self.down and self.raises:
            raise RuntimeError("remote gone")
        return self.down

    def batch_exists(self, keys):
        return [False] * len(keys) if self._gone() else super().batch_exists(keys)

    def batch_get(self, keys, segments):
        return [Status.ERROR] * len(keys) if self._gone() else super().batch_get(keys, segments)

    def batch_put(self, keys, segments, retention=0):
        return [Status.ERROR] * len(keys) if self._gone() else super().batch_put(keys, segments, retention)


class Held(MemoryBackend):
    """A remote tier whose puts wait until ``release``: a background write in progress."""

    def __init__(self) -> None:
        super().__init__(VALUE)
        self.entered = threading.Event()
        self.release = threading.Event()

    def batch_put(self, keys, segments, retention=0):
        self.entered.set()
        assert self.release.wait(30)
        return super().batch_put(keys, segments, retention)


class Full(MemoryBackend):
    """A local tier that takes nothing."""

    def batch_put(self, keys, segments, retention=0):
        return [Status.NO_SPACE] * len(keys)


class Epoch(MemoryBackend):
    def __init__(self) -> None:
        super().__init__(VALUE)
        self.epoch = 7

    def presence_epoch(self) -> int:
        return self.epoch


# ---- lookups -------------------------------------------------------------------

PARTS = BlockParts("ns", ("s0", "s1"), (None,))
HASHES = [hashlib.sha256(bytes([i])).digest() for i in range(6)]  # uniform, as vLLM's


def store(backend: MemoryBackend, block: int) -> None:
    for key in PARTS.keys(HASHES[block]):
        backend.values[key] = b"v"


def test_a_block_hits_when_every_part_is_in_one_tier_or_the_other():
    local, remote = MemoryBackend(), MemoryBackend()
    for block in (0, 2, 4):
        store(local, block)
    for block in (1, 2):
        store(remote, block)
    # block 3 is in neither tier: the prefix stops there, block 4 does not count
    assert tiered(local, remote).count_complete_blocks(PARTS, HASHES) == 3


def test_layerwise_blocks_hit_across_tiers_on_the_embedded_pool(local_pool: Backend):
    parts = BlockParts("0123456789abcdef", ("pp0.dcp0.h0", "pp0.dcp0.h1"), (0, 1, 2))  # 6 values a block
    remote = MemoryBackend(VALUE)
    values = Values(parts.count)
    for tier, block in ((local_pool, 0), (remote, 1), (local_pool, 2)):
        tier.batch_put(parts.keys(HASHES[block]), values.segments(values.src))
    partial = parts.keys(HASHES[3])[:-1]  # the last layer of block 3 is stored nowhere
    local_pool.batch_put(partial, values.segments(values.src)[:-1])
    assert tiered(local_pool, remote).count_complete_blocks(parts, HASHES) == 3


def test_a_block_split_between_the_tiers_is_a_miss():
    local, remote = MemoryBackend(), MemoryBackend()
    s0, s1 = PARTS.keys(HASHES[0])
    local.values[s0] = remote.values[s1] = b"v"
    assert tiered(local, remote).count_complete_blocks(PARTS, HASHES) == 0


def test_a_prompt_complete_in_the_local_tier_never_asks_the_remote_tier():
    local, remote = MemoryBackend(), Down(raises=True)
    remote.down = True  # any call would raise, and be logged
    for block in range(len(HASHES)):
        store(local, block)
    assert tiered(local, remote).count_complete_blocks(PARTS, HASHES) == len(HASHES)


def test_presence_epoch_is_none_when_the_remote_tier_has_none(local_pool: Backend):
    assert tiered(local_pool, MemoryBackend(VALUE)).presence_epoch() is None


def test_presence_epoch_moves_when_either_tier_evicts(local_pool: Backend):
    remote = Epoch()
    backend = tiered(local_pool, remote)
    before = backend.presence_epoch()
    remote.epoch += 1
    assert backend.presence_epoch() != before


def test_gauges_are_the_local_tiers(local_pool: Backend):
    backend = tiered(local_pool, MemoryBackend(VALUE))
    assert backend.gauges() == local_pool.gauges() and backend.gauges()["pool_capacity_bytes"] == 64 * VALUE


def test_a_backend_without_gauges_reports_none():
    assert tiered().gauges() == {}


# ---- loads ---------------------------------------------------------------------------

def test_load_takes_the_local_tier_first_and_the_rest_from_the_remote_tier():
    local, remote, values, ks = MemoryBackend(VALUE), MemoryBackend(VALUE), Values(3), keys(3)
    local.batch_put(ks[:1], values.segments(values.src, [0]))
    remote.batch_put(ks[:2], values.segments(values.src, [0, 1]))
    backend = tiered(local, remote)
    assert backend.batch_get(ks, values.segments(values.dst)) == [Status.OK, Status.OK, Status.MISSING]
    assert values.loaded(0) and values.loaded(1)
    assert backend.take_counters() == {"local_tier_hits": 1, "remote_tier_hits": 1}


def test_a_remote_hit_is_promoted_so_the_next_load_is_local():
    local, remote, values, ks = MemoryBackend(VALUE), MemoryBackend(VALUE), Values(2), keys(2)
    remote.batch_put(ks, values.segments(values.src))
    backend = tiered(local, remote)
    backend.batch_get(ks, values.segments(values.dst))
    assert local.batch_exists(ks) == [True, True]
    backend.take_counters()
    assert backend.batch_get(ks, values.segments(values.dst)) == [Status.OK] * 2
    assert backend.take_counters() == {"local_tier_hits": 2}


def test_a_value_evicted_from_the_local_tier_still_loads_from_the_remote_tier():
    local, values, [key] = MemoryBackend(VALUE), Values(1), keys(1)
    backend = tiered(local, write_through=True)
    backend.batch_put([key], values.segments(values.src))
    del local.values[key]  # evicted
    assert backend.batch_get([key], values.segments(values.dst)) == [Status.OK]
    assert values.loaded(0)


def test_the_direct_path_is_not_offered_since_it_would_never_ask_the_remote_tier(local_pool: Backend):
    assert local_pool.slots() is not None and tiered(local_pool).slots() is None


# ---- saves ---------------------------------------------------------------------------

def test_background_save_lands_locally_at_once_and_remotely_later():
    local, remote, values, ks = MemoryBackend(VALUE), Held(), Values(2), keys(2)
    backend = tiered(local, remote)
    assert backend.batch_put(ks, values.segments(values.src)) == [Status.OK] * 2
    assert local.batch_exists(ks) == [True, True]
    assert remote.entered.wait(30) and remote.batch_exists(ks) == [False, False]
    remote.release.set()
    assert backend.flush(30)
    assert remote.batch_exists(ks) == [True, True]
    assert backend.take_counters() == {}


def test_a_full_background_queue_drops_with_a_count_and_never_blocks_the_save():
    remote, values, ks = Held(), Values(8), keys(8)
    backend = tiered(remote=remote, queue_size=4)
    backend.batch_put(ks[:1], values.segments(values.src, [0]))
    assert remote.entered.wait(30)  # the writer holds the first value; the queue is empty
    saved = []
    save = threading.Thread(target=lambda: saved.extend(backend.batch_put(ks[1:], values.segments(values.src)[1:])))
    save.start()
    save.join(30)
    assert not save.is_alive() and saved == [Status.OK] * 7  # all stored locally
    assert backend.take_counters() == {"remote_tier_dropped": 3}
    remote.release.set()
    assert backend.flush(30)
    assert remote.batch_exists(ks) == [True] * 5 + [False] * 3


def test_a_value_evicted_locally_before_its_background_write_is_counted_dropped():
    local, remote, values, ks = MemoryBackend(VALUE), Held(), Values(2), keys(2)
    backend = tiered(local, remote)
    backend.batch_put(ks[:1], values.segments(values.src, [0]))
    assert remote.entered.wait(30)
    backend.batch_put(ks[1:], values.segments(values.src, [1]))
    del local.values[ks[1]]  # evicted while waiting
    remote.release.set()
    assert backend.flush(30)
    assert remote.batch_exists(ks) == [True, False]
    assert backend.take_counters() == {"remote_tier_dropped": 1}


def test_write_through_puts_the_remote_tier_before_the_save_returns():
    remote, values, ks = MemoryBackend(VALUE), Values(2), keys(2)
    backend = tiered(remote=remote, write_through=True)
    assert backend.batch_put(ks, values.segments(values.src)) == [Status.OK] * 2
    assert remote.batch_exists(ks) == [True, True]


class Classes(MemoryBackend):
    """Records the retention class of every put."""

    def __init__(self) -> None:
        super().__init__(VALUE)
        self.classes: list[int] = []

    def batch_put(self, keys, segments, retention=0):
        self.classes += [retention] * len(keys)
        return super().batch_put(keys, segments, retention)


@pytest.mark.parametrize("write_through", [False, True], ids=["background", "through"])
def test_both_tiers_store_a_value_in_its_requests_retention_class(write_through: bool):
    local, remote, values, ks = Classes(), Classes(), Values(3), keys(3)
    backend = tiered(local, remote, write_through=write_through)
    assert backend.batch_put(ks[:2], values.segments(values.src, [0, 1]), retention=2) == [Status.OK] * 2
    assert backend.batch_put(ks[2:], values.segments(values.src, [2])) == [Status.OK]
    assert backend.flush(30)
    assert local.classes == [2, 2, 0] and sorted(remote.classes) == [0, 2, 2]


def test_a_value_the_local_tier_refuses_goes_to_the_remote_tier_during_the_save():
    remote, values, ks = MemoryBackend(VALUE), Values(2), keys(2)
    backend = tiered(Full(VALUE), remote)
    assert backend.batch_put(ks, values.segments(values.src)) == [Status.OK] * 2
    assert remote.batch_exists(ks) == [True, True]


def test_a_value_already_in_the_local_tier_is_not_written_to_the_remote_tier_again():
    local, remote, values, [key] = MemoryBackend(VALUE), MemoryBackend(VALUE), Values(1), keys(1)
    local.batch_put([key], values.segments(values.src))  # e.g. another instance on this host
    backend = tiered(local, remote, write_through=True)
    assert backend.batch_put([key], values.segments(values.src)) == [Status.EXISTS]
    assert remote.batch_exists([key]) == [False]


def test_close_runs_the_queued_background_writes_first():
    remote, values, ks = MemoryBackend(VALUE), Values(4), keys(4)
    backend = tiered(remote=remote)
    backend.batch_put(ks, values.segments(values.src))
    backend.close()
    assert set(ks) <= set(remote.values)


# ---- a remote tier that fails ---------------------------------------------------------

@pytest.mark.parametrize("raises", [False, True], ids=["answers-error", "raises"])
def test_a_dead_remote_tier_leaves_the_local_tier_serving_and_serves_again_once_back(raises: bool):
    remote, values, ks = Down(raises), Values(4), keys(4)
    backend = tiered(remote=remote)
    backend.batch_put(ks[:2], values.segments(values.src, [0, 1]))
    assert backend.flush(30)
    remote.down = True
    assert backend.batch_get(ks[:2], values.segments(values.dst, [0, 1])) == [Status.OK] * 2
    assert backend.batch_exists(ks[:3]) == [True, True, False]
    assert backend.batch_get(ks[2:3], values.segments(values.dst, [2])) == [Status.ERROR]
    assert backend.batch_put(ks[2:3], values.segments(values.src, [2])) == [Status.OK]  # locally
    assert backend.flush(30)
    assert backend.take_counters()["remote_tier_dropped"] == 1
    remote.down = False
    backend.batch_put(ks[3:], values.segments(values.src, [3]))
    assert backend.flush(30)
    assert remote.batch_exists(ks) == [True, True, False, True]


def test_dead_then_restarted_mooncake_master_the_local_tier_serves_and_the_remote_comes_back(mooncake_pool_factory):
    pool = mooncake_pool_factory()
    settings = parse_extra_config(
        {"backend": "tiered", "remote_backend": "mooncake", **pool.config, "local_pool_size": 64 * VALUE,
         "remote_write": "through"}, environ={}).backend_settings
    backend = open_backend(settings, f"tiered-{uuid.uuid4().hex[:12]}", VALUE, for_scheduler=False)
    values, ks = Values(3), keys(3)
    backend.register_memory(ctypes.addressof(values.src), 3 * VALUE)
    backend.register_memory(ctypes.addressof(values.dst), 3 * VALUE)
    try:
        assert backend.batch_put(ks[:1], values.segments(values.src, [0])) == [Status.OK]
        assert backend.remote.batch_exists(ks[:1]) == [True]
        pool.kill_master()
        assert backend.batch_get(ks[:1], values.segments(values.dst, [0])) == [Status.OK]
        assert backend.batch_put(ks[1:2], values.segments(values.src, [1])) == [Status.OK]  # locally
        assert backend.take_counters() == {"local_tier_hits": 1, "remote_tier_dropped": 1}
        pool.restart_master()
        # The client reconnects by itself and the memory owner mounts its segment again.
        deadline = time.monotonic() + 60
        while True:
            [key] = keys(1)
            backend.batch_put([key], values.segments(values.src, [2]))
            if backend.remote.batch_exists([key]) == [True]:
                break
            assert time.monotonic() < deadline, "the remote tier did not come back"
            time.sleep(0.5)
        [remote_only] = keys(1)
        assert backend.remote.batch_put([remote_only], values.segments(values.src, [2])) == [Status.OK]
        backend.take_counters()
        assert backend.batch_get([remote_only], values.segments(values.dst, [2])) == [Status.OK]
        assert values.loaded(2) and backend.take_counters() == {"remote_tier_hits": 1}
    finally:
        backend.close()


# ---- settings ------------------------------------------------------------------------

MOONCAKE = {"backend": "tiered", "remote_backend": "mooncake", "master_server_address": "127.0.0.1:50051"}


def test_each_tier_reads_its_own_settings_keys_and_variables():
    cfg = parse_extra_config({**MOONCAKE, "local_pool_name": "node-a", "tenant_id": "t", "remote_write": "through"},
                             environ={"VLLM_AIO_LOCAL_POOL_SIZE": "1GB", "MOONCAKE_MASTER": "10.0.0.1:7"})
    settings = cfg.backend_settings
    assert isinstance(settings, TieredSettings)
    assert (settings.local.local_pool_name, settings.local.local_pool_size) == ("node-a", 1 << 30)
    assert (settings.remote.master_server_address, settings.remote.tenant_id) == ("10.0.0.1:7", "t")
    assert (settings.remote_write, settings.remote_queue_size) == ("through", 4096)


@pytest.mark.parametrize("extra, message", [
    ({"remote_backend": None}, "remote_backend: expected one of mooncake, memcache, missing"),
    ({"remote_backend": "redis"}, "remote_backend: expected one of mooncake, memcache, got 'redis'"),
    ({"remote_backend": ["mooncake"]}, "remote_backend: expected one of mooncake, memcache, got ['mooncake']"),
    ({"remote_write": "sync"}, "remote_write: expected one of background, through, got 'sync'"),
    ({"remote_queue_size": 0}, "remote_queue_size: expected an integer >= 1, got 0"),
    ({"device_id": 0}, 'device_id: Memcache settings need remote_backend "memcache"'),
    ({"master_server_address": "nowhere"}, "master_server_address: expected 'host:port'"),
    ({"local_pool_name": "a/b"}, "local_pool_name: expected 1-64 characters"),
], ids=["no-remote", "unknown-remote", "remote-as-list", "write-mode", "queue-size", "other-remote-key", "remote-key",
        "local-key"])
def test_bad_settings_fail_at_start_naming_the_key_and_what_is_accepted(extra: dict, message: str):
    config = {k: v for k, v in {**MOONCAKE, **extra}.items() if v is not None}
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_extra_config(config, environ={})


def test_tiered_keys_with_another_backend_name_the_tiered_store():
    with pytest.raises(ConfigError, match='remote_write: tiered store settings need backend "tiered"'):
        parse_extra_config({"backend": "local", "remote_write": "through"}, environ={})


def test_memcache_as_the_remote_tier_serves_another_nodes_load(tmp_path, local_pool: Backend):
    # Memcache's client is the fake (memcache_fake.py): the real one needs an Ascend driver.
    port = FakeMetaPort()
    try:
        conf = write_local_conf(tmp_path / "mmc-local.conf", port.port, port.port)
        settings = parse_extra_config({"backend": "tiered", "remote_backend": "memcache", "device_id": 0},
                                      environ={"MMC_LOCAL_CONFIG_PATH": str(conf)}).backend_settings
        store = FakeDistributedObjectStore(FakeMetaService())
        remote = MemcacheBackend(settings.remote, value_bytes=VALUE, store_factory=lambda: store)
        writer = tiered(MemoryBackend(VALUE), remote, write_through=True)
        reader = tiered(local_pool, remote)  # another node: its own local tier
        values, ks = Values(2), keys(2)
        writer.register_memory(ctypes.addressof(values.src), 2 * VALUE)
        reader.register_memory(ctypes.addressof(values.dst), 2 * VALUE)
        assert writer.batch_put(ks, values.segments(values.src)) == [Status.OK] * 2
        assert reader.batch_exists(ks) == [True, True]
        assert reader.batch_get(ks, values.segments(values.dst)) == [Status.OK] * 2
        assert values.loaded(0) and values.loaded(1) and local_pool.batch_exists(ks) == [True, True]
        remote.close()
    finally:
        port.down()
