"""The worker half over the real embedded pool and CPU tensors shaped like vLLM's KV cache."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from array import array

import pytest
import torch

from harness.worker_fakes import (LAYERS, NUM_BLOCKS, PAGE_BYTES, VALUE_BYTES, deployment, forward,
                                  kv_caches, saved, transfer)
from vllm_aio.backends import Status
from vllm_aio.backends.local import LocalBackend
from vllm_aio.config import AioConfig
from vllm_aio.connector.worker.worker import AioWorker
from vllm_aio.pool.entry import HEADER_BYTES
from vllm_aio.pool.keys import block_key
from vllm_aio.pool.ownership import Ownership
from vllm_aio.shared.metadata import AioConnectorMetadata, BlockTransfer, LookupCounts

# A guard against a hang only: every wait is answered within milliseconds when the code is right.
HANG_GUARD = 30.0


@pytest.fixture
def make_worker():
    made = []

    def make(backend=None, caches=None, tp_size=1, tp_rank=0, heads=4, salt="", **options):
        cfg = AioConfig(**{"staging_buffer_size": 1 << 20, **options})
        dep = deployment(cfg, tp_size, heads, salt)
        backend = backend or LocalBackend(f"w-{uuid.uuid4().hex[:8]}", 1 << 20, dep.value_bytes, seal=True)
        worker = AioWorker(dep, backend, Ownership(dep.topology(tp_rank=tp_rank)), cfg)
        worker.register_kv_caches(caches if caches is not None else kv_caches(0), NUM_BLOCKS)
        made.append(worker)
        return worker, backend

    yield make
    for w in made:
        w.close()


def test_saved_blocks_load_back_into_other_block_ids_byte_for_byte(make_worker):
    src_caches, dst_caches = kv_caches(1), kv_caches(2)
    saver, backend = make_worker(caches=src_caches)
    saved(saver, AioConnectorMetadata(saves=[transfer([3, 4, 5])]))
    loader, _ = make_worker(backend=backend, caches=dst_caches)
    loader.start_load_kv(AioConnectorMetadata(loads=[transfer([9, 10, 11])]))
    assert loader.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        assert torch.equal(dst_caches[name][9:12], src_caches[name][3:6])


@pytest.mark.parametrize("options", [{}, {"transfer_mode": "layerwise"}], ids=["whole_blocks", "layerwise"])
def test_preempted_blocks_are_out_of_the_cache_when_handle_preemptions_returns(make_worker, options):
    caches = kv_caches(1)
    original = {name: t.clone() for name, t in caches.items()}
    saver, backend = make_worker(caches=caches, **options)
    saver.handle_preemptions(AioConnectorMetadata(rescues=[transfer([3, 4, 5])]))
    for t in caches.values():
        t.zero_()  # what vLLM does next to blocks it hands to another request
    saver.drain()
    loaded = kv_caches(2)
    loader, _ = make_worker(backend=backend, caches=loaded, **options)
    assert forward(loader, AioConnectorMetadata(loads=[transfer([9, 10, 11])])) == set()
    for name in LAYERS:
        assert torch.equal(loaded[name][9:12], original[name][3:6])


def _hold_copies(worker: AioWorker, monkeypatch) -> threading.Event:
    """The worker's saves stay in their copy out of the cache until the returned event is set."""
    release, save = threading.Event(), worker._io._save

    def held(*args):
        release.wait(HANG_GUARD)
        return save(*args)

    monkeypatch.setattr(worker._io, "_save", held)
    return release


def _returns_while_held(hook, release: threading.Event) -> bool:
    """Whether ``hook`` returns while the copies are held (then they are released)."""
    call = threading.Thread(target=hook)
    call.start()
    call.join(0.3)
    returned = not call.is_alive()
    release.set()
    call.join(HANG_GUARD)
    assert not call.is_alive()
    return returned


@pytest.mark.parametrize("mode", ["whole_blocks", "layerwise"])
def test_a_steps_copy_out_of_the_cache_is_waited_for_at_the_next_steps_start(make_worker, monkeypatch, mode):
    """vLLM's runners open every step with handle_preemptions, before they zero or write a block:
    the step that computed a prompt returns its token while its blocks are being copied out."""
    worker, backend = make_worker(transfer_mode=mode)
    release = _hold_copies(worker, monkeypatch)
    worker.handle_preemptions(AioConnectorMetadata())
    forward(worker, AioConnectorMetadata(saves=[transfer([3, 4])]))  # returns, the copies held
    assert not _returns_while_held(lambda: worker.handle_preemptions(AioConnectorMetadata()), release)
    worker.drain()
    assert backend.pool.usage().num_ready == 2 * (len(LAYERS) if mode == "layerwise" else 1)


def test_without_handle_preemptions_wait_for_save_waits_for_the_copy_out_of_the_cache(make_worker, monkeypatch):
    """A runner that never calls handle_preemptions gets no later point to wait at."""
    worker, _ = make_worker()
    release = _hold_copies(worker, monkeypatch)
    meta = AioConnectorMetadata(saves=[transfer([3, 4])])
    assert not _returns_while_held(lambda: worker.wait_for_save(meta), release)


class _RetentionRecorder(LocalBackend):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.puts: list[tuple[int, int]] = []  # (keys, retention) per batch_put

    def slots(self):  # values through batch_put, which records them
        return None

    def batch_put(self, keys, segments, retention=0):
        self.puts.append((len(keys), retention))
        return super().batch_put(keys, segments, retention)


def test_a_step_saves_each_retention_class_as_a_batch_of_its_own(make_worker):
    backend = _RetentionRecorder(f"w-{uuid.uuid4().hex[:8]}", 1 << 20, VALUE_BYTES, seal=True)
    worker, _ = make_worker(backend=backend)
    urgent = BlockTransfer.of("u", [1, 2], [b"u0", b"u1"], 0, retention=1)
    saved(worker, AioConnectorMetadata(saves=[transfer([3, 4, 5]), urgent]))
    assert sorted(backend.puts) == [(2, 1), (3, 0)]


def test_missing_blocks_are_reported_as_load_errors_once(make_worker, caplog):
    worker, _ = make_worker()
    saved(worker, AioConnectorMetadata(saves=[transfer([1])]))
    with caplog.at_level(logging.WARNING, logger="vllm"):
        worker.start_load_kv(AioConnectorMetadata(loads=[transfer([6, 7, 8])]))
    assert worker.get_block_ids_with_load_errors() == {7, 8}
    assert worker.get_block_ids_with_load_errors() == set()
    assert "request r: 2 pool blocks could not be loaded (2 missing)" in caplog.text


class _RaisingBackend(LocalBackend):
    def slots(self):  # values through batch_get/put, which fail here
        return None

    def batch_get(self, keys, segments):
        raise ConnectionError("pool gone")

    def batch_put(self, keys, segments, retention=0):
        raise ConnectionError("pool gone")


def test_backend_failure_turns_every_block_into_a_load_error(make_worker):
    backend = _RaisingBackend(f"w-{uuid.uuid4().hex[:8]}", 1 << 20, VALUE_BYTES, seal=True)
    worker, _ = make_worker(backend=backend)
    worker.start_load_kv(AioConnectorMetadata(loads=[transfer([2, 3])]))
    assert worker.get_block_ids_with_load_errors() == {2, 3}


def test_failed_saves_are_logged_once_and_counted(make_worker, caplog):
    backend = _RaisingBackend(f"w-{uuid.uuid4().hex[:8]}", 1 << 20, VALUE_BYTES, seal=True)
    worker, _ = make_worker(backend=backend)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        for _ in range(3):
            saved(worker, AioConnectorMetadata(saves=[transfer([1, 2])]))
    assert caplog.text.count("pool save failed") == 1
    assert worker.take_stats().data["save_failures"] == 6


def test_a_save_the_pool_cannot_keep_up_with_is_dropped_logged_once_and_counted(make_worker, caplog):
    backend = _RaisingBackend(f"w-{uuid.uuid4().hex[:8]}", 1 << 20, VALUE_BYTES, seal=True)
    gate, put = threading.Event(), LocalBackend.batch_put
    backend.batch_put = lambda *args: (gate.wait(30), put(backend, *args))[1]  # a slow pool
    worker, _ = make_worker(backend=backend, staging_buffer_size=2 * VALUE_BYTES)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        worker.wait_for_save(AioConnectorMetadata(saves=[transfer([1, 2])]))  # fills the staging
        for step in range(2):  # each out of the cache at once, never offered to the pool
            worker.wait_for_save(AioConnectorMetadata(saves=[transfer([3], tag=f"s{step}")]))
        gate.set()
        worker.drain()
    stats = worker.take_stats().data
    assert (stats["save_blocks"], stats["save_dropped"], stats["save_failures"]) == (2, 2, 0)
    assert caplog.text.count("the puts of earlier saves still held the staging buffer") == 1


def test_stats_count_bytes_and_skip_known_blocks(make_worker):
    worker, _ = make_worker()
    saved(worker, AioConnectorMetadata(saves=[transfer([1, 2])]))
    saved(worker, AioConnectorMetadata(saves=[transfer([1, 2])]))
    worker.start_load_kv(AioConnectorMetadata(loads=[transfer([5, 6])], lookups=LookupCounts(16, 4)))
    assert worker.get_block_ids_with_load_errors() == set()  # vLLM asks before the stats: loads settle there
    data = worker.take_stats().data
    assert data["save_blocks"] == 2 and data["save_already_stored"] == 2
    assert data["load_bytes"] == 2 * VALUE_BYTES
    assert (data["hit_tokens"], data["miss_tokens"]) == (16, 4)
    assert worker.take_stats() is None


class _HourLongPuts(LocalBackend):
    """Values through batch_put (the staging path), each put an hour on the test's clock."""

    def __init__(self, *args, clock: list[float], **kwargs):
        super().__init__(*args, **kwargs)
        self.clock = clock

    def slots(self):
        return None

    def batch_put(self, keys, segments, retention=0):
        self.clock[0] += 3600.0
        return super().batch_put(keys, segments, retention)


def test_save_seconds_time_the_copy_out_of_the_cache_not_what_follows_it(make_worker, monkeypatch):
    """The pool puts (and, on the direct path, the publishing) run beside the next step's forward:
    timed with them, a save's rate said nothing about the save."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    backend = _HourLongPuts(f"w-{uuid.uuid4().hex[:8]}", 1 << 20, VALUE_BYTES, seal=True, clock=clock)
    worker, _ = make_worker(backend=backend)
    saved(worker, AioConnectorMetadata(saves=[transfer([1, 2])]))
    data = worker.take_stats().data
    assert (data["save_blocks"], data["save_bytes"]) == (2, 2 * VALUE_BYTES)
    assert data["save_seconds"] < 3600.0


class _GaugedPool(LocalBackend):
    READINGS = {"pool_used_bytes": 4096.0, "pool_capacity_bytes": 1048576.0, "pool_stored_values": 2.0,
                "pool_evicted_values": 0.0}

    def gauges(self):
        return dict(self.READINGS)


def test_stats_carry_the_backends_readings_of_the_pool_with_the_counters(make_worker):
    backend = _GaugedPool(f"w-{uuid.uuid4().hex[:8]}", 1 << 20, VALUE_BYTES, seal=True)
    worker, _ = make_worker(backend=backend)
    assert worker.take_stats() is None  # readings alone are not reported
    saved(worker, AioConnectorMetadata(saves=[transfer([1, 2])]))
    data = worker.take_stats().data
    assert data["save_blocks"] == 2
    assert {name: data[name] for name in _GaugedPool.READINGS} == _GaugedPool.READINGS


def test_only_rank_zero_reports_lookup_counts(make_worker):
    worker, _ = make_worker(tp_size=2, tp_rank=1)
    worker.start_load_kv(AioConnectorMetadata(lookups=LookupCounts(16, 4)))
    assert worker.take_stats() is None


def test_kv_cache_of_unexpected_size_is_refused_at_registration(make_worker):
    with pytest.raises(ValueError, match="promises"):
        make_worker(caches={n: torch.zeros((NUM_BLOCKS, 2, 4, 4), dtype=torch.bfloat16) for n in LAYERS})


def test_status_stored_means_ok_or_exists():
    assert {s for s in Status if s.stored} == {Status.OK, Status.EXISTS}


def test_replicas_split_the_stores_and_each_loads_every_block(make_worker):
    # One KV head over two TP ranks: identical bytes, stored once between them.
    caches = kv_caches(1)
    rank0, backend = make_worker(caches=caches, tp_size=2, tp_rank=0, heads=1)
    rank1, _ = make_worker(backend=backend, caches=caches, tp_size=2, tp_rank=1, heads=1)
    for worker in (rank0, rank1):
        saved(worker, AioConnectorMetadata(saves=[transfer([1, 2, 3, 4, 5])]))
    assert backend.pool.usage().num_ready == 5
    assert rank0.take_stats().data["save_blocks"] == 3 and rank1.take_stats().data["save_blocks"] == 2
    for worker in (rank0, rank1):
        dst = kv_caches(2)
        worker.register_kv_caches(dst, NUM_BLOCKS)
        worker.start_load_kv(AioConnectorMetadata(loads=[transfer([10, 11, 12, 13, 14])]))
        assert worker.get_block_ids_with_load_errors() == set()
        assert all(torch.equal(dst[n][10:15], caches[n][1:6]) for n in LAYERS)


def test_layerwise_values_round_trip_one_layer_at_a_time(make_worker):
    src, dst = kv_caches(1), kv_caches(2)
    saver, backend = make_worker(caches=src, transfer_mode="layerwise")
    forward(saver, AioConnectorMetadata(saves=[transfer([3, 4, 5])]))
    saver.drain()
    assert backend.pool.usage().num_ready == 3 * len(LAYERS)  # one value per block and layer
    loader, _ = make_worker(backend=backend, caches=dst, transfer_mode="layerwise", layerwise_prefetch_layers=0)
    assert forward(loader, AioConnectorMetadata(loads=[transfer([9, 10, 11])])) == set()
    for name in LAYERS:
        assert torch.equal(dst[name][9:12], src[name][3:6])


def test_layerwise_and_whole_block_values_never_mix(make_worker):
    saver, backend = make_worker(transfer_mode="layerwise")
    forward(saver, AioConnectorMetadata(saves=[transfer([1, 2])]))
    saver.drain()
    loader, _ = make_worker(backend=backend)
    loader.start_load_kv(AioConnectorMetadata(loads=[transfer([5, 6])]))
    assert loader.get_block_ids_with_load_errors() == {5, 6}


def test_async_load_is_reported_finished_once_its_blocks_are_in_place(make_worker):
    src, dst = kv_caches(1), kv_caches(2)
    saver, backend = make_worker(caches=src)
    saved(saver, AioConnectorMetadata(saves=[transfer([3, 4])]))
    loader, _ = make_worker(backend=backend, caches=dst, transfer_mode="async")
    loader.start_load_kv(AioConnectorMetadata(loads=[transfer([9, 10])]))
    loader.drain()
    assert loader.get_finished() == ({"r"}, set())
    assert loader.get_finished() == (set(), set())
    assert loader.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(dst[n][9:11], src[n][3:5]) for n in LAYERS)


def test_async_load_with_missing_blocks_finishes_and_reports_them(make_worker):
    loader, _ = make_worker(transfer_mode="async")
    loader.start_load_kv(AioConnectorMetadata(loads=[transfer([9, 10])]))
    loader.drain()
    assert loader.get_finished() == ({"r"}, set())
    assert loader.get_block_ids_with_load_errors() == {9, 10}


def test_value_with_a_foreign_header_is_refused(make_worker, caplog):
    loader, backend = make_worker()
    dep = deployment(AioConfig())
    key = block_key(dep.namespace.digest(), Ownership(dep.topology()).shard_id, b"x0000")
    # Another writer's bytes under our key: same length, different header.
    forged = torch.zeros(VALUE_BYTES, dtype=torch.uint8)
    backend.batch_put([key], [[(forged.data_ptr(), VALUE_BYTES)]])
    with caplog.at_level(logging.WARNING, logger="vllm"):
        loader.start_load_kv(AioConnectorMetadata(loads=[transfer([4])]))
    assert loader.get_block_ids_with_load_errors() == {4}
    assert "1 foreign" in caplog.text


class _TearingBackend(LocalBackend):
    """The embedded pool, whose every slot is rewritten while a direct load copies it."""

    def slots(self):
        return _TornSlots(super().slots())


class _TornSlots:
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def unchanged(self, slots, versions):
        return self.inner.unchanged(slots, versions) & False


def _loading_and_saving() -> AioConnectorMetadata:
    """A step loading x0000 (stored) and x0001 (not) into blocks 6, 7, and saving blocks of
    requests that read both (r), only block 6 (t), or nothing loaded (s)."""
    return AioConnectorMetadata(
        loads=[transfer([6, 7])],
        saves=[dataclasses.replace(transfer([9], tag="r"), reads=array("i", [6, 7])),
               dataclasses.replace(transfer([10], tag="s"), req_id="s"),
               dataclasses.replace(transfer([11], tag="t"), req_id="t", reads=array("i", [6]))],
    )


def _step_loading_and_saving(worker: AioWorker) -> set[int]:
    errors = forward(worker, _loading_and_saving())
    worker.drain()
    return errors


@pytest.mark.parametrize("mode", ["whole_blocks", "layerwise"])
def test_a_request_that_read_a_block_whose_load_failed_saves_nothing_of_that_step(make_worker, mode):
    worker, backend = make_worker(transfer_mode=mode)
    units = len(LAYERS) if mode == "layerwise" else 1
    forward(worker, AioConnectorMetadata(saves=[transfer([1])]))  # x0000
    worker.drain()
    assert _step_loading_and_saving(worker) == {7}
    assert backend.pool.usage().num_ready == 3 * units  # x0000, then s's and t's blocks: not r's


def test_a_block_torn_during_a_direct_load_keeps_its_readers_from_saving(make_worker):
    backend = _TearingBackend(f"w-{uuid.uuid4().hex[:8]}", 1 << 20, VALUE_BYTES, seal=True)
    worker, _ = make_worker(backend=backend)
    assert worker._io.direct
    saved(worker, AioConnectorMetadata(saves=[transfer([1])]))
    assert _step_loading_and_saving(worker) == {6, 7}
    assert backend.pool.usage().num_ready == 2  # x0000 and s's block


class _GatedBackend(LocalBackend):
    """Records each layer's get and put as it starts; a get may be held until the test releases it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.started = {(kind, layer): threading.Event() for kind in ("get", "put") for layer in range(len(LAYERS))}
        self.release_gets = threading.Event()
        self.release_gets.set()

    def slots(self):  # values through batch_get/put, which this backend intercepts
        return None

    def batch_get(self, keys, segments):
        self.started[("get", _layer(keys))].set()
        self.release_gets.wait()
        return super().batch_get(keys, segments)

    def batch_put(self, keys, segments, retention=0):
        self.started[("put", _layer(keys))].set()
        return super().batch_put(keys, segments, retention)


def _layer(keys) -> int:
    return int(keys[0].rsplit(":L", 1)[1])


def gated_backend() -> _GatedBackend:
    return _GatedBackend(f"w-{uuid.uuid4().hex[:8]}", 1 << 20, HEADER_BYTES + PAGE_BYTES, seal=True)




def test_layerwise_transfers_overlap_the_layers_compute(make_worker):
    backend = gated_backend()
    saver, _ = make_worker(backend=backend, transfer_mode="layerwise")
    forward(saver, AioConnectorMetadata(saves=[transfer([3, 4], tag="old")]))
    saver.drain()
    worker, _ = make_worker(backend=backend, transfer_mode="layerwise", layerwise_prefetch_layers=1)
    for event in backend.started.values():
        event.clear()
    overlapped = {}

    def compute(layer):
        # Layer 1 is fetched while layer 0 computes; layer 0 is stored while layer 1 computes.
        other = ("get", 1) if layer == 0 else ("put", 0)
        overlapped[layer] = backend.started[other].wait(HANG_GUARD)

    meta = AioConnectorMetadata(loads=[transfer([9, 10], tag="old")], saves=[transfer([5, 6], tag="new")])
    assert forward(worker, meta, compute) == set()
    assert overlapped == {0: True, 1: True}


def test_layer_load_past_the_timeout_fails_the_step_without_waiting_per_layer(make_worker, caplog):
    backend = gated_backend()
    saver, _ = make_worker(backend=backend, transfer_mode="layerwise")
    forward(saver, AioConnectorMetadata(saves=[transfer([3, 4])]))
    saver.drain()
    backend.release_gets.clear()  # the pool never answers while the step runs
    worker, _ = make_worker(backend=backend, transfer_mode="layerwise", transfer_timeout=0.2)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm"):
            errors = forward(worker, AioConnectorMetadata(loads=[transfer([9, 10])]))
    finally:
        backend.release_gets.set()
    assert errors == {9, 10}
    # Layer 0 waited out the timeout; layer 1 failed at once, without a wait of its own.
    assert caplog.text.count("exceeded transfer_timeout") == 1
    assert "layer 0 load exceeded transfer_timeout=0.2s" in caplog.text
    assert "2 pool blocks could not be loaded (2 timeout)" in caplog.text


def _hybrid_worker(caches: dict[str, torch.Tensor], backend=None) -> tuple[AioWorker, LocalBackend]:
    """A worker of two KV cache groups whose layers ``l*`` and ``w*`` are laid over each other."""
    from vllm_aio.shared.deployment import CacheGroup

    cfg = AioConfig(staging_buffer_size=1 << 20, transfer_mode="async")
    groups = (CacheGroup(LAYERS, 16), CacheGroup(("w0", "w1")))
    dep = dataclasses.replace(deployment(cfg), groups=groups)
    backend = backend or LocalBackend(f"w-{uuid.uuid4().hex[:8]}", 1 << 20, dep.value_bytes, seal=True)
    worker = AioWorker(dep, backend, Ownership(dep.topology()), cfg)
    worker.register_kv_caches(caches, NUM_BLOCKS)
    return worker, backend


def _overlaid(seed: int) -> dict[str, torch.Tensor]:
    caches = kv_caches(seed)
    return {**caches, "w0": caches["l0"], "w1": caches["l1"]}


def test_groups_not_laid_over_each_other_are_refused():
    from vllm_aio.device.block_layout import check_groups_alias

    check_groups_alias(_overlaid(0), [LAYERS, ("w0", "w1")])
    caches = {**kv_caches(0), "w0": kv_caches(1)["l0"], "w1": kv_caches(1)["l1"]}
    with pytest.raises(ValueError, match="group 1's layer 0 .w0. is not the memory of group 0's layer 0"):
        check_groups_alias(caches, [LAYERS, ("w0", "w1")])


def test_a_hybrid_request_loads_every_group_in_one_background_load():
    src, dst = _overlaid(1), _overlaid(2)
    saver, backend = _hybrid_worker(src)
    saved(saver, AioConnectorMetadata(saves=[transfer([3], "s"), transfer([4, 5], "f")]))
    loader, _ = _hybrid_worker(dst, backend)
    loader.start_load_kv(AioConnectorMetadata(loads=[transfer([9], "s"), transfer([10, 11], "f")]))
    loader.drain()
    assert loader.get_finished() == ({"r"}, set())
    assert all(torch.equal(dst[n][9:12], src[n][3:6]) for n in LAYERS)
    for worker in (saver, loader):
        worker.close()


def test_a_hybrid_requests_failed_load_is_reported_per_request_not_per_block():
    # vLLM 0.32 refuses failed block ids of a model with several KV cache groups.
    loader, _ = _hybrid_worker(_overlaid(0))
    loader.start_load_kv(AioConnectorMetadata(loads=[transfer([9], "s"), transfer([10], "f")]))
    loader.drain()
    assert loader.get_finished() == ({"r"}, {"r"})
    assert loader.get_block_ids_with_load_errors() == set()
    loader.close()


# Whole-block saves ask for the step's loads in wait_for_save, after get_block_ids_with_load_errors
# took them (LoadReport.take_errors): a step's reported failures are kept until its next begin_step.
@pytest.mark.parametrize("mode", ["whole_blocks", "layerwise"])
def test_results_taken_before_wait_for_save_still_keep_a_failed_loads_readers_from_saving(make_worker, mode):
    """vLLM 0.33's model runner V2 with a drafter takes the step's transfer results and load errors
    after the forward and calls ``wait_for_save`` only once the drafter ran."""
    worker, backend = make_worker(transfer_mode=mode)
    units = len(LAYERS) if mode == "layerwise" else 1
    forward(worker, AioConnectorMetadata(saves=[transfer([1])]))  # x0000
    worker.drain()
    meta = _loading_and_saving()
    worker.begin_step(meta)
    worker.start_load_kv(meta)
    for name in LAYERS:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, meta)
    assert worker.get_finished() == (set(), set())
    assert worker.get_block_ids_with_load_errors() == {7}
    worker.wait_for_save(meta)
    worker.drain()
    assert backend.pool.usage().num_ready == 3 * units  # x0000, then s's and t's blocks: not r's
