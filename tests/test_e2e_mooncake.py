"""End to end on real vLLM (CPU build) with a real Mooncake pool on loopback:
``mooncake_master`` plus a memory-owning ``mooncake_client`` started by the
fixtures; every engine contributes no memory (``global_segment_size`` 0), so
the pool outlives the engines, as in production.
"""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest

from conftest import PROMPTS, TP2, Engine, aio_config, assert_same_generation
from vllm_aio.pool.entry import HEADER_BYTES

pytest_plugins = ["mooncake_fixtures"]


def mooncake(role: str, pool) -> dict:
    return aio_config(role, backend="mooncake", **pool.config)


def _cached_fraction(result: dict) -> float:
    return result["cached"] / result["prompt_len"]


def test_producer_stores_and_consumer_loads_through_mooncake(engine, baseline, mooncake_pool_factory):
    pool = mooncake_pool_factory("512MB")
    (produced,) = engine.run([PROMPTS["pd"]], mooncake("kv_producer", pool))
    assert all(r["cached"] == 0 for r in produced)
    (consumed,) = engine.run([PROMPTS["pd"]], mooncake("kv_consumer", pool))
    assert all(_cached_fraction(r) >= 0.8 for r in consumed), [r["cached"] for r in consumed]
    assert_same_generation(consumed, baseline["pd"])


def test_second_instance_hits_what_the_first_computed(engine, baseline, mooncake_pool_factory):
    pool = mooncake_pool_factory("512MB")
    engine.run([PROMPTS["warm"]], mooncake("kv_both", pool))
    (second,) = engine.run([PROMPTS["warm"]], mooncake("kv_both", pool))
    assert all(_cached_fraction(r) >= 0.8 for r in second), [r["cached"] for r in second]
    assert_same_generation(second, baseline["warm"])


def test_layerwise_values_round_trip_through_mooncake(engine, baseline, mooncake_pool_factory):
    pool = mooncake_pool_factory("512MB")
    config = mooncake("kv_both", pool)
    config["kv_connector_extra_config"]["use_layerwise"] = True
    _, second = engine.run([PROMPTS["warm"], PROMPTS["warm"]], config)
    assert all(_cached_fraction(r) >= 0.8 for r in second), [r["cached"] for r in second]
    assert_same_generation(second, baseline["warm"])


def test_master_killed_mid_run_every_request_completes_correctly(engine, baseline, mooncake_pool_factory):
    pool = mooncake_pool_factory("512MB")
    rounds = [PROMPTS["faults"], PROMPTS["faults"], PROMPTS["pd_new"]]
    _, after_kill, fresh = engine.run(
        rounds, mooncake("kv_both", pool), between_rounds=lambda i: i == 1 and pool.kill_master()
    )
    assert_same_generation(after_kill, baseline["faults"])
    assert_same_generation(fresh, baseline["pd_new"])
    assert engine.last_log.count("pool save failed (error") == 1


def test_unreachable_master_stops_the_engine_with_an_error_naming_it(engine):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    config = aio_config(backend="mooncake", master_server_address=address)
    with pytest.raises(AssertionError, match="engine failed"):
        engine.run([PROMPTS["pd_new"]], config, timeout=120)
    assert f"Mooncake master at {address} is unreachable" in engine.last_log


def _pool_contents(pool) -> tuple[int, int]:
    """(keys, bytes) the master holds, from its Prometheus endpoint on the metrics port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{pool.metrics_port}/metrics", timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    values = dict(line.split() for line in lines if line.startswith(("master_key_count ", "master_allocated_bytes ")))
    return int(values["master_key_count"]), int(values["master_allocated_bytes"])


def _one_kv_head_block_bytes(model) -> int:
    """K and V of the model's single KV head, every layer, one 32-token block (bf16)."""
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["num_key_value_heads"] == 1
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * head_dim * 32 * 2


def test_tensor_parallel_ranks_holding_identical_kv_store_one_copy_in_mooncake(
    tiny_1kv_model, tmp_path, tp2_baseline, mooncake_pool_factory
):
    pool = mooncake_pool_factory("512MB")
    prompts = PROMPTS["tp2"]
    cold, warm = Engine(tiny_1kv_model, tmp_path).run([prompts, prompts], mooncake("kv_both", pool), **TP2)
    assert all(_cached_fraction(r) >= 0.8 for r in warm), [r["cached"] for r in warm]
    assert_same_generation(cold, tp2_baseline(tiny_1kv_model))
    assert_same_generation(warm, tp2_baseline(tiny_1kv_model))
    blocks = sum(len(p) // 32 for p in prompts)
    # Every value is the entry header followed by the block's bytes.
    assert _pool_contents(pool) == (blocks, blocks * (HEADER_BYTES + _one_kv_head_block_bytes(tiny_1kv_model)))
