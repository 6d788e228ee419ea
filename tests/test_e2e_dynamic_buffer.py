"""End to end on real vLLM (CPU build): the dynamic layer buffer.

A six-layer model runs on two device layer buffers (``dynamic_buffer_layers:
2``). The reference is a normal run with exactly as many KV blocks
(``num_gpu_blocks_override``), so both engines schedule identically: same
chunked prefills, prefix-cache hits and preemptions. Every engine runs its
core in-process with four requests at a time, so batches do not depend on
timing.
"""

from __future__ import annotations

import re

import pytest

from conftest import Engine, aio_config, assert_same_generation, make_prompts

BLOCKS = 42  # the prompts take 40 blocks; decoding needs ~48: some requests are preempted
PROMPTS = make_prompts(seed=61, lengths=[310, 300, 305, 290])
# Round two repeats the last prompt: its blocks were freed last, so vLLM's
# prefix cache (42 blocks, LRU) or the pool still holds them.
ROUNDS = [PROMPTS, PROMPTS[3:]]
RUN = {
    "max_num_seqs": 4,
    "max_num_batched_tokens": 128,  # chunked prefill: every prompt takes several steps
    "enable_prefix_caching": True,
    "num_gpu_blocks_override": BLOCKS,
    "max_tokens": 48,
    "max_model_len": 400,
}
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _buffer(**extra) -> dict:
    return aio_config(dynamic_buffer_layers=2, **extra)


def _planned_blocks(log: str) -> int:
    """The block count vLLM planned from memory, before the override."""
    return int(re.search(r"Overriding num_gpu_blocks=(\d+)", log).group(1))


@pytest.fixture(scope="module")
def reference(tiny6_model, tmp_path_factory):
    engine = Engine(tiny6_model, tmp_path_factory.mktemp("reference"))
    rounds = engine.run(ROUNDS, env=IN_PROCESS, **RUN)
    return rounds, _planned_blocks(engine.last_log), engine.last_preemptions


def test_two_buffers_give_three_times_the_blocks_and_the_same_output(tiny6_model, tmp_path, reference):
    rounds, normal_blocks, normal_preemptions = reference
    engine = Engine(tiny6_model, tmp_path)
    first, second = engine.run(ROUNDS, _buffer(), env=IN_PROCESS, **RUN)
    # Same KV memory, 6 layers on 2 buffers: vLLM plans 3x the blocks.
    assert _planned_blocks(engine.last_log) >= 0.9 * 3 * normal_blocks
    assert engine.last_preemptions == normal_preemptions > 0
    assert second[0]["cached"] > 0, "the second round should hit vLLM's prefix cache"
    assert_same_generation(first, rounds[0])
    assert_same_generation(second, rounds[1])


def test_pool_hits_land_in_host_memory_and_stream_in(tiny6_model, tmp_path, reference):
    rounds, _, _ = reference
    engine = Engine(tiny6_model, tmp_path)
    run = {**RUN, "enable_prefix_caching": False}
    cold, warm = engine.run(ROUNDS, _buffer(local_pool_size="256MB"), env=IN_PROCESS, **run)
    assert all(r["cached"] >= 0.8 * r["prompt_len"] for r in warm), [r["cached"] for r in warm]
    assert_same_generation(cold, rounds[0])
    assert_same_generation(warm, rounds[1])


def test_a_layer_never_loaded_changes_the_output(tiny6_model, tmp_path, reference):
    # Negative control: the suite notices attention reading the wrong layer's KV.
    rounds, _, _ = reference
    engine = Engine(tiny6_model, tmp_path)
    config = _buffer()
    config.update(kv_connector="FaultyAioConnector", kv_connector_module_path="faulty_connector")
    (first,) = engine.run([PROMPTS], config, env={**IN_PROCESS, "AIO_FAULT": "skip_buffer_load"}, **RUN)
    with pytest.raises(AssertionError):
        assert_same_generation(first, rounds[0])
