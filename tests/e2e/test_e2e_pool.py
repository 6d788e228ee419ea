"""End to end on real vLLM (CPU build) with the embedded pool.

Each engine runs in a process of its own (see conftest.Engine). vLLM's own
prefix cache is off in every run, so a cached token can only come from the pool.
"""

from __future__ import annotations

import ctypes
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.assertions import assert_output_varies, assert_same_generation
from harness.engines import TP2, TRANSFER_MODES, Engine, LiveEngine, Round, aio_config, block_value_bytes
from harness.prerequisites import host_has_amx
from harness.prompts import PROMPTS


def _cached_fraction(result: dict) -> float:
    return result["cached"] / result["prompt_len"]



# A second pass served from the pool, in every transfer mode: see
# test_e2e_shared_prefix.py, which does it with four requests per step.


def test_model_output_varies(baseline):
    assert_output_varies(baseline["warm"])


def test_producer_stores_and_consumer_only_loads(engine, baseline, tiny_model):
    from vllm_aio.pool.host_pool import SharedHostPool

    name = f"pd-{uuid.uuid4().hex[:8]}"
    # The test holds the pool between the two instances, as a long-lived host would.
    holder = SharedHostPool(name, block_value_bytes(tiny_model), 4096)
    try:
        prompts, new = PROMPTS["pd"], PROMPTS["pd_new"]
        first, second = engine.run([prompts, prompts], aio_config("kv_producer", local_pool_name=name))
        assert all(r["cached"] == 0 for r in first + second), "a producer must not load"
        stored = holder.usage().num_ready
        assert stored == sum(len(p) // 32 for p in prompts)

        loaded, fresh = engine.run([prompts, new], aio_config("kv_consumer", local_pool_name=name))
        assert all(_cached_fraction(r) >= 0.8 for r in loaded), [r["cached"] for r in loaded]
        assert fresh[0]["cached"] == 0
        assert holder.usage().num_ready == stored, "a consumer must not store"
        assert_same_generation(loaded, baseline["pd"])
        assert_same_generation(fresh, baseline["pd_new"])
    finally:
        holder.close()


def test_pool_smaller_than_the_prompts_still_gives_baseline_output(engine, baseline):
    prompts = PROMPTS["small_pool"]
    # 1 MiB holds 16 blocks of 64 KiB; the prompts need about 100.
    cold, warm = engine.run([prompts, prompts], aio_config(local_pool_size="1MB"))
    assert_same_generation(cold, baseline["small_pool"])
    assert_same_generation(warm, baseline["small_pool"])


def _faulty(**extra) -> dict:
    return aio_config(module="harness.faulty_connector", connector="FaultyAioConnector", local_pool_size="256MB",
                      **extra)


@dataclass
class FaultyEngine:
    """One whole-blocks engine for the fault cases, each test's fault written to a file it reads at
    every call (``faulty_connector``) before the test's rounds, over prompts of the test's own."""

    live: LiveEngine
    fault_file: Path

    def cold_and_warm(self, fault: str, prompts: list[list[int]]) -> tuple[Round, Round]:
        self.fault_file.write_text(fault)
        return self.live.round(prompts), self.live.round(prompts)


@pytest.fixture(scope="module")
def faulty_engine(tiny_model, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("faults")
    live = Engine(tiny_model, workdir).start(_faulty(), env={"AIO_FAULT_FILE": str(workdir / "fault")})
    try:
        yield FaultyEngine(live, workdir / "fault")
        live.close()
    finally:
        live.kill()


def test_blocks_lost_or_torn_at_load_are_recomputed(faulty_engine, baseline):
    cold, warm = faulty_engine.cold_and_warm("lost_and_torn", PROMPTS["faults"])
    assert_same_generation(warm.results, baseline["faults"])
    assert "pool blocks could not be loaded (1 corrupt, 1 missing); vLLM recomputes them" in warm.log


@pytest.mark.parametrize("mode", ["layerwise", "async"])
def test_blocks_lost_or_torn_at_a_layerwise_or_background_load_are_recomputed(engine, baseline, mode):
    prompts = PROMPTS["faults"]
    cold, warm = engine.run([prompts, prompts], _faulty(**TRANSFER_MODES[mode]),
                            env={"AIO_FAULT": "lost_and_torn"})
    assert_same_generation(warm, baseline["faults"])
    assert "pool blocks could not be loaded (1 corrupt, 1 missing); vLLM recomputes them" in engine.last_log


def test_unreported_garbage_changes_the_output(faulty_engine, baseline):
    # Negative control: if a bad block were served silently, the suite would see it.
    cold, warm = faulty_engine.cold_and_warm("silent_garbage", PROMPTS["garbage"])
    assert_same_generation(cold.results, baseline["garbage"])
    with pytest.raises(AssertionError):
        assert_same_generation(warm.results, baseline["garbage"])


# Last of the engine's cases: a save failure is logged once per engine.
def test_pool_down_serves_every_request_by_recompute(faulty_engine, baseline):
    cold, warm = faulty_engine.cold_and_warm("pool_down", PROMPTS["down"])
    assert all(r["cached"] == 0 for r in cold.results + warm.results)
    assert_same_generation(warm.results, baseline["down"])
    log = cold.log + warm.log
    assert log.count("pool save failed") == 1
    assert "pool lookup failed, treating as a miss" in log


def test_kv_computed_over_a_block_that_failed_to_load_is_never_stored(engine, baseline, tiny_model):
    """A step over blocks that failed to load computes wrong KV for the rest of the prompt. vLLM
    recomputes the request's output, but had the pool kept that KV, a later request would load it
    once the failed blocks were readable again."""
    from vllm_aio.pool.entry import HEADER_BYTES
    from vllm_aio.pool.host_pool import SharedHostPool

    (prompt,) = PROMPTS["poison"]
    prefix = prompt[:640]  # 20 blocks: stored in round 1, refused in round 2, readable in round 3
    name = f"poison-{uuid.uuid4().hex[:8]}"
    holder = SharedHostPool(name, block_value_bytes(tiny_model), 4096)
    headers: dict[int, bytes] = {}

    def between_rounds(i: int) -> None:
        if i == 1:  # the prefix's 20 values, the pool's first slots, refused from now on
            deadline = time.monotonic() + 30
            while holder.usage().num_ready < 20 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert holder.usage().num_ready == 20
            for slot in range(20):
                headers[slot] = holder.read_headers([slot], HEADER_BYTES)[0]
                ctypes.memset(holder.slot_address(slot), 0xAB, HEADER_BYTES)
        else:
            for slot, header in headers.items():
                ctypes.memmove(holder.slot_address(slot), header, HEADER_BYTES)

    try:
        _, refused, readable = engine.run([[prefix], [prompt], [prompt]], aio_config(local_pool_name=name),
                                          between_rounds=between_rounds)
    finally:
        holder.close()
    assert "pool blocks could not be loaded (20 foreign)" in engine.last_log
    assert_same_generation(refused, baseline["poison"])
    assert readable[0]["cached"] == len(prompt) - 1  # every block from the pool
    assert_same_generation(readable, baseline["poison"])


def _tp2_run(model, workdir) -> int:
    """Cold then warm at TP=2 on a named pool; returns how many blocks it holds."""
    from vllm_aio.pool.host_pool import SharedHostPool

    engine = Engine(model, workdir)
    name = f"tp2-{uuid.uuid4().hex[:8]}"
    holder = SharedHostPool(name, block_value_bytes(model, tp=2), 4096)
    try:
        prompts = PROMPTS["tp2"]
        cold, warm = engine.run([prompts, prompts], aio_config(local_pool_name=name), **TP2)
        # Each rank's process asked for the AMX tiles its attention kernels use (test_e2e_amx.py).
        assert len({w["pid"] for w in engine.last_workers}) == 2
        assert all(w["amx_tiles"] == host_has_amx() for w in engine.last_workers), engine.last_workers
        assert all(_cached_fraction(r) >= 0.8 for r in warm), [r["cached"] for r in warm]
        assert_output_varies(cold)
        assert_same_generation(warm, cold)  # the cold pass as reference: see conftest
        return holder.usage().num_ready
    finally:
        holder.close()


def test_tensor_parallel_ranks_store_and_load_their_own_heads(tiny_model, tmp_path):
    # Each rank holds one of the model's two KV heads: a key without the rank
    # (vLLM's ExampleConnector's mistake at TP=2) would serve the wrong head.
    stored = _tp2_run(tiny_model, tmp_path)
    assert stored == 2 * sum(len(p) // 32 for p in PROMPTS["tp2"])


def test_ranks_holding_identical_kv_store_one_copy_between_them(tiny_1kv_model, tmp_path):
    # One KV head: both ranks hold the same bytes; each stores half the blocks.
    stored = _tp2_run(tiny_1kv_model, tmp_path)
    assert stored == sum(len(p) // 32 for p in PROMPTS["tp2"])
