"""The scheduler half against an in-memory backend and stand-ins for vLLM's
request and scheduler-output objects (the end-to-end tests use the real ones)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from harness.scheduler_fakes import (DictBackend, DownBackend, Req, block_hash, blocks, decoded_for_a_while,
                                     deployment, shards, step, store)
from vllm_aio.config import TransferMode
from vllm_aio.errors import ConfigError
from vllm_aio.connector.scheduler.leases import LEASE_MIN_SECONDS
from vllm_aio.connector.scheduler.scheduler import AioScheduler
from vllm_aio.migration.flushes import FlushRequests
from vllm_aio.pool.keys import block_key
from vllm_aio.shared.metadata import WorkerFacts


def test_lookup_counts_whole_blocks_beyond_the_local_hit():
    backend, dep = DictBackend(), deployment()
    req = Req("a", 22)  # 5 full blocks
    store(backend, dep, req, 4)
    sched = AioScheduler(dep, backend)
    assert sched.get_num_new_matched_tokens(req, 0) == (16, False)
    assert sched.get_num_new_matched_tokens(req, 8) == (8, False)
    assert sched.get_num_new_matched_tokens(req, 16) == (0, False)


def test_lookup_stops_at_the_first_missing_block():
    backend, dep = DictBackend(), deployment()
    req = Req("a", 20)
    store(backend, dep, req, 5)
    backend.keys.remove(block_key(dep.namespace.digest(), "pp0.dcp0.h0", req.block_hashes[2]))
    assert AioScheduler(dep, backend).get_num_new_matched_tokens(req, 0) == (8, False)


def test_full_prompt_hit_leaves_the_last_token_to_compute():
    backend, dep = DictBackend(), deployment()
    req = Req("a", 16)
    store(backend, dep, req, 4)
    assert AioScheduler(dep, backend).get_num_new_matched_tokens(req, 0) == (15, False)


def test_lookup_is_repeatable_without_side_effects_on_the_answer():
    backend, dep = DictBackend(), deployment()
    req = Req("a", 20)
    store(backend, dep, req, 3)
    sched = AioScheduler(dep, backend)
    answers = {sched.get_num_new_matched_tokens(req, 0) for _ in range(3)}
    assert answers == {(12, False)}


def test_block_counts_as_hit_only_when_every_shard_is_stored():
    backend, dep = DictBackend(), deployment(tp=2)
    req = Req("a", 20)
    assert shards(dep) == ["pp0.dcp0.h0", "pp0.dcp0.h1"]
    store(backend, dep, req, 5, only=["pp0.dcp0.h0"])
    assert AioScheduler(dep, backend).get_num_new_matched_tokens(req, 0) == (0, False)
    store(backend, dep, req, 5)
    assert AioScheduler(dep, backend).get_num_new_matched_tokens(req, 0) == (19, False)


def test_pool_down_at_lookup_is_a_miss():
    dep = deployment()
    assert AioScheduler(dep, DownBackend()).get_num_new_matched_tokens(Req("a", 20), 0) == (0, False)


def test_role_without_load_never_queries_the_pool():
    backend = DictBackend()
    sched = AioScheduler(deployment(load=False), backend)
    assert sched.get_num_new_matched_tokens(Req("a", 20), 0) == (0, False)
    assert backend.exists_calls == 0


def _allocated_hit(local_tokens: int) -> tuple[AioScheduler, Req]:
    """Request "a" (22 tokens, its first 4 blocks in the pool) with vLLM holding ``local_tokens``
    itself, allocated blocks 10-15 for the pool's hit."""
    backend, dep = DictBackend(), deployment()
    req = Req("a", 22)
    store(backend, dep, req, 4)
    sched = AioScheduler(dep, backend)
    n, _ = sched.get_num_new_matched_tokens(req, local_tokens)
    sched.update_state_after_alloc(req, blocks([10, 11, 12, 13, 14, 15]), n)
    return sched, req


def test_allocated_hit_becomes_a_load_of_exactly_the_pool_blocks():
    sched, req = _allocated_hit(4)  # vLLM holds block 0 itself
    meta = sched.build_connector_meta(step(new=[("a", [10, 11, 12, 13, 14, 15], 16)], scheduled={"a": 6}))
    (load,) = meta.loads
    assert list(load.block_ids) == [11, 12, 13]
    assert load.block_hashes == req.block_hashes[1:4]
    assert (meta.lookups.hit_tokens, meta.lookups.miss_tokens) == (12, 6)
    assert sched.build_connector_meta(step()).loads == []


def test_an_allocated_hit_is_leased_until_the_worker_reads_it():
    backend, dep = DictBackend(), deployment()
    req = Req("a", 22)
    store(backend, dep, req, 4)
    sched = AioScheduler(dep, backend)
    n, _ = sched.get_num_new_matched_tokens(req, 4)
    assert backend.leases == []  # a lookup promises nothing: the request may wait
    sched.update_state_after_alloc(req, blocks([10, 11, 12, 13, 14, 15]), n)
    assert backend.leases == [(req.block_hashes[1:4], LEASE_MIN_SECONDS)]  # no pace measured yet


def test_an_allocation_reported_a_step_after_its_lookup_loads_what_that_lookup_found():
    """vLLM 0.33 with async scheduling reports an async load's allocation at its next schedule,
    after a metadata build and other requests' lookups."""
    backend, dep = DictBackend(), deployment(transfer_mode=TransferMode.ASYNC)
    a, b = Req("a", 22), Req("b", 22)
    store(backend, dep, a, 4)
    store(backend, dep, b, 2)
    sched = AioScheduler(dep, backend, clock=lambda: 0.0)
    n, load_async = sched.get_num_new_matched_tokens(a, 4)  # vLLM holds block 0 itself
    assert (n, load_async) == (12, True)
    between = sched.build_connector_meta(step())
    assert between.loads == [] and (between.lookups.hit_tokens, between.lookups.miss_tokens) == (0, 0)
    assert sched.get_num_new_matched_tokens(b, 0) == (8, True)
    sched.update_state_after_alloc(a, blocks([10, 11, 12, 13, 14, 15]), n)
    assert backend.leases == [(a.block_hashes[1:4], LEASE_MIN_SECONDS)]  # leased once allocated
    meta = sched.build_connector_meta(step())
    (load,) = meta.loads
    assert (load.req_id, list(load.block_ids), load.block_hashes) == ("a", [11, 12, 13], a.block_hashes[1:4])
    assert (meta.lookups.hit_tokens, meta.lookups.miss_tokens) == (12, 6)


def test_a_failed_lease_leaves_the_load_planned():
    class NoLease(DictBackend):
        def lease_blocks(self, parts, hashes, seconds):
            raise ConnectionError("down")

    backend, dep = NoLease(), deployment()
    req = Req("a", 22)
    store(backend, dep, req, 4)
    sched = AioScheduler(dep, backend)
    n, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks([10, 11, 12, 13, 14, 15]), n)
    (load,) = sched.build_connector_meta(step(new=[("a", [10, 11, 12, 13, 14, 15], 0)], scheduled={"a": 6})).loads
    assert list(load.block_ids) == [10, 11, 12, 13]


def _two_requests_loading(sched, backend, dep):
    """Requests a (blocks 10-14, pool hit 16 tokens after vLLM's 4) and b (20-24, 16 tokens) loading in one step."""
    reqs = [Req("a", 22), Req("b", 22)]
    for req, ids in zip(reqs, ([10, 11, 12, 13, 14], [20, 21, 22, 23, 24])):
        store(backend, dep, req, 5)
        n, _ = sched.get_num_new_matched_tokens(req, 4)
        sched.update_state_after_alloc(req, blocks(ids), n)
    sched.build_connector_meta(
        step(new=[("a", [10, 11, 12, 13, 14], 4), ("b", [20, 21, 22, 23, 24], 4)], scheduled={"a": 2, "b": 2})
    )


def test_hit_tokens_whose_load_failed_are_counted_from_the_first_failed_block_once():
    backend, dep = DictBackend(), deployment()
    sched = AioScheduler(dep, backend)
    _two_requests_loading(sched, backend, dep)
    sched.update_connector_output({12, 14})  # a: tokens 8-19 (blocks 12-14) recomputed; b loaded
    sched.update_connector_output({12})  # reported again: counted once
    assert sched.build_connector_meta(step()).lookups.failed_hit_tokens == 12
    assert sched.build_connector_meta(step()).lookups.failed_hit_tokens == 0


def test_failed_blocks_of_a_finished_or_preempted_request_count_for_nobody():
    backend, dep = DictBackend(), deployment()
    sched = AioScheduler(dep, backend)
    _two_requests_loading(sched, backend, dep)
    sched.build_connector_meta(step(cached=[("b", [30, 31], 4, True)], scheduled={"b": 4}, finished=["a"]))
    sched.update_connector_output({11, 21})  # the old blocks of both, now another request's
    assert sched.build_connector_meta(step()).lookups.failed_hit_tokens == 0


def test_zero_external_tokens_loads_nothing():
    backend, dep = DictBackend(), deployment()
    req = Req("a", 20)
    store(backend, dep, req, 4)
    sched = AioScheduler(dep, backend)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5]), 0)
    assert sched.build_connector_meta(step(new=[("a", [1, 2, 3, 4, 5], 0)], scheduled={"a": 20})).loads == []


def test_chunked_prefill_saves_each_block_once_as_it_fills():
    sched = AioScheduler(deployment(), DictBackend())
    req = Req("a", 18)
    sched.update_state_after_alloc(req, blocks([7, 8, 9]), 0)
    m1 = sched.build_connector_meta(step(new=[("a", [7, 8, 9], 0)], scheduled={"a": 10}))
    assert [list(s.block_ids) for s in m1.saves] == [[7, 8]]
    m2 = sched.build_connector_meta(step(cached=[("a", [10, 11], 10, False)], scheduled={"a": 8}))
    assert [list(s.block_ids) for s in m2.saves] == [[9, 10]]
    assert m2.saves[0].block_hashes == req.block_hashes[2:4]


def test_decode_blocks_are_saved_only_with_save_decode_cache():
    for decode, expected in ((False, []), (True, [[3]])):
        sched = AioScheduler(deployment(decode=decode), DictBackend())
        req = Req("a", 8)
        sched.update_state_after_alloc(req, blocks([1, 2]), 0)
        sched.build_connector_meta(step(new=[("a", [1, 2], 0)], scheduled={"a": 8}))
        req.num_output_tokens = 4
        req.block_hashes.append(block_hash("a", 2))
        meta = sched.build_connector_meta(step(cached=[("a", [3], 11, False)], scheduled={"a": 1}))
        assert [list(s.block_ids) for s in meta.saves] == expected


def test_flush_saves_the_generated_blocks_of_the_named_running_request():
    flushes = FlushRequests()
    sched = AioScheduler(deployment(), DictBackend(), flushes=flushes)
    req, other = Req("a", 8), Req("b", 8)
    for r, ids in ((req, [1, 2]), (other, [5, 6])):
        sched.update_state_after_alloc(r, blocks(ids), 0)
    sched.build_connector_meta(step(new=[("a", [1, 2], 0), ("b", [5, 6], 0)], scheduled={"a": 8, "b": 8}))
    for r in (req, other):
        r.num_output_tokens = 4
        r.block_hashes.append(block_hash(r.request_id, 2))
    flushes.ask(req.block_hashes[2], 3)
    meta = sched.build_connector_meta(
        step(cached=[("a", [3], 11, False), ("b", [7], 11, False)], scheduled={"a": 1, "b": 1}))
    assert [(s.req_id, list(s.block_ids)) for s in meta.saves] == [("a", [3])]
    assert flushes.state(req.block_hashes[2]) is True


def test_weight_version_change_rekeys_lookups_and_metadata():
    backend, dep = DictBackend(), deployment()
    req = Req("a", 12)
    store(backend, dep, req, 3)
    sched = AioScheduler(dep, backend)
    assert sched.get_num_new_matched_tokens(req, 0) == (11, False)
    sched.keying.set_weight_version("v2")
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # KV of other weights never hits
    meta = sched.build_connector_meta(step())
    assert meta.namespace_digest == sched.parts.namespace_digest != dep.namespace.digest()
    sched.keying.set_weight_version("")
    assert sched.parts.namespace_digest == dep.namespace.digest()


def test_resumed_request_saves_into_its_new_blocks():
    sched = AioScheduler(deployment(), DictBackend())
    req = Req("a", 16)
    sched.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 0)
    sched.build_connector_meta(step(new=[("a", [1, 2, 3, 4], 0)], scheduled={"a": 8}))
    meta = sched.build_connector_meta(step(cached=[("a", [5, 6, 7, 8], 0, True)], scheduled={"a": 16}))
    assert [list(s.block_ids) for s in meta.saves] == [[5, 6, 7, 8]]


def test_a_preempted_request_has_its_generated_blocks_saved_before_the_step_writes():
    sched = AioScheduler(deployment(), DictBackend())
    req = decoded_for_a_while(sched)
    meta = sched.build_connector_meta(step(preempted=["a"]))
    assert meta.saves == []
    assert [(t.req_id, list(t.block_ids), t.first_index) for t in meta.rescues] == [("a", [3, 4], 2)]
    assert meta.rescues[0].block_hashes == req.block_hashes[2:4]


def test_a_preempted_request_with_every_block_saved_needs_no_rescue():
    sched = AioScheduler(deployment(decode=True), DictBackend())
    decoded_for_a_while(sched)
    assert sched.build_connector_meta(step(preempted=["a"])).rescues == []


def test_preemption_rescues_nothing_where_the_role_does_not_save():
    sched = AioScheduler(deployment(save=False), DictBackend())
    decoded_for_a_while(sched)
    assert sched.build_connector_meta(step(preempted=["a"])).rescues == []


def test_a_resumed_request_loading_its_generated_blocks_is_not_a_second_lookup():
    backend, dep = DictBackend(), deployment()
    sched = AioScheduler(dep, backend)
    req = decoded_for_a_while(sched)
    sched.build_connector_meta(step(preempted=["a"]))
    store(backend, dep, req, 4)
    n, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks([6, 7, 8, 9, 10]), n)
    meta = sched.build_connector_meta(step(cached=[("a", [6, 7, 8, 9, 10], 16, True)], scheduled={"a": 1}))
    assert [list(t.block_ids) for t in meta.loads] == [[6, 7, 8, 9]]
    assert (meta.lookups.hit_tokens, meta.lookups.miss_tokens) == (0, 0)


def test_saves_carry_the_retention_class_of_the_request_priority():
    dep = dataclasses.replace(deployment(), priority_cutoffs=(-1, 0))
    sched = AioScheduler(dep, DictBackend())
    for req_id, priority in (("urgent", -5), ("normal", 0), ("batch", 3)):
        req = Req(req_id, 8, priority=priority)
        sched.update_state_after_alloc(req, blocks([1, 2]), 0)
        meta = sched.build_connector_meta(step(new=[(req_id, [1, 2], 0)], scheduled={req_id: 8}))
        assert [t.retention for t in meta.saves] == [{"urgent": 2, "normal": 1, "batch": 0}[req_id]]


def test_role_without_save_plans_no_saves():
    sched = AioScheduler(deployment(save=False), DictBackend())
    req = Req("a", 16)
    sched.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 0)
    assert sched.build_connector_meta(step(new=[("a", [1, 2, 3, 4], 0)], scheduled={"a": 16})).saves == []


def test_finished_request_frees_its_blocks_at_once_and_is_forgotten():
    sched = AioScheduler(deployment(), DictBackend())
    req = Req("a", 16)
    sched.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 0)
    sched.build_connector_meta(step(new=[("a", [1, 2, 3, 4], 0)], scheduled={"a": 16}))
    assert sched.request_finished(req, [1, 2, 3, 4]) == (False, None)
    assert sched.build_connector_meta(step(finished=["a"])).saves == []


@pytest.mark.parametrize("computed", [0, 4])
def test_hit_tokens_never_exceed_the_prompt_minus_one(computed):
    backend, dep = DictBackend(), deployment()
    req = Req("a", 12)
    store(backend, dep, req, 3)
    n, _ = AioScheduler(dep, backend).get_num_new_matched_tokens(req, computed)
    assert computed + n == 11


def test_ranks_holding_identical_kv_share_one_shard():
    # One KV head over two TP ranks: both hold the same bytes, one key per block.
    backend, dep = DictBackend(), deployment(tp=2, heads=1)
    req = Req("a", 20)
    assert shards(dep) == ["pp0.dcp0.h0"]
    store(backend, dep, req, 5)
    assert AioScheduler(dep, backend).get_num_new_matched_tokens(req, 0) == (19, False)


def test_transfers_carry_the_request_position_of_their_first_block():
    sched = AioScheduler(deployment(), DictBackend())
    req = Req("a", 18)
    sched.update_state_after_alloc(req, blocks([7, 8, 9]), 0)
    sched.build_connector_meta(step(new=[("a", [7, 8, 9], 0)], scheduled={"a": 10}))
    meta = sched.build_connector_meta(step(cached=[("a", [10], 10, False)], scheduled={"a": 8}))
    assert meta.saves[0].first_index == 2


def test_layerwise_hit_needs_every_layer_of_a_block():
    backend, dep = DictBackend(), deployment(transfer_mode=TransferMode.LAYERWISE)
    req = Req("a", 20)
    for h in req.block_hashes[:4]:
        for layer in (0, 1):
            backend.keys.add(block_key(dep.namespace.digest(), "pp0.dcp0.h0", h, layer))
    backend.keys.remove(block_key(dep.namespace.digest(), "pp0.dcp0.h0", req.block_hashes[2], 1))
    assert AioScheduler(dep, backend).get_num_new_matched_tokens(req, 0) == (8, False)


def test_async_loads_are_announced_as_asynchronous():
    backend, dep = DictBackend(), deployment(transfer_mode=TransferMode.ASYNC)
    req = Req("a", 20)
    store(backend, dep, req, 4)
    assert AioScheduler(dep, backend).get_num_new_matched_tokens(req, 0) == (16, True)


def test_blocks_held_by_vllm_or_loaded_from_the_pool_are_not_saved_again():
    sched, _ = _allocated_hit(4)  # block 0 from vLLM's own cache
    meta = sched.build_connector_meta(step(new=[("a", [10, 11, 12, 13, 14, 15], 16)], scheduled={"a": 6}))
    assert [list(s.block_ids) for s in meta.saves] == [[14]]


def test_a_local_prefix_cache_hit_saves_only_the_blocks_the_step_computes():
    backend, dep = DictBackend(), deployment()
    req = Req("a", 22)
    sched = AioScheduler(dep, backend)
    assert sched.get_num_new_matched_tokens(req, 16) == (0, False)  # vLLM holds blocks 0-3
    sched.update_state_after_alloc(req, blocks([10, 11, 12, 13, 14, 15]), 0)
    meta = sched.build_connector_meta(step(new=[("a", [10, 11, 12, 13, 14, 15], 16)], scheduled={"a": 6}))
    assert [list(s.block_ids) for s in meta.saves] == [[14]]
    assert (meta.lookups.hit_tokens, meta.lookups.miss_tokens) == (0, 6)  # the local hit is neither


def test_a_resumed_request_saves_only_what_it_recomputes():
    sched = AioScheduler(deployment(), DictBackend())
    req = Req("a", 24)
    sched.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5, 6]), 0)
    sched.build_connector_meta(step(new=[("a", [1, 2, 3, 4, 5, 6], 0)], scheduled={"a": 8}))
    # Preempted, then resumed with its first two blocks held by vLLM's prefix cache.
    meta = sched.build_connector_meta(step(cached=[("a", [7, 8, 9, 10, 11, 12], 8, True)], scheduled={"a": 16}))
    assert [(list(s.block_ids), s.first_index) for s in meta.saves] == [([9, 10, 11, 12], 2)]


def test_a_save_names_the_blocks_loaded_in_its_step_that_its_request_reads():
    backend, dep = DictBackend(), deployment()
    a, b = Req("a", 22), Req("b", 14)
    store(backend, dep, a, 4)
    sched = AioScheduler(dep, backend)
    n, _ = sched.get_num_new_matched_tokens(a, 4)
    sched.update_state_after_alloc(a, blocks([10, 11, 12, 13, 14, 15]), n)
    sched.update_state_after_alloc(b, blocks([10, 11, 30, 31]), 0)  # b shares a's first blocks (prefix cache)
    meta = sched.build_connector_meta(step(new=[("a", [10, 11, 12, 13, 14, 15], 16), ("b", [10, 11, 30, 31], 8)],
                                           scheduled={"a": 6, "b": 6}))
    assert [(s.req_id, list(s.block_ids), list(s.reads)) for s in meta.saves] == [
        ("a", [14], [11, 12, 13]), ("b", [30], [11])]
    later = sched.build_connector_meta(step(cached=[("b", [32], 14, False)], scheduled={"b": 1}))
    assert later.loads == [] and all(len(s.reads) == 0 for s in later.saves)


def test_blocks_vllm_computes_again_after_a_failed_load_are_saved_again():
    sched, _ = _allocated_hit(0)
    first = sched.build_connector_meta(step(new=[("a", [10, 11, 12, 13, 14, 15], 16)], scheduled={"a": 6}))
    assert [list(s.block_ids) for s in first.saves] == [[14]]  # not stored: block 12 failed to load
    sched.update_connector_output({12})
    # vLLM recomputes from block 2, the first that failed.
    again = sched.build_connector_meta(step(cached=[("a", None, 8, False)], scheduled={"a": 14}))
    assert [list(s.block_ids) for s in again.saves] == [[12, 13, 14]]


def test_readmitted_request_is_not_counted_as_a_second_miss():
    sched = AioScheduler(deployment(), DictBackend())
    req = Req("a", 20)
    sched.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5]), 0)
    sched.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5]), 0)  # e.g. after its async load
    assert sched.build_connector_meta(step()).lookups.miss_tokens == 20


def test_buffer_step_loads_blocks_with_earlier_tokens_and_writes_back_every_block_written():
    sched = AioScheduler(deployment(transfer_mode=TransferMode.DYNAMIC_BUFFER, buffer_count=2), DictBackend())
    a, b = Req("a", 18), Req("b", 9)
    sched.update_state_after_alloc(a, blocks([7, 8, 9]), 0)
    sched.update_state_after_alloc(b, blocks([3, 4, 5]), 0)
    first = sched.build_connector_meta(step(new=[("a", [7, 8, 9], 0)], scheduled={"a": 10}))
    assert (first.buffer.resident, sorted(first.buffer.written)) == ([], [7, 8, 9])  # no prefix: nothing to load
    meta = sched.build_connector_meta(
        step(new=[("b", [3, 4, 5], 0)], cached=[("a", [10, 11], 10, False)], scheduled={"a": 8, "b": 9},
             zero=[5], copies=[SimpleNamespace(src_block_id=4, dst_block_id=6)])
    )
    # a: tokens 0..9 computed in blocks 7, 8 and half of 9; b and a's blocks 10, 11 are new.
    assert sorted(meta.buffer.resident) == [7, 8, 9]
    assert sorted(meta.buffer.written) == [3, 4, 5, 9, 10, 11]  # a: tokens 10..17, blocks 2-4 of 4 tokens
    assert (meta.buffer.zeroed, meta.buffer.copies) == ([5], [(4, 6)])


def test_buffer_step_of_a_decode_loads_its_context_up_to_the_new_token():
    sched = AioScheduler(deployment(transfer_mode=TransferMode.DYNAMIC_BUFFER, buffer_count=2), DictBackend())
    a = Req("a", 8)
    sched.update_state_after_alloc(a, blocks([7, 8]), 0)
    sched.build_connector_meta(step(new=[("a", [7, 8], 0)], scheduled={"a": 8}))
    # Token 8 starts block 2 (new): the two full blocks are loaded, only the new one written back.
    meta = sched.build_connector_meta(step(cached=[("a", [9], 8, False)], scheduled={"a": 1}))
    assert (sorted(meta.buffer.resident), meta.buffer.written) == ([7, 8], [9])
    # Token 9 lands in block 9, which now holds token 8: loaded and written back.
    meta = sched.build_connector_meta(step(cached=[("a", [], 9, False)], scheduled={"a": 1}))
    assert (sorted(meta.buffer.resident), meta.buffer.written) == ([7, 8, 9], [9])


def _resident_scheduler(slots: int = 4) -> AioScheduler:
    dep = dataclasses.replace(deployment(transfer_mode=TransferMode.DYNAMIC_BUFFER, buffer_count=2),
                              priority_cutoffs=(0,), resident_blocks=slots)
    return AioScheduler(dep, DictBackend())


def test_buffer_step_pins_the_highest_class_blocks_instead_of_loading_them():
    sched = _resident_scheduler()
    high, low = Req("high", 8, priority=0), Req("low", 8, priority=1)
    sched.update_state_after_alloc(high, blocks([7, 8]), 0)
    sched.update_state_after_alloc(low, blocks([3, 4]), 0)
    sched.build_connector_meta(step(new=[("high", [7, 8], 0), ("low", [3, 4], 0)], scheduled={"high": 8, "low": 8}))
    meta = sched.build_connector_meta(
        step(cached=[("high", [9], 8, False), ("low", [5], 8, False)], scheduled={"high": 1, "low": 1}))
    assert meta.buffer.pinned == [(7, 0), (8, 1), (9, 2)]
    assert sorted(meta.buffer.resident) == [3, 4]  # only the low-priority request streams
    assert sorted(meta.buffer.written) == [5, 9] and meta.buffer.promoted == []


def test_a_pinned_block_that_vllm_zeroes_or_copies_into_is_promoted_again():
    sched = _resident_scheduler()
    high = Req("high", 12, priority=0)
    sched.update_state_after_alloc(high, blocks([7, 8, 9]), 0)
    meta = sched.build_connector_meta(step(new=[("high", [7, 8, 9], 4)], scheduled={"high": 8},
                                           zero=[9], copies=[SimpleNamespace(src_block_id=2, dst_block_id=8)]))
    assert meta.buffer.promoted == [7, 8, 9]  # 7 holds the 4 computed tokens; 8 copied into, 9 zeroed


def test_residency_ends_when_the_request_finishes_or_is_preempted():
    sched = _resident_scheduler(slots=2)
    a, b, c = Req("a", 8, priority=0), Req("b", 8, priority=0), Req("c", 8, priority=0)
    for req, ids in ((a, [1, 2]), (b, [3, 4]), (c, [5, 6])):
        sched.update_state_after_alloc(req, blocks(ids), 0)
    meta = sched.build_connector_meta(step(new=[("a", [1, 2], 0), ("b", [3, 4], 0)], scheduled={"a": 8, "b": 8}))
    assert meta.buffer.pinned == [(1, 0), (2, 1)]  # b does not fit: it streams
    meta = sched.build_connector_meta(step(new=[("c", [5, 6], 0)], scheduled={"c": 8}, finished=["a"]))
    assert meta.buffer.pinned == [(5, 1), (6, 0)]
    meta = sched.build_connector_meta(step(cached=[("b", [], 8, False)], scheduled={"b": 1}, preempted=["c"]))
    assert meta.buffer.pinned == [(3, 0), (4, 1)] and meta.buffer.promoted == [3, 4]


def test_without_the_buffer_no_buffer_step_is_sent():
    sched = AioScheduler(deployment(), DictBackend())
    assert sched.build_connector_meta(step()).buffer is None


# ---- incremental lookups --------------------------------------------------------------


class EpochBackend(DictBackend):
    """A store with a presence epoch (as the embedded pool's eviction counter); records how many blocks each
    lookup asks."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0
        self.asked: list[int] = []

    def presence_epoch(self):
        return self.epoch

    def count_complete_blocks(self, parts, hashes):
        self.asked.append(len(hashes))
        return super().count_complete_blocks(parts, hashes)


def test_a_waiting_request_is_asked_again_only_from_the_first_block_not_found():
    backend, dep = EpochBackend(), deployment()
    req = Req("a", 22)  # 5 full blocks
    store(backend, dep, req, 3)
    sched = AioScheduler(dep, backend)
    assert sched.get_num_new_matched_tokens(req, 0) == (12, False)
    assert sched.get_num_new_matched_tokens(req, 0) == (12, False)
    store(backend, dep, req, 5)  # saved meanwhile by another request
    assert sched.get_num_new_matched_tokens(req, 0) == (20, False)
    assert sched.get_num_new_matched_tokens(req, 0) == (20, False)
    assert backend.asked == [5, 2, 2, 0]


def test_an_eviction_since_the_last_lookup_makes_the_next_one_start_over():
    backend, dep = EpochBackend(), deployment()
    req = Req("a", 22)
    store(backend, dep, req, 5)
    sched = AioScheduler(dep, backend)
    assert sched.get_num_new_matched_tokens(req, 0) == (20, False)
    backend.keys.remove(block_key(dep.namespace.digest(), "pp0.dcp0.h0", req.block_hashes[1]))
    backend.epoch += 1
    assert sched.get_num_new_matched_tokens(req, 0) == (4, False)
    assert backend.asked == [5, 5]


def test_a_store_without_an_epoch_is_asked_from_vllms_hit_every_time():
    backend, dep = DictBackend(), deployment()
    req = Req("a", 22)
    store(backend, dep, req, 5)
    sched = AioScheduler(dep, backend)
    asked = []
    count = backend.count_complete_blocks
    backend.count_complete_blocks = lambda parts, hashes: asked.append(len(hashes)) or count(parts, hashes)
    for _ in range(2):
        assert sched.get_num_new_matched_tokens(req, 4) == (16, False)
    assert asked == [4, 4]


def test_what_lookups_found_is_forgotten_once_the_request_is_admitted_or_finished():
    backend, dep = EpochBackend(), deployment()
    a, b = Req("a", 22), Req("b", 22)
    for req in (a, b):
        store(backend, dep, req, 5)
    sched = AioScheduler(dep, backend)
    n, _ = sched.get_num_new_matched_tokens(a, 0)
    sched.update_state_after_alloc(a, blocks([1, 2, 3, 4, 5, 6]), n)
    sched.get_num_new_matched_tokens(b, 0)
    sched.request_finished(b, [])
    sched.get_num_new_matched_tokens(a, 0)  # preempted and waiting again
    sched.get_num_new_matched_tokens(b, 0)  # a new request reusing the id
    assert backend.asked == [5, 5, 5, 5]


def test_a_lookup_from_beyond_what_was_found_asks_from_vllms_hit():
    backend, dep = EpochBackend(), deployment()
    req = Req("a", 22)
    store(backend, dep, req, 2)
    sched = AioScheduler(dep, backend)
    assert sched.get_num_new_matched_tokens(req, 0) == (8, False)
    store(backend, dep, req, 5)
    assert sched.get_num_new_matched_tokens(req, 12) == (8, False)  # vLLM now holds 3 blocks itself
    assert backend.asked == [5, 2]


# ---- the workers' KV cache layout (vLLM < 0.32) ------------------------------
def test_blocks_are_keyed_by_the_kv_layout_the_workers_report():
    # The scheduler's process builds no attention layer: before vLLM 0.32 it derived the default
    # layout where the workers' backend required another. Their stores are found under theirs.
    dep, backend = deployment(), DictBackend()
    workers = dataclasses.replace(dep, namespace=dataclasses.replace(dep.namespace, kv_layout="HND"))
    req = Req("a", 20)
    store(backend, workers, req, 4)
    sched = AioScheduler(dep, backend)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.take_worker_facts([WorkerFacts(kv_layout="HND"), WorkerFacts(kv_layout="HND")])
    assert sched.keying.namespace.kv_layout == "HND"
    assert sched.get_num_new_matched_tokens(req, 0) == (16, False)


def test_workers_reporting_no_layout_leave_the_derived_one():
    dep = deployment()
    sched = AioScheduler(dep, DictBackend())
    sched.take_worker_facts([])
    assert sched.keying.namespace == dep.namespace


def test_workers_reporting_different_layouts_stop_the_start_naming_both():
    sched = AioScheduler(deployment(), DictBackend())
    with pytest.raises(ConfigError, match="KV cache layouts differ \\(HND, NHD\\)"):
        sched.take_worker_facts([WorkerFacts(kv_layout="NHD"), WorkerFacts(kv_layout="HND")])
