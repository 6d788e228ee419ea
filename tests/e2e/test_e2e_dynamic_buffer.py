"""End to end on real vLLM (CPU build): the dynamic layer buffer.

A six-layer model runs on two device layer buffers (``transfer_mode:
dynamic_buffer``, ``dynamic_buffer_count: 2``) in KV memory that holds 15 blocks of all six layers: a normal engine fits
one of the four requests at a time, the buffered one plans 45 blocks and runs
them together. The reference is a normal run given as many blocks as the
buffered one (``num_gpu_blocks_override``), so both schedule identically: same
chunked prefills, prefix-cache hits and preemptions. Every engine runs its
core in-process with four requests at a time, so batches do not depend on
timing.
"""

from __future__ import annotations

import re
import uuid

import pytest

from harness.assertions import assert_same_generation
from harness.engines import FLOAT32, Engine, aio_config
from harness.prompts import make_prompts

PAGE = 6 * 32 << 10  # bytes of one block of all six layers (2 KV heads x 64 x 32 tokens, float32, K and V)
MEMORY = 15 * PAGE  # KV memory: 15 blocks normally, 45 with the buffer
BLOCKS = 45  # the prompts take 40 blocks, decoding ~48: some requests are preempted
PROMPTS = make_prompts(seed=61, lengths=[310, 300, 305, 290])
# Round two repeats the last prompt: its blocks were freed last, so vLLM's
# prefix cache (42 blocks, LRU) or the pool still holds them.
ROUNDS = [PROMPTS, PROMPTS[3:]]
RUN = {
    "max_num_seqs": 4,
    "max_num_batched_tokens": 128,  # chunked prefill: every prompt takes several steps
    "enable_prefix_caching": True,
    "kv_cache_memory_bytes": MEMORY,
    "max_tokens": 64,
    "max_model_len": 400,
    # float32: the buffered run attends over KV streamed and loaded back where the reference kept it;
    # in bf16 even the negative control's wrong layer moved logprobs no more than rounding does.
    **FLOAT32,
}
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _buffer(role: str = "kv_both", **extra) -> dict:
    return aio_config(role, transfer_mode="dynamic_buffer", dynamic_buffer_count=2, **extra)


def _normal_blocks(log: str) -> int:
    """The block count vLLM planned from memory, before the override."""
    return int(re.search(r"Overriding num_gpu_blocks=(\d+)", log).group(1))


def _buffer_blocks(log: str) -> int:
    return int(re.search(r"dynamic buffer: 6 layers on 2 device buffers, (\d+) blocks", log).group(1))


@pytest.fixture(scope="module")
def reference(tiny6_model, tmp_path_factory):
    engine = Engine(tiny6_model, tmp_path_factory.mktemp("reference"))
    rounds = engine.run(ROUNDS, env=IN_PROCESS, num_gpu_blocks_override=BLOCKS, **RUN)
    return rounds, _normal_blocks(engine.last_log), engine.last_preemptions


def test_two_buffers_give_three_times_the_blocks_and_the_same_output(tiny6_model, tmp_path, reference):
    rounds, normal_blocks, normal_preemptions = reference
    engine = Engine(tiny6_model, tmp_path)
    first, second = engine.run(ROUNDS, _buffer(), env=IN_PROCESS, **RUN)
    # Same KV memory, 6 layers on 2 buffers: vLLM plans 3x the blocks.
    assert _buffer_blocks(engine.last_log) == BLOCKS >= 0.9 * 3 * normal_blocks
    assert normal_blocks * 32 < 2 * 300, "without the buffer two requests would not fit at once"
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


def test_a_producer_stores_through_the_buffer_and_a_consumer_loads_through_it(tiny6_model, tmp_path, reference):
    from vllm_aio.pool.entry import HEADER_BYTES
    from vllm_aio.pool.host_pool import SharedHostPool

    rounds, _, _ = reference
    name = f"buffer-pd-{uuid.uuid4().hex[:8]}"
    holder = SharedHostPool(name, HEADER_BYTES + PAGE, 256)  # held between the two, as a long-lived host would
    try:
        engine = Engine(tiny6_model, tmp_path)
        run = {**RUN, "enable_prefix_caching": False}
        (stored,) = engine.run([PROMPTS], _buffer("kv_producer", local_pool_name=name), env=IN_PROCESS, **run)
        assert all(r["cached"] == 0 for r in stored), "a producer must not load"
        blocks = holder.usage().num_ready
        assert blocks >= sum(len(p) // 32 for p in PROMPTS)  # and what preempted requests had decoded
        (loaded,) = engine.run([PROMPTS], _buffer("kv_consumer", local_pool_name=name), env=IN_PROCESS, **run)
        assert all(r["cached"] >= 0.8 * r["prompt_len"] for r in loaded), [r["cached"] for r in loaded]
        assert holder.usage().num_ready == blocks, "a consumer must not store"
        assert_same_generation(stored, rounds[0])
        assert_same_generation(loaded, rounds[0])
    finally:
        holder.close()


def test_blocks_lost_or_torn_at_a_load_into_the_buffers_host_copy_are_recomputed(tiny6_model, tmp_path, reference):
    rounds, _, _ = reference
    engine = Engine(tiny6_model, tmp_path)
    config = _buffer(local_pool_size="256MB")
    config.update(kv_connector="FaultyAioConnector", kv_connector_module_path="harness.faulty_connector")
    cold, warm = engine.run(ROUNDS, config, env={**IN_PROCESS, "AIO_FAULT": "lost_and_torn"},
                            **{**RUN, "enable_prefix_caching": False})
    assert_same_generation(cold, rounds[0])
    assert_same_generation(warm, rounds[1])
    assert "pool blocks could not be loaded (1 corrupt, 1 missing); vLLM recomputes them" in engine.last_log


def test_a_layer_never_loaded_changes_the_output(tiny6_model, tmp_path, reference):
    # Negative control: the suite notices attention reading the wrong layer's KV.
    rounds, _, _ = reference
    engine = Engine(tiny6_model, tmp_path)
    config = _buffer()
    config.update(kv_connector="FaultyAioConnector", kv_connector_module_path="harness.faulty_connector")
    (first,) = engine.run([PROMPTS], config, env={**IN_PROCESS, "AIO_FAULT": "skip_buffer_load"}, **RUN)
    with pytest.raises(AssertionError):
        assert_same_generation(first, rounds[0])


# High-priority requests kept resident (dynamic_buffer_resident_blocks): 30 blocks of
# memory plan 90 per buffer; 3 layer passes x 14 private blocks leave vLLM 48.
RESIDENT_BLOCKS = 14
PRIORITY_RUN = {**RUN, "kv_cache_memory_bytes": 30 * PAGE, "scheduling_policy": "priority",
                # Round one: the first request is high priority (fits its 14 slots). Round two: it
                # again, from vLLM's prefix cache (its blocks promoted from host memory), beside a
                # low-priority request sharing every block of it (read from the private copy).
                "priorities": [[0, 1, 1, 1], [1, 0]]}
PRIORITY_ROUNDS = [PROMPTS, [PROMPTS[0], PROMPTS[0]]]


def test_high_priority_requests_stay_resident_with_the_same_output(tiny6_model, tmp_path):
    engine = Engine(tiny6_model, tmp_path)
    want = engine.run(PRIORITY_ROUNDS, env=IN_PROCESS, num_gpu_blocks_override=48, **PRIORITY_RUN)
    preemptions = engine.last_preemptions
    config = _buffer(dynamic_buffer_resident_blocks=RESIDENT_BLOCKS, priority_cutoffs=[0])
    got = engine.run(PRIORITY_ROUNDS, config, env=IN_PROCESS, **PRIORITY_RUN)
    assert _buffer_blocks(engine.last_log) == 48
    assert "42 private blocks per buffer" in engine.last_log
    assert re.search(r"first resident step: \d+ blocks kept on the device", engine.last_log)
    assert engine.last_preemptions == preemptions
    assert got[1][1]["cached"] > 0, "round two should hit vLLM's prefix cache"
    for g, w in zip(got, want):
        assert_same_generation(g, w)
