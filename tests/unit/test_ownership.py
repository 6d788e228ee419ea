"""Property tests of block ownership over a grid of vLLM parallel layouts.

Every rank of a deployment is simulated in pure Python: each stores the blocks
its ``Ownership`` assigns it, and a lookup asks for every shard of
``all_shard_ids``. A layout is in the grid when vLLM 0.32 itself accepts it
(``_vllm_accepts``); the others are skipped by the property tests, since no
engine could start with them, and must be refused by ``Topology``.

What a rank holds is modelled independently of the module: its pipeline stage,
its DCP token shard (from DCP groups built the way vLLM's
``initialize_model_parallel`` builds them) and the set of KV heads it holds.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections import Counter, defaultdict
from collections.abc import Iterator

import pytest

from vllm_aio.pool.keys import block_key
from vllm_aio.pool.ownership import Ownership, Topology

TP_SIZES = (1, 2, 4, 8, 16)
KV_HEADS = (1, 2, 4, 8, 32)
CP_SIZES = (1, 2, 4)
PP_SIZES = (1, 2)
BLOCK_COUNTS = (0, 1, 2, 3, 5, 7, 13, 16, 31, 37)
DIGEST = "0123456789abcdef"

Layout = tuple[int, int, bool, int, int, int]  # tp, kv heads, mla, pcp, dcp, pp


def _vllm_accepts(tp: int, heads: int, mla: bool, pcp: int, dcp: int) -> bool:
    """vLLM 0.32's checks of a TP/PCP/DCP layout.

    ``ParallelConfig`` (vllm/config/parallel.py): without PCP, DCP reuses the TP
    ranks, so dcp_size divides tp_size; with PCP, DCP is 1, spans the PCP axis
    or spans TP x PCP. ``ModelConfig.verify_with_parallel_config``
    (vllm/config/model.py): for GQA/MQA (not MLA), DCP needs tp_size > KV heads
    and dcp_size <= tp_size // KV heads. Not modelled: its check that query
    heads per KV head divide by dcp_size (Topology never sees query heads; vLLM
    stops before any connector exists).
    """
    if pcp == 1 and tp % dcp:
        return False
    if pcp > 1 and dcp not in (1, pcp, tp * pcp):
        return False
    return mla or dcp == 1 or (tp > heads and dcp <= tp // heads)


def _layouts(valid: bool = True) -> Iterator[Layout]:
    grid = itertools.product(TP_SIZES, KV_HEADS, (False, True), CP_SIZES, CP_SIZES, PP_SIZES)
    for tp, heads, mla, pcp, dcp, pp in grid:
        if mla and heads != KV_HEADS[0]:
            continue  # MLA ignores num_kv_heads: one head count is enough
        if _vllm_accepts(tp, heads, mla, pcp, dcp) == valid:
            yield tp, heads, mla, pcp, dcp, pp


def _dcp_ranks(tp: int, pcp: int, dcp: int) -> dict[tuple[int, int], int]:
    """(tp_rank, pcp_rank) -> DCP rank, as vLLM builds its DCP groups: the stage's
    PCP x TP rank grid transposed to TP x PCP and cut into runs of dcp_size."""
    order = [(t, p) for t in range(tp) for p in range(pcp)]
    groups = [order[i : i + dcp] for i in range(0, len(order), dcp)]
    return {rank: group.index(rank) for group in groups for rank in group}


@functools.cache
def _ranks(layout: Layout) -> tuple[Ownership, ...]:
    """Every rank of the deployment, as the connector's workers build them."""
    tp, heads, mla, pcp, dcp, pp = layout
    dcp_rank = _dcp_ranks(tp, pcp, dcp)
    return tuple(
        Ownership(Topology(tp, t, heads, mla, pcp, p, dcp, dcp_rank[t, p], pp, s))
        for s in range(pp)
        for p in range(pcp)
        for t in range(tp)
    )


def _bytes_held(layout: Layout, own: Ownership) -> tuple[object, ...]:
    """What a rank holds, from first principles: stage, token shard, heads."""
    tp, heads, mla, pcp, dcp, _ = layout
    t = own.topology
    tokens = _dcp_ranks(tp, pcp, dcp)[t.tp_rank, t.pcp_rank]  # dcp 1: all tokens on every rank
    if mla:
        held: tuple[object, ...] = ("latent",)
    elif heads >= tp:
        per_rank = heads // tp
        held = tuple(range(t.tp_rank * per_rank, (t.tp_rank + 1) * per_rank))
    else:
        held = (t.tp_rank // (tp // heads),)
    return t.pp_rank, tokens, held


def _groups(layout: Layout) -> dict[str, list[Ownership]]:
    groups: dict[str, list[Ownership]] = defaultdict(list)
    for own in _ranks(layout):
        groups[own.shard_id].append(own)
    return groups


def _hashes(n: int) -> list[bytes]:
    return [i.to_bytes(4, "big") for i in range(n)]


def _stored_keys(ranks: tuple[Ownership, ...], hashes: list[bytes]) -> Counter[str]:
    """Every key every rank writes for a request with these block hashes."""
    return Counter(
        block_key(DIGEST, own.shard_id, hashes[i]) for own in ranks for i in own.owned_blocks(len(hashes))
    )


def _lookup_keys(own: Ownership, block_hash: bytes) -> list[str]:
    return [block_key(DIGEST, shard, block_hash) for shard in own.all_shard_ids()]


def test_grid_has_valid_and_invalid_layouts() -> None:
    assert len(list(_layouts())) > 100
    assert len(list(_layouts(valid=False))) > 50


@pytest.mark.parametrize(
    ("layout", "accepted"),
    [
        ((1, 1, True, 2, 2, 1), True),  # DCP spans the PCP axis of one TP rank
        ((2, 1, True, 2, 4, 1), True),  # DCP spans TP x PCP
        ((4, 1, False, 2, 2, 1), True),
        ((4, 1, True, 2, 4, 1), False),  # with PCP, DCP is 1, pcp or tp x pcp
        ((4, 1, False, 1, 8, 1), False),  # DCP does not divide TP
        ((4, 4, False, 1, 2, 1), False),  # GQA: TP must exceed the KV heads
        ((8, 2, False, 1, 8, 1), False),  # GQA: DCP at most TP // KV heads
        ((2, 1, False, 2, 4, 1), False),
    ],
)
def test_grid_follows_vllm_layout_rules(layout: Layout, accepted: bool) -> None:
    assert (layout in set(_layouts())) == accepted


def test_every_shard_block_is_stored_by_exactly_one_rank() -> None:
    for layout in _layouts():
        ranks = _ranks(layout)
        for n in BLOCK_COUNTS:
            stored = Counter((o.shard_id, i) for o in ranks for i in o.owned_blocks(n))
            assert set(stored.values()) <= {1}, (layout, n)


def test_stored_keys_equal_the_keys_a_lookup_requires() -> None:
    for layout in _layouts():
        ranks = _ranks(layout)
        for n in (0, 1, 7, 13):
            hashes = _hashes(n)
            stored = set(_stored_keys(ranks, hashes))
            for own in ranks:
                required = {key for h in hashes for key in _lookup_keys(own, h)}
                assert stored == required, (layout, n, own.topology)


def test_replicas_of_a_shard_store_balanced_block_counts() -> None:
    for layout in _layouts():
        for shard, group in _groups(layout).items():
            for n in BLOCK_COUNTS:
                counts = [len(o.owned_blocks(n)) for o in group]
                assert sum(counts) == n, (layout, shard, n)
                assert max(counts) - min(counts) <= 1, (layout, shard, n, counts)
                assert min(counts) == n // len(group), (layout, shard, n, counts)


def test_block_is_hit_exactly_when_every_shard_key_exists() -> None:
    rng = random.Random(5030)
    hashes = _hashes(13)
    hits = misses = 0
    for layout in _layouts():
        ranks = _ranks(layout)
        stored = set(_stored_keys(ranks, hashes))
        kept = {key for key in stored if rng.random() > 0.03}
        shards = {o.shard_id for o in ranks}
        for h in hashes:
            expected = all(block_key(DIGEST, s, h) in kept for s in shards)
            hits, misses = hits + expected, misses + (not expected)
            for own in ranks:
                assert all(key in kept for key in _lookup_keys(own, h)) == expected, (layout, h)
    assert hits > 100 and misses > 100


def test_all_shard_ids_are_sorted_identical_everywhere_and_cover_every_rank() -> None:
    for layout in _layouts():
        tp, heads, mla, _, dcp, pp = layout
        ranks = _ranks(layout)
        expected = sorted({o.shard_id for o in ranks})
        head_shards = 1 if mla else min(tp, heads)
        assert len(expected) == pp * dcp * head_shards, layout
        for own in ranks:
            assert own.all_shard_ids() == expected, (layout, own.topology)
            assert own.all_shard_ids() == expected, (layout, own.topology)


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
        tp, heads, mla, pcp, dcp, _ = layout
        rank_replication = (tp if mla else max(1, tp // heads)) * pcp // dcp
        for shard, group in _groups(layout).items():
            assert len(group) == rank_replication, (layout, shard)
            assert all(o.replicas == len(group) for o in group), (layout, shard)
            assert sorted(o.replica_index for o in group) == list(range(len(group)))


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
    assert [o.shard_id for o in ranks[:5]] == ["pp0.dcp0.h0", "pp0.dcp1.h0", "pp0.dcp0.h0", "pp0.dcp1.h0",
                                               "pp0.dcp0.h1"]
    assert [(o.replicas, o.replica_index) for o in ranks[:4]] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert ranks[0].read_order(range(6)) == [0, 1, 2, 3, 4, 5]
    assert ranks[2].read_order(range(6)) == [3, 4, 5, 0, 1, 2]


def test_pcp_ranks_without_dcp_are_replicas_of_one_shard() -> None:
    # vLLM 0.32: PCP without DCP gives every PCP rank a full copy of the KV cache.
    ranks = _ranks((2, 2, False, 2, 1, 1))  # ranks ordered pcp-major: (p0,t0) (p0,t1) (p1,t0) (p1,t1)
    assert [o.shard_id for o in ranks] == ["pp0.dcp0.h0", "pp0.dcp0.h1"] * 2
    assert [(o.replicas, o.replica_index) for o in ranks] == [(2, 0), (2, 0), (2, 1), (2, 1)]


def test_dcp_spanning_pcp_shards_tokens_by_pcp_rank() -> None:
    ranks = _ranks((2, 1, True, 2, 2, 1))
    assert [o.topology.dcp_rank for o in ranks] == [0, 0, 1, 1]
    assert [o.shard_id for o in ranks] == ["pp0.dcp0.h0", "pp0.dcp0.h0", "pp0.dcp1.h0", "pp0.dcp1.h0"]
    assert [o.replica_index for o in ranks] == [0, 1, 0, 1]


def test_dcp_spanning_tp_and_pcp_leaves_no_replicas() -> None:
    ranks = _ranks((2, 1, True, 2, 4, 1))
    assert sorted(o.shard_id for o in ranks) == [f"pp0.dcp{d}.h0" for d in range(4)]
    assert all(o.replicas == 1 for o in ranks)


def test_mla_counts_as_one_kv_head() -> None:
    ranks = _ranks((4, 32, True, 1, 1, 1))
    assert {o.shard_id for o in ranks} == {"pp0.dcp0.h0"}
    assert [o.replica_index for o in ranks] == [0, 1, 2, 3]


def test_topology_rejects_every_layout_vllm_rejects() -> None:
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
        ({"dcp_size": 2, "dcp_rank": 0, "tp_rank": 1}, r"must equal \(tp_rank \* pcp_size \+ pcp_rank\)"),
        ({"pcp_size": 2, "pcp_rank": 1, "dcp_size": 2, "dcp_rank": 0}, r"must equal \(tp_rank"),
        ({"dcp_size": 3}, "must divide tp_size"),
        ({"pcp_size": 2, "dcp_size": 4}, "must be 1, pcp_size or tp_size x pcp_size"),
        ({"num_kv_heads": 4, "dcp_size": 2}, r"exceeds tp_size // num_kv_heads"),
        ({"num_kv_heads": 0}, "num_kv_heads must be >= 1"),
        ({"num_kv_heads": 3}, "one must divide the other"),
    ],
)
def test_topology_rejects_bad_fields(kwargs: dict[str, int], message: str) -> None:
    fields = {"tp_size": 4, "tp_rank": 0, "num_kv_heads": 1, "use_mla": False} | kwargs
    with pytest.raises(ValueError, match=message):
        Topology(**fields)
