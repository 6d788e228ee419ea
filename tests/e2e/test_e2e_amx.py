"""End to end on real vLLM (CPU build): an instance whose first request comes from the pool.

Its first step computes one token (the rest is loaded). On a CPU with AMX,
vLLM's attention runs its AMX kernels for this bf16 model, and they use the
tiles without asking the kernel's permission; vLLM's own request (inside
oneDNN) comes only with a step of 5 or more tokens, so without the
connector's request at worker start this engine dies with SIGILL
(``docs/deployment.md``). Elsewhere the same run checks that the connector
says which kernels ran, and that nothing was asked where there is no AMX.
"""

from __future__ import annotations

import uuid

from harness.assertions import assert_same_generation
from harness.engines import aio_config, block_value_bytes
from harness.prerequisites import host_has_amx
from harness.prompts import make_prompts
from vllm_aio.pool.host_pool import SharedHostPool

PROMPT = make_prompts(81, [20 * 32 + 1])  # 20 full blocks and one token


def test_an_instance_whose_first_step_is_one_token_after_a_pool_hit_runs_and_says_which_kernels(engine, tiny_model):
    name = f"amx-{uuid.uuid4().hex[:8]}"
    holder = SharedHostPool(name, block_value_bytes(tiny_model), 64)  # the pool outlives the producer
    try:
        (stored,) = engine.run([PROMPT], aio_config("kv_producer", local_pool_name=name))
        (loaded,) = engine.run([PROMPT], aio_config("kv_consumer", local_pool_name=name))
    finally:
        holder.close()
    assert loaded[0]["cached"] == len(PROMPT[0]) - 1, "the first step should compute one token"
    assert_same_generation(loaded, stored)
    amx = host_has_amx()
    (worker,) = engine.last_workers
    assert worker["amx_tiles"] == amx, worker  # asked of the kernel in the worker process
    if amx:
        assert worker["attention"] == ["amx"], worker
    kernels = "/".join(worker["attention"])
    assert f"CPU attention kernels {kernels}; AMX tiles {'granted' if amx else 'absent'}" in engine.last_log
