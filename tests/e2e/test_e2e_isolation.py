"""Instances that must not read each other's KV, on one named embedded pool.

Values are keyed by a namespace that digests everything changing the meaning
of the bytes (model, dtypes, block size, layout, parallel shape, salt), and
every value's header repeats it (``pool/entry.py``). Instances whose blocks have
another size cannot share a pool's fixed slots at all: the pool refuses them
at attach, naming ``local_pool_name`` (``tests/unit/test_host_pool.py``; that a
refusal at start stops the engine with its message: ``test_e2e_mooncake.py``).
The test holds the pool between the instances, as a long-lived host process
would (a pool is removed when its last process detaches).
"""

from __future__ import annotations

import uuid

import pytest

from harness.assertions import assert_same_generation
from harness.engines import aio_config, block_value_bytes
from harness.prompts import PROMPTS
from vllm_aio.pool.host_pool import SharedHostPool


@pytest.fixture
def held_pool(tiny_model):
    name = f"iso-{uuid.uuid4().hex[:8]}"
    holder = SharedHostPool(name, block_value_bytes(tiny_model), 4096)
    yield name, holder
    holder.close()


def test_instances_with_different_salts_on_one_named_pool_see_none_of_each_others_blocks(
    engine, baseline, held_pool
):
    name, holder = held_pool
    prompts = PROMPTS["warm"]
    engine.run([prompts], aio_config(local_pool_name=name, salt="tenant-a"))
    stored = holder.usage().num_ready
    assert stored == sum(len(p) // 32 for p in prompts)

    (other,) = engine.run([prompts], aio_config(local_pool_name=name, salt="tenant-b"))
    assert [r["cached"] for r in other] == [0] * len(prompts)
    assert engine.last_counters["hit_tokens"] == 0 and engine.last_counters["load_failures"] == 0
    assert holder.usage().num_ready == 2 * stored  # its own copy, under its own keys
    assert_same_generation(other, baseline["warm"])
