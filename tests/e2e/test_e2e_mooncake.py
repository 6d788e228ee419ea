"""End to end on real vLLM (CPU build) with a real Mooncake pool on loopback:
``mooncake_master`` plus a memory-owning ``mooncake_client`` started by the
fixtures; every engine contributes no memory (``global_segment_size`` 0), so
the pool outlives the engines, as in production.

Warm passes in every transfer mode and TP=2 with one KV head (one copy stored
between the ranks) run with four requests per step in test_e2e_shared_prefix.py.
"""

from __future__ import annotations

import socket

import pytest

from harness.assertions import assert_same_generation
from harness.engines import aio_config
from harness.prompts import PROMPTS

pytest_plugins = ["harness.mooncake_fixtures"]


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
