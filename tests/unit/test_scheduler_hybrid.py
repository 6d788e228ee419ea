"""The scheduler half with a hybrid model's KV cache groups: a sliding window
(group 0, 8 tokens = 2 blocks of 4) and full attention (group 1), as vLLM's
hybrid KV cache manager hands them over (block ids as one list per group)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from harness.scheduler_fakes import BS, DictBackend, Req, deployment, shards

from vllm_aio.config import TransferMode
from vllm_aio.connector.scheduler.scheduler import AioScheduler
from vllm_aio.pool.keys import block_key, group_block_hashes
from vllm_aio.shared.deployment import CacheGroup, Deployment

WINDOW = 8
SLIDING, FULL = 0, 1


def hybrid(**options) -> Deployment:
    groups = (CacheGroup(("l0", "l2"), WINDOW), CacheGroup(("l1", "l3")))
    return dataclasses.replace(deployment(**options), groups=groups, transfer_mode=TransferMode.ASYNC)


def store(backend: DictBackend, dep: Deployment, req: Req, group: int, indices) -> None:
    for i in indices:
        (key_hash,) = group_block_hashes([req.block_hashes[i]], group)
        backend.keys.update(block_key(dep.namespace.digest(), s, key_hash) for s in shards(dep))


def blocks(*groups):
    return SimpleNamespace(get_block_ids=lambda: tuple(list(g) for g in groups))


def step(new=(), cached=(), scheduled=None, preempted=()):
    """new=(req_id, block ids per group, num_computed); cached=(req_id, new ids per group or None, num_computed)."""
    return SimpleNamespace(
        finished_req_ids=set(),
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=b, num_computed_tokens=n) for r, b, n in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached], new_block_ids=[c[1] for c in cached],
            num_computed_tokens=[c[2] for c in cached], resumed_req_ids=set(),
        ),
        num_scheduled_tokens=scheduled or {},
        preempted_req_ids=set(preempted),
        new_block_ids_to_zero=None,
        kv_cache_block_copies=None,
    )


def transfers(meta_list) -> list[tuple[int, list[int], list[bytes]]]:
    return [(t.first_index, list(t.block_ids), t.block_hashes) for t in meta_list]


def test_a_hit_needs_every_full_attention_block_and_only_the_sliding_blocks_in_its_window():
    dep, backend = hybrid(), DictBackend()
    sched, req = AioScheduler(dep, backend), Req("r", 6 * BS + 1)
    store(backend, dep, req, FULL, range(6))
    store(backend, dep, req, SLIDING, [4, 5])  # the window of token 24: tokens 17..24
    assert sched.get_num_new_matched_tokens(req, 0) == (6 * BS, True)


def test_a_sliding_window_group_ends_the_hit_where_its_window_is_last_stored():
    dep, backend = hybrid(), DictBackend()
    sched, req = AioScheduler(dep, backend), Req("r", 6 * BS + 1)
    store(backend, dep, req, FULL, range(6))
    store(backend, dep, req, SLIDING, [0, 1, 2, 3])
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * BS, True)


def test_a_missing_full_attention_block_ends_the_hit_for_every_group():
    dep, backend = hybrid(), DictBackend()
    sched, req = AioScheduler(dep, backend), Req("r", 6 * BS + 1)
    store(backend, dep, req, FULL, [0, 1, 2])
    store(backend, dep, req, SLIDING, range(6))
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * BS, True)


def test_one_groups_blocks_never_count_for_another():
    dep, backend = hybrid(), DictBackend()
    sched, req = AioScheduler(dep, backend), Req("r", 6 * BS + 1)
    store(backend, dep, req, FULL, range(6))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)


def test_the_hit_loads_each_groups_blocks_and_never_a_null_block():
    dep, backend = hybrid(), DictBackend()
    sched, req = AioScheduler(dep, backend), Req("r", 6 * BS + 1)
    store(backend, dep, req, FULL, range(6))
    store(backend, dep, req, SLIDING, [4, 5])
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks([0, 0, 0, 0, 11, 12, 13], range(21, 28)), 6 * BS)
    meta = sched.build_connector_meta(step())
    assert transfers(meta.loads) == [
        (4, [11, 12], group_block_hashes(req.block_hashes[4:6], SLIDING)),
        (0, list(range(21, 27)), group_block_hashes(req.block_hashes[:6], FULL)),
    ]


def test_after_a_local_hit_every_group_saves_only_the_blocks_the_step_computes():
    # vLLM's own hit of 4 blocks (the sliding window's first 2 are null, id 0): blocks 4 and 5 are new.
    dep, backend = hybrid(), DictBackend()
    sched, req = AioScheduler(dep, backend), Req("r", 6 * BS)
    sched.update_state_after_alloc(req, blocks([0, 0, 3, 4, 5, 6], range(11, 17)), 0)
    meta = sched.build_connector_meta(step(new=[("r", ([0, 0, 3, 4, 5, 6], list(range(11, 17))), 4 * BS)],
                                           scheduled={"r": 2 * BS}))
    assert [(t.first_index, list(t.block_ids)) for t in meta.saves] == [(4, [5, 6]), (4, [15, 16])]


def test_a_preempted_requests_rescue_skips_sliding_blocks_freed_before_its_last_step():
    dep, backend = hybrid(), DictBackend()
    sched, req = AioScheduler(dep, backend), Req("r", 4 * BS, num_output_tokens=4 * BS)
    sched.update_state_after_alloc(req, blocks(range(1, 9), range(11, 19)), 0)
    sched.build_connector_meta(step(new=[("r", (list(range(1, 9)), list(range(11, 19))), 0)],
                                    scheduled={"r": 4 * BS}))
    sched.build_connector_meta(step(cached=[("r", None, 30)], scheduled={"r": 1}))
    meta = sched.build_connector_meta(step(preempted=["r"]))
    # 31 tokens computed: 7 full blocks. The window of token 30 starts at token 23 (block 5).
    assert [(t.first_index, list(t.block_ids)) for t in meta.rescues] == [(5, [6, 7]), (4, [15, 16, 17])]


def test_a_request_whose_load_failed_whole_is_counted_once_and_recomputed_without_the_pool():
    dep, backend = hybrid(), DictBackend()
    sched, req = AioScheduler(dep, backend), Req("r", 6 * BS + 1)
    store(backend, dep, req, FULL, range(6))
    store(backend, dep, req, SLIDING, range(6))
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks([0, 0, 0, 0, 11, 12, 13], range(21, 28)), 6 * BS)
    sched.build_connector_meta(step())
    sched.update_connector_output(set(), {"r"})
    sched.update_connector_output(set(), {"r"})
    assert sched.build_connector_meta(step()).lookups.failed_hit_tokens == 6 * BS
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.request_finished(req, ([], []))
    assert sched.get_num_new_matched_tokens(req, 0) == (6 * BS, True)
