"""End to end on real vLLM (CPU build): the tiered store, a named embedded pool per "node"
in front of a real Mooncake pool on loopback (``mooncake_fixtures.py``).

One test, three engines (and the suite's no-connector baseline), to stay cheap:
instance A computes; while it idles,
B (same host: A's named local pool) hits the local tier, C (another node: a
local pool of its own) hits the remote tier and, on its next pass, its own
local tier; then the master is killed and A's warm pass still hits locally.
"""

from __future__ import annotations

import threading
import uuid

from harness.assertions import assert_same_generation
from harness.engines import Engine, aio_config
from harness.prompts import PROMPTS

pytest_plugins = ["harness.mooncake_fixtures"]


def tiered(pool, node: str) -> dict:
    return aio_config(backend="tiered", remote_backend="mooncake", **pool.config,
                      local_pool_name=node, local_pool_size="256MB")


def assert_warm(results: list[dict], want: list[dict]) -> None:
    assert all(r["cached"] >= 0.8 * r["prompt_len"] for r in results), [r["cached"] for r in results]
    assert_same_generation(results, want)


def assert_loaded_every_hit(counters: dict) -> None:
    assert counters["failed_hit_tokens"] == 0 and counters["load_failures"] == 0, counters


def test_same_node_hits_locally_another_node_remotely_then_locally_and_a_dead_master_leaves_local_hits(
    engine, baseline, mooncake_pool_factory, tiny_model, tmp_path
):
    pool = mooncake_pool_factory("256MB")
    node = uuid.uuid4().hex[:8]
    prompts, fresh = PROMPTS["pd"], PROMPTS["pd_new"]
    seen: dict = {}

    def run(name: str, rounds: list, node_pool: str) -> None:
        other = Engine(tiny_model, tmp_path)
        try:
            seen[name] = other.run(rounds, tiered(pool, node_pool))
            seen[f"{name}_counters"] = other.last_counters
        except Exception as exc:  # C runs on a thread: its failure is asserted below
            seen[f"{name}_error"] = exc

    def while_a_idles(round_index: int) -> None:
        if round_index != 1:
            return
        # B and C start side by side (engine start dominates); A's background
        # writes reach the master while they start (tens of seconds).
        c = threading.Thread(target=run, args=("c", [prompts, prompts], f"c-{node}"))
        c.start()
        run("b", [prompts], f"a-{node}")
        c.join()
        pool.kill_master()

    cold, after_kill, new = engine.run([prompts, prompts, fresh], tiered(pool, f"a-{node}"),
                                       between_rounds=while_a_idles)
    assert all(r["cached"] == 0 for r in cold)
    assert_same_generation(cold, baseline["pd"])

    assert "b_error" not in seen and "c_error" not in seen, seen
    (b_pass,) = seen["b"]
    assert_warm(b_pass, baseline["pd"])  # B: A's node, its local tier
    b = seen["b_counters"]
    assert b["local_tier_hits"] > 0 and b["remote_tier_hits"] == 0, b
    assert_loaded_every_hit(b)

    remote_pass, local_pass = seen["c"]  # C: another node
    assert_warm(remote_pass, baseline["pd"])
    assert_warm(local_pass, baseline["pd"])
    c = seen["c_counters"]
    # Every value of the first pass came from the remote tier, was promoted, and the second pass read it locally.
    assert c["remote_tier_hits"] > 0 and c["local_tier_hits"] == c["remote_tier_hits"], c
    assert_loaded_every_hit(c)

    assert_warm(after_kill, baseline["pd"])  # A, master dead: its local tier serves
    assert_same_generation(new, baseline["pd_new"])  # computed; its remote writes are dropped
    a = engine.last_counters
    assert a["local_tier_hits"] > 0 and a["remote_tier_hits"] == 0, a
    assert_loaded_every_hit(a)
