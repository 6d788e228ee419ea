"""``PoolKeying``: the keys the scheduler half uses, and the runtime switch of the weight version."""

from __future__ import annotations

import dataclasses

from harness.scheduler_fakes import deployment

from vllm_aio.config import TransferMode
from vllm_aio.pool.ownership import Ownership
from vllm_aio.shared.deployment import CacheGroup
from vllm_aio.shared.keying import PoolKeying


def test_parts_name_every_shard_and_unit_of_the_deployment():
    dep = deployment(tp=2, transfer_mode=TransferMode.LAYERWISE)
    parts = PoolKeying(dep).parts
    assert parts.namespace_digest == dep.namespace.digest()
    assert parts.shards == tuple(Ownership(dep.topology()).all_shard_ids())
    assert parts.tags == (0, 1)


def test_a_weight_version_switch_rekeys_namespace_and_parts_together():
    dep = deployment()
    keying = PoolKeying(dep)
    keying.set_weight_version("v2")
    assert keying.namespace.weight_version == "v2"
    assert keying.parts.namespace_digest == keying.namespace.digest() != dep.namespace.digest()
    keying.set_weight_version(dep.namespace.weight_version)
    assert keying.parts.namespace_digest == dep.namespace.digest()


def test_a_model_of_one_group_keys_blocks_by_vllms_hash_alone():
    assert PoolKeying(deployment()).group_hashes([b"h0"], 0) == [b"h0"]


def test_each_group_of_a_hybrid_model_keys_its_blocks_apart():
    dep = dataclasses.replace(deployment(), groups=(CacheGroup(("l0",), window=8), CacheGroup(("l1",))))
    keying = PoolKeying(dep)
    assert keying.group_hashes([b"h0"], 0) != keying.group_hashes([b"h0"], 1)
