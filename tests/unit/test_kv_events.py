"""KV cache events of the pool: when a block is announced stored or removed, and what the events carry.

The scheduler-side logic (``connector/events.py``) over fake and real stores,
the embedded pool's eviction log seen from another attachment, the worker's
reports of settled saves (layerwise folded per block) and the conversion to
vLLM's ``BlockStored`` / ``BlockRemoved``. ``test_e2e_kv_events.py`` runs it
in a real engine.
"""

from __future__ import annotations

import ctypes
import hashlib
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from harness.scheduler_fakes import BS, DictBackend, Req, blocks, decoded_for_a_while, deployment, shards, step, store
from harness.worker_fakes import VALUE_BYTES, forward, kv_caches, saved, transfer
from harness.worker_fakes import deployment as worker_deployment

from vllm_aio.backends import Status
from vllm_aio.backends.local import LocalBackend
from vllm_aio.config import AioConfig
from vllm_aio.connector.events import KVEvents, Removed, SavedParts, SettledSaves, Stored
from vllm_aio.shared.metadata import AioConnectorMetadata
from vllm_aio.connector.scheduler.scheduler import AioScheduler
from vllm_aio.connector.worker.worker import AioWorker
from vllm_aio.backends.local import PoolSlots
from vllm_aio.pool.host_pool import SharedHostPool
from vllm_aio.pool.keys import BlockParts
from vllm_aio.pool.ownership import Ownership

pytest_plugins = ["harness.mooncake_fixtures"]

TIMEOUT = 30.0


@dataclass
class TokReq:
    """A request as ``KVEvents.expect`` reads it."""

    request_id: str
    num_tokens: int
    lora_request: object | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.block_hashes = Req(self.request_id, self.num_tokens).block_hashes
        self.all_token_ids = list(range(100, 100 + self.num_tokens))


def parts_of(shard_ids=("s0",), digest="d", tags=(None,)) -> BlockParts:
    return BlockParts(digest, tuple(shard_ids), tags)


def digest(name) -> bytes:
    """A block hash as vLLM makes them: a uniform 32-byte digest (the pool's record ids rely on it)."""
    return hashlib.sha256(str(name).encode()).digest()


def report(shard: str, stored=(), failed=()) -> SavedParts:
    return SavedParts(shard, 32, b"".join(stored), b"".join(failed))


# ---- announcing stored blocks ------------------------------------------------
def test_block_is_announced_once_every_shard_reported_it():
    events, parts = KVEvents(BS, None, TIMEOUT), parts_of(("s0", "s1"))
    req = TokReq("a", 3 * BS)
    events.expect(req, 0, 2)
    events.saved([report("s0", req.block_hashes[:2])], parts)
    assert events.take(parts) == []
    events.saved([report("s1", req.block_hashes[:1])], parts)
    [first] = events.take(parts)
    assert first.block_hashes == req.block_hashes[:1]
    events.saved([report("s1", req.block_hashes[1:2])], parts)
    [second] = events.take(parts)
    assert second.parent_block_hash == req.block_hashes[0]


def test_stored_event_carries_tokens_parent_block_size_and_lora_of_a_chained_run():
    events, parts = KVEvents(BS, None, TIMEOUT), parts_of()
    req = TokReq("a", 4 * BS, lora_request=SimpleNamespace(adapter_id=7, name="sql"))
    events.expect(req, 1, 3)
    events.saved([report("s0", req.block_hashes[1:3])], parts)
    assert events.take(parts) == [
        Stored(req.block_hashes[1:3], req.block_hashes[0], req.all_token_ids[BS : 3 * BS], BS, 7, "sql")
    ]


def test_first_block_has_no_parent_and_unrelated_blocks_are_separate_events():
    events, parts = KVEvents(BS, None, TIMEOUT), parts_of()
    a, b = TokReq("a", BS), TokReq("b", BS)
    events.expect(a, 0, 1)
    events.expect(b, 0, 1)
    events.saved([report("s0", a.block_hashes + b.block_hashes)], parts)
    stored = events.take(parts)
    assert [e.block_hashes for e in stored] == [a.block_hashes, b.block_hashes]
    assert {e.parent_block_hash for e in stored} == {None}


def test_a_block_stored_again_is_not_announced_twice():
    events, parts = KVEvents(BS, None, TIMEOUT), parts_of()
    req = TokReq("a", BS)
    for _ in range(2):
        events.expect(req, 0, 1)
        events.saved([report("s0", req.block_hashes)], parts)
    assert len(events.take(parts)) == 1
    events.expect(req, 0, 1)
    events.saved([report("s0", req.block_hashes)], parts)
    assert events.take(parts) == []


def test_failed_save_is_never_announced():
    events, parts = KVEvents(BS, None, TIMEOUT), parts_of(("s0", "s1"))
    req = TokReq("a", BS)
    events.expect(req, 0, 1)
    events.saved([report("s0", req.block_hashes), report("s1", failed=req.block_hashes)], parts)
    assert events.take(parts) == []
    events.saved([report("s1", req.block_hashes)], parts)  # the failed save is forgotten
    assert events.take(parts) == []


def test_a_save_that_never_reports_is_forgotten_after_its_timeout():
    events, parts = KVEvents(BS, None, 0.0), parts_of()
    req = TokReq("a", BS)
    events.expect(req, 0, 1)
    events.take(parts)
    events.saved([report("s0", req.block_hashes)], parts)
    assert events.take(parts) == []


# ---- removal without a watch (Mooncake, Memcache) -------------------------------
def test_without_a_watch_an_announced_block_found_missing_is_removed_once():
    events, parts = KVEvents(BS, None, TIMEOUT), parts_of()
    req = TokReq("a", BS)
    events.missing(req.block_hashes[0])  # never announced: nothing to say
    assert events.take(parts) == []
    events.expect(req, 0, 1)
    events.saved([report("s0", req.block_hashes)], parts)
    events.take(parts)
    events.missing(req.block_hashes[0])
    events.missing(req.block_hashes[0])
    assert events.take(parts) == [Removed(req.block_hashes)]


def test_weight_version_change_removes_every_announced_block():
    events, parts = KVEvents(BS, None, TIMEOUT), parts_of()
    req = TokReq("a", 2 * BS)
    events.expect(req, 0, 2)
    events.saved([report("s0", req.block_hashes)], parts)
    events.take(parts)
    assert events.take(parts_of(digest="d2")) == [Removed(req.block_hashes)]


# ---- the scheduler feeds it ------------------------------------------------------
def test_scheduler_expects_the_saves_it_plans_and_reports_lookup_misses():
    dep, backend = deployment(tp=2, heads=2), DictBackend()
    events = KVEvents(BS, None, TIMEOUT)
    sched = AioScheduler(dep, backend, events)
    req = Req("a", 3 * BS)
    sched.update_state_after_alloc(req, blocks([1, 2, 3]), 0)
    req.all_token_ids, req.lora_request = list(range(3 * BS)), None
    sched.build_connector_meta(step(new=[("a", [1, 2, 3], 0)], scheduled={"a": 3 * BS}))
    events.saved([report(s, req.block_hashes) for s in shards(dep)], sched.parts)
    [stored] = events.take(sched.parts)
    assert stored.block_hashes == req.block_hashes
    store(backend, dep, req, 1)  # block 1 is gone from the store
    sched.get_num_new_matched_tokens(req, 0)
    assert events.take(sched.parts) == [Removed(req.block_hashes[1:2])]


def test_blocks_of_a_preempted_request_copied_out_are_announced_too(monkeypatch):

    monkeypatch.setattr(Req, "all_token_ids", property(lambda r: list(range(r.num_tokens))), raising=False)
    monkeypatch.setattr(Req, "lora_request", None, raising=False)
    events = KVEvents(BS, None, TIMEOUT)
    sched = AioScheduler(deployment(), DictBackend(), events)
    req = decoded_for_a_while(sched)
    events.take(sched.parts)  # the prompt's blocks: never reported here
    meta = sched.build_connector_meta(step(preempted=["a"]))
    events.saved([report(shards(deployment())[0], req.block_hashes[2:4])], sched.parts)
    [stored] = events.take(sched.parts)
    assert [list(t.block_ids) for t in meta.rescues] == [[3, 4]]
    assert (stored.block_hashes, stored.token_ids) == (req.block_hashes[2:4], list(range(2 * BS, 4 * BS)))


# ---- the embedded pool's watch -----------------------------------------------------
@pytest.fixture
def local():
    made = []

    def make(slots: int = 8) -> LocalBackend:
        made.append(LocalBackend(f"ev-{uuid.uuid4().hex[:8]}", slots * 64, 64, seal=False, shared=True))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


def put_block(backend: LocalBackend, parts: BlockParts, block_hash: bytes) -> None:
    value = (ctypes.c_char * 64)()
    keys = parts.keys(block_hash)
    assert all(s.stored for s in backend.batch_put(keys, [[(ctypes.addressof(value), 64)]] * len(keys)))


def test_pool_watch_announces_only_blocks_with_every_part_stored(local):
    backend, parts = local(), parts_of(("s0", "s1"))
    whole, half = digest("w"), digest("h")
    put_block(backend, parts, whole)
    put_block(backend, parts_of(("s0",)), half)
    watch = backend.block_watch()
    assert watch.add(parts, [whole, half]) == [whole]
    assert watch.add(parts, [whole]) == []  # already watched


def test_eviction_by_another_attachment_reaches_the_watch(local):
    backend, parts = local(slots=4), parts_of()
    watch = backend.block_watch()
    old = [digest(i) for i in range(4)]
    for h in old:
        put_block(backend, parts, h)
    watch.add(parts, old)
    other = SharedHostPool(backend.pool.name, 64, 4)  # e.g. a worker, or another instance on the pool
    try:
        reserved = PoolSlots(other).reserve(["x", "y"])  # evicts the two least recently used blocks
        other.abandon(reserved)
    finally:
        other.close()
    assert sorted(watch.take_gone()) == sorted(old[:2])
    assert watch.take_gone() == []


def test_a_block_evicted_and_stored_again_before_the_look_is_not_removed(local):
    backend, parts = local(slots=2), parts_of()
    watch = backend.block_watch()
    a, b, c = (digest(i) for i in range(3))
    put_block(backend, parts, a)
    put_block(backend, parts, b)
    watch.add(parts, [a, b])
    put_block(backend, parts, c)  # evicts a
    put_block(backend, parts, a)  # evicts b, stores a again
    assert watch.take_gone() == [b]


def test_a_log_overrun_rechecks_every_watched_block(local):
    backend, parts = local(slots=2), parts_of()
    watch = backend.block_watch()
    kept, lost = digest("k"), digest("l")
    put_block(backend, parts, kept)
    put_block(backend, parts, lost)
    watch.add(parts, [kept, lost])
    for i in range(5):  # more evictions than the log's two entries
        put_block(backend, parts, digest(i))
    put_block(backend, parts, kept)
    assert watch.take_gone() == [lost]


def test_scheduler_events_over_the_pool_store_then_remove(local):
    backend, parts = local(slots=2), parts_of()
    events = KVEvents(BS, backend.block_watch(), TIMEOUT)
    req = TokReq("a", 2 * BS)
    events.expect(req, 0, 2)
    put_block(backend, parts, req.block_hashes[0])  # block 1 is reported saved but is not in the pool
    events.saved([report("s0", req.block_hashes)], parts)
    put_block(backend, parts, digest("z"))
    [stored] = events.take(parts)
    assert stored.block_hashes == req.block_hashes[:1]
    put_block(backend, parts, digest("y"))
    put_block(backend, parts, digest("x"))
    assert events.take(parts) == [Removed(req.block_hashes[:1])]


def test_mooncake_lookup_finding_an_announced_block_missing_reports_it_removed(mooncake_backend):
    # Mooncake's client says nothing of evictions: only a lookup can tell. Block 1
    # is reported saved but was never put, as if the master had evicted it since.
    assert mooncake_backend.block_watch() is None
    events = KVEvents(BS, None, TIMEOUT)
    sched = AioScheduler(deployment(), mooncake_backend, events)
    value = (ctypes.c_char * 4096)()
    mooncake_backend.register_memory(ctypes.addressof(value), 4096)
    req = TokReq(uuid.uuid4().hex, 3 * BS)  # keys unique to this test on the session's pool
    for block_hash in (req.block_hashes[0], req.block_hashes[2]):
        keys = sched.parts.keys(block_hash)
        assert all(s.stored for s in mooncake_backend.batch_put(keys, [[(ctypes.addressof(value), 4096)]] * len(keys)))
    events.expect(req, 0, 3)
    events.saved([report(s, req.block_hashes) for s in sched.parts.shards], sched.parts)
    [stored] = events.take(sched.parts)
    assert stored.block_hashes == req.block_hashes
    assert sched.get_num_new_matched_tokens(req, 0) == (BS, False)
    assert events.take(sched.parts) == [Removed(req.block_hashes[1:2])]


# ---- the worker reports settled saves ------------------------------------------------
class _FailingLayer0(LocalBackend):
    """Values through batch_put, where layer 0 of the blocks in ``bad`` fails."""

    bad: set[bytes] = set()

    def slots(self):
        return None

    def batch_put(self, keys, segments, retention=0):
        out = super().batch_put(keys, segments, retention)
        return [Status.ERROR if k.endswith(":L0") and bytes.fromhex(k.split(":")[3]) in self.bad else s
                for k, s in zip(keys, out)]


def events_worker(backend, **options) -> AioWorker:
    cfg = AioConfig(staging_buffer_size=1 << 20, **options)
    dep = worker_deployment(cfg)
    worker = AioWorker(dep, backend, Ownership(dep.topology()), cfg, kv_events=True)
    worker.register_kv_caches(kv_caches(0), 16)
    return worker


def test_worker_reports_stored_and_existing_blocks_of_its_shard():
    backend = LocalBackend(f"w-{uuid.uuid4().hex[:8]}", 1 << 20, VALUE_BYTES, seal=True)
    worker = events_worker(backend)
    try:
        meta = AioConnectorMetadata(saves=[transfer([1, 2])])
        saved(worker, meta)
        saved(worker, meta)
        parts = worker.take_saved_parts()
        assert parts.shard == Ownership(worker_deployment(AioConfig()).topology()).shard_id
        assert SavedParts.split(parts.stored, parts.hash_size) == meta.saves[0].block_hashes * 2
        assert worker.take_saved_parts() is None
    finally:
        worker.close()


def test_layerwise_block_with_a_failed_layer_is_reported_failed():
    value = worker_deployment(AioConfig(transfer_mode="layerwise")).value_bytes
    backend = _FailingLayer0(f"w-{uuid.uuid4().hex[:8]}", 1 << 20, value, seal=True)
    worker = events_worker(backend, transfer_mode="layerwise")
    try:
        meta = AioConnectorMetadata(saves=[transfer([1, 2])])
        backend.bad = {meta.saves[0].block_hash(0)}
        forward(worker, meta)
        worker.drain()
        parts = worker.take_saved_parts()
        assert SavedParts.split(parts.failed, parts.hash_size) == [meta.saves[0].block_hash(0)]
        assert SavedParts.split(parts.stored, parts.hash_size) == [meta.saves[0].block_hash(1)]
    finally:
        worker.close()


def test_worker_without_kv_events_reports_nothing():
    backend = LocalBackend(f"w-{uuid.uuid4().hex[:8]}", 1 << 20, VALUE_BYTES, seal=True)
    cfg = AioConfig(staging_buffer_size=1 << 20)
    dep = worker_deployment(cfg)
    worker = AioWorker(dep, backend, Ownership(dep.topology()), cfg)
    worker.register_kv_caches(kv_caches(0), 16)
    try:
        saved(worker, AioConnectorMetadata(saves=[transfer([1, 2])]))
        assert worker.take_saved_parts() is None
    finally:
        worker.close()


def test_settled_saves_are_taken_once():
    settled = SettledSaves("s0")
    settled.add([b"a" * 4, b"b" * 4], [True, False])
    assert settled.take() == SavedParts("s0", 4, b"aaaa", b"bbbb")
    assert settled.take() is None


# ---- vLLM's types ---------------------------------------------------------------------
def test_events_become_vllms_block_stored_and_removed_with_the_medium():
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as published  # as vLLM publishes its own

    from vllm_aio.connector.vllm_events import to_vllm

    h0, h1 = digest(0), digest(1)
    stored, removed = to_vllm([Stored([h1], h0, [1, 2], 2, None, None), Removed([h0, h1])], "LOCAL_POOL")
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert (stored.block_hashes, stored.parent_block_hash) == ([published(h1)], published(h0))
    assert (stored.token_ids, stored.block_size, stored.lora_id, stored.lora_name) == ([1, 2], 2, None, None)
    assert (stored.medium, stored.group_idx) == ("LOCAL_POOL", 0)
    assert (removed.block_hashes, removed.medium) == ([published(h0), published(h1)], "LOCAL_POOL")


def test_backends_name_their_medium():
    from vllm_aio.backends.memcache import MemcacheBackend
    from vllm_aio.backends.mooncake import MooncakeBackend

    assert (LocalBackend.event_medium, MooncakeBackend.event_medium, MemcacheBackend.event_medium) == (
        "LOCAL_POOL", "MOONCAKE", "MEMCACHE")


def test_ranks_saved_parts_reach_the_events_through_vllms_worker_metadata():
    """Two ranks' reports ride vLLM's worker metadata, pickled as vLLM sends a worker's output,
    folded by vLLM's own aggregator (the multiproc executor's with TP=2) and read back by the facade."""
    import copy
    import pickle

    from vllm.distributed.kv_events import BlockStored
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

    from vllm_aio.connector.connector import AioConnector
    from vllm_aio.connector.vllm_events import SavedPartsMetadata

    dep = deployment(tp=2, heads=2)
    connector = AioConnector.__new__(AioConnector)  # the facade alone, over a real scheduler half
    connector._scheduler = sched = AioScheduler(dep, DictBackend(), KVEvents(BS, None, TIMEOUT))
    req = Req("a", 3 * BS)
    sched.update_state_after_alloc(req, blocks([1, 2, 3]), 0)
    req.all_token_ids, req.lora_request = list(range(3 * BS)), None
    sched.build_connector_meta(step(new=[("a", [1, 2, 3], 0)], scheduled={"a": 3 * BS}))
    outputs = []
    for shard in shards(dep):
        output = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
        meta = SavedPartsMetadata([report(shard, req.block_hashes)])
        output.kv_connector_output = KVConnectorOutput(kv_connector_worker_meta=pickle.loads(pickle.dumps(meta)))
        outputs.append(output)
    merged = KVOutputAggregator(len(outputs)).aggregate(outputs)
    assert len(merged.kv_connector_output.kv_connector_worker_meta.reports) == 2
    connector.update_connector_output(merged.kv_connector_output)
    [stored] = connector.take_events()
    assert isinstance(stored, BlockStored) and len(stored.block_hashes) == 3
    assert list(connector.take_events()) == []
