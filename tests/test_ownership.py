"""Property tests of block ownership over a grid of vLLM parallel layouts.

A layout is valid when it passes vLLM's own checks: dcp_size divides tp_size
and does not exceed the KV head replication factor (max(1, tp_size //
num_kv_heads) for GQA, tp_size for MLA). Every other combination is rejected.
The expected bytes of a rank are modelled independently of the module: the
set of KV heads it holds, its DCP and PCP token shard, and its PP stage.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter, defaultdict
from collections.abc import Iterator

import pytest

from vllm_aio.pool.ownership import Ownership, Topology

TP_SIZES = (1, 2, 4, 8, 16)
KV_HEADS = (1, 2, 4, 8, 32)
CP_SIZES = (1, 2, 4)
PP_SIZES = (1, 2)
BLOCK_COUNTS = (0, 1, 2, 3, 7, 16, 33)

Layout = tuple[int, int, bool, int, int, int]  # tp, kv heads, mla, pcp, dcp, pp


def _head_replication(tp: int, heads: int, mla: bool) -> int:
    return tp if mla else max(1, tp // heads)


def _layouts(valid: bool = True) -> Iterator[Layout]:
    grid = itertools.product(TP_SIZES, KV_HEADS, (False, True), CP_SIZES, CP_SIZES, PP_SIZES)
    for tp, heads, mla, pcp, dcp, pp in grid:
        if mla and heads != KV_HEADS[0]:
            continue  # MLA ignores num_kv_heads: one head count is enough
        ok = tp % dcp == 0 and dcp <= _head_replication(tp, heads, mla)
        if ok == valid:
            yield tp, heads, mla, pcp, dcp, pp


def _ranks(layout: Layout) -> list[Ownership]:
    tp, heads, mla, pcp, dcp, pp = layout
    return [
        Ownership(Topology(tp, t, heads, mla, pcp, p, dcp, t % dcp, pp, s))
        for s in range(pp)
        for p in range(pcp)
        for t in range(tp)
    ]


def _bytes_held(layout: Layout, own: Ownership) -> tuple[object, ...]:
    """What a rank holds, from first principles: stage, token shards, heads."""
    tp, heads, mla, _, dcp, _ = layout
    t = own.topology
    if mla:
        held: tuple[object, ...] = ("latent",)
    elif heads >= tp:
        per_rank = heads // tp
        held = tuple(range(t.tp_rank * per_rank, (t.tp_rank + 1) * per_rank))
    else:
        held = (t.tp_rank // (tp // heads),)
    return t.pp_rank, t.pcp_rank, t.tp_rank % dcp, held


def _groups(layout: Layout) -> dict[str, list[Ownership]]:
    groups: dict[str, list[Ownership]] = defaultdict(list)
    for own in _ranks(layout):
        groups[own.shard_id].append(own)
    return groups


def test_grid_has_valid_and_invalid_layouts() -> None:
    assert len(list(_layouts())) > 100
    assert len(list(_layouts(valid=False))) > 50


def test_every_shard_block_is_stored_by_exactly_one_rank() -> None:
    for layout in _layouts():
        ranks = _ranks(layout)
        for n in BLOCK_COUNTS:
            stored = Counter((o.shard_id, i) for o in ranks for i in o.owned_blocks(n))
            assert set(stored.values()) <= {1}, (layout, n)


def test_stored_union_equals_what_a_lookup_requires() -> None:
    for layout in _layouts():
        ranks = _ranks(layout)
        for n in BLOCK_COUNTS:
            stored = {(o.shard_id, i) for o in ranks for i in o.owned_blocks(n)}
            for own in ranks:
                required = set(itertools.product(own.hit_shard_ids(), range(n)))
                assert stored == required, (layout, n, own.topology)


def test_block_is_hit_exactly_when_every_shard_key_exists() -> None:
    rng = random.Random(5030)
    n, hits, misses = 16, 0, 0
    for layout in _layouts():
        ranks = _ranks(layout)
        shards = {o.shard_id for o in ranks}
        full = [(o.shard_id, i) for o in ranks for i in o.owned_blocks(n)]
        store = {key for key in full if rng.random() > 0.02}
        for i in range(n):
            expected = all((s, i) in store for s in shards)
            hits, misses = hits + expected, misses + (not expected)
            for own in ranks:
                assert all((s, i) in store for s in own.hit_shard_ids()) == expected, (layout, i)
    assert hits > 100 and misses > 100


def test_all_shard_ids_are_sorted_identical_everywhere_and_cover_every_rank() -> None:
    for layout in _layouts():
        tp, heads, mla, pcp, dcp, pp = layout
        ranks = _ranks(layout)
        expected = sorted({o.shard_id for o in ranks})
        head_shards = tp // _head_replication(tp, heads, mla)
        assert len(expected) == pp * pcp * dcp * head_shards, layout
        for own in ranks:
            assert own.all_shard_ids() == expected, (layout, own.topology)
            assert own.hit_shard_ids() == expected, (layout, own.topology)


def test_shard_id_is_shared_exactly_by_ranks_holding_identical_bytes() -> None:
    for layout in _layouts():
        by_bytes: dict[tuple[object, ...], set[str]] = defaultdict(set)
        by_shard: dict[str, set[tuple[object, ...]]] = defaultdict(set)
        for own in _ranks(layout):
            by_bytes[_bytes_held(layout, own)].add(own.shard_id)
            by_shard[own.shard_id].add(_bytes_held(layout, own))
        assert all(len(ids) == 1 for ids in by_bytes.values()), layout
        assert all(len(held) == 1 for held in by_shard.values()), layout


def test_replicas_and_replica_index_enumerate_each_shard_group() -> None:
    for layout in _layouts():
        tp, heads, mla, _, dcp, _ = layout
        for shard, group in _groups(layout).items():
            assert len(group) == _head_replication(tp, heads, mla) // dcp, (layout, shard)
            assert all(o.replicas == len(group) for o in group), (layout, shard)
            assert sorted(o.replica_index for o in group) == list(range(len(group)))


def test_each_replica_stores_floor_or_ceil_of_its_share() -> None:
    for layout in _layouts():
        for own in _ranks(layout):
            for n in BLOCK_COUNTS:
                count = len(own.owned_blocks(n))
                assert count in (n // own.replicas, -(-n // own.replicas)), (layout, n)


def test_owned_blocks_of_a_range_match_stores() -> None:
    own = Ownership(Topology(8, 6, 2, False, dcp_size=2, dcp_rank=0))
    assert own.replicas == 2 and own.replica_index == 1
    assert own.owned_blocks(range(5, 12)) == [5, 7, 9, 11]
    assert own.owned_blocks(6) == [i for i in range(6) if own.stores(i)] == [1, 3, 5]


def test_read_order_is_a_rotation_that_differs_between_replicas() -> None:
    for layout in _layouts():
        for group in _groups(layout).values():
            for n in BLOCK_COUNTS:
                blocks = list(range(10, 10 + n))
                orders = [o.read_order(blocks) for o in group]
                rotations = [blocks[k:] + blocks[:k] for k in range(max(1, n))]
                assert all(order in rotations for order in orders), (layout, n)
                distinct = {tuple(order) for order in orders}
                assert len(distinct) == max(1, min(n, len(group))), (layout, n)


def test_example_tp8_two_kv_heads_dcp2_names_and_replicas() -> None:
    ranks = _ranks((8, 2, False, 1, 2, 1))
    assert [o.shard_id for o in ranks[:5]] == [
        "pp0.pcp0.dcp0.h0",
        "pp0.pcp0.dcp1.h0",
        "pp0.pcp0.dcp0.h0",
        "pp0.pcp0.dcp1.h0",
        "pp0.pcp0.dcp0.h1",
    ]
    assert [(o.replicas, o.replica_index) for o in ranks[:4]] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert ranks[0].read_order(range(6)) == [0, 1, 2, 3, 4, 5]
    assert ranks[2].read_order(range(6)) == [3, 4, 5, 0, 1, 2]


def test_mla_counts_as_one_kv_head() -> None:
    ranks = _ranks((4, 32, True, 1, 1, 1))
    assert {o.shard_id for o in ranks} == {"pp0.pcp0.dcp0.h0"}
    assert [o.replica_index for o in ranks] == [0, 1, 2, 3]


def test_topology_rejects_every_invalid_dcp_layout() -> None:
    for tp, heads, mla, pcp, dcp, pp in _layouts(valid=False):
        with pytest.raises(ValueError, match="dcp_size"):
            Topology(tp, 0, heads, mla, pcp, 0, dcp, 0, pp, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_rank": 4}, "tp_rank=4 out of range"),
        ({"tp_size": 0}, "tp_size must be >= 1"),
        ({"pcp_size": 2, "pcp_rank": -1}, "pcp_rank=-1 out of range"),
        ({"pp_size": 2, "pp_rank": 2}, "pp_rank=2 out of range"),
        ({"dcp_size": 2, "dcp_rank": 0, "tp_rank": 1}, "must equal tp_rank % dcp_size"),
        ({"dcp_size": 3}, "must divide tp_size"),
        ({"num_kv_heads": 0}, "num_kv_heads must be >= 1"),
        ({"num_kv_heads": 3}, "one must divide the other"),
    ],
)
def test_topology_rejects_bad_fields(kwargs: dict[str, int], message: str) -> None:
    fields = {"tp_size": 4, "tp_rank": 0, "num_kv_heads": 1, "use_mla": False} | kwargs
    with pytest.raises(ValueError, match=message):
        Topology(**fields)
