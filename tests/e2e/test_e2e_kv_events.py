"""End to end on real vLLM (CPU build): the pool's blocks reach a KV-event subscriber.

The engine publishes vLLM's KV event batches (``kv_events_config``) over ZMQ to
a SUB socket this test binds on loopback (the publisher connects to a
``tcp://host:port`` endpoint), decoded as a router would, with msgspec.
One engine, three rounds: a prompt is stored (``BlockStored``, medium
``LOCAL_POOL``, one event per block, its tokens), a longer prompt fills the
small pool and evicts it (``BlockRemoved``), and a last round (no full block)
keeps the engine up until the test has seen the removal.
The events of a prompt's blocks travel with the engine's next steps: its
decode steps (``max_tokens``) carry them.
"""

from __future__ import annotations

import pytest

from harness.engines import aio_config
from harness.prompts import make_prompts
from harness.kv_event_subscriber import Subscriber, ours, removed_hashes, stored_hashes

BLOCK = 32
POOL_SLOTS = 8  # values of one block (the tiny model at TP=1 stores one per block)


def _value_bytes(model) -> int:
    import json

    from vllm_aio.pool.entry import HEADER_BYTES

    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return HEADER_BYTES + cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * BLOCK * 2


@pytest.fixture
def subscriber():
    sub = Subscriber()
    yield sub
    sub.close()


def test_pool_blocks_are_published_stored_then_removed_after_eviction(engine, subscriber, tiny_model):
    first, filler, last = make_prompts(11, [4 * BLOCK + 10, POOL_SLOTS * BLOCK + 10, 20])
    announced: list = []

    def between_rounds(i: int) -> None:
        if i == 1:  # the first prompt's four blocks are in the pool
            assert subscriber.wait_for(lambda ev: len(stored_hashes(ev)) >= 4), subscriber.events
            announced.extend(stored_hashes(subscriber.events))
        else:  # the filler's blocks are in the pool, and evicted the first prompt's
            def done(ev) -> bool:
                return len(stored_hashes(ev)) >= 4 + POOL_SLOTS and set(announced) <= removed_hashes(ev)

            assert subscriber.wait_for(done), subscriber.events

    config = aio_config(local_pool_size=POOL_SLOTS * _value_bytes(tiny_model))
    engine.run(
        [[first], [filler], [last]], config, between_rounds=between_rounds, max_tokens=8,
        kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": subscriber.endpoint},
    )
    stored = ours(subscriber.events, "BlockStored")
    first_stored = [e for e in stored if set(e.block_hashes) <= set(announced)]
    assert len(announced) == len(set(announced)) == 4, "one BlockStored per block"
    tokens = [t for e in first_stored for t in e.token_ids]
    assert tokens == first[: 4 * BLOCK]
    assert first_stored[0].parent_block_hash is None
    assert all(e.block_size == BLOCK and e.lora_name is None for e in stored)
    # Every filler block was announced once too (the pool holds POOL_SLOTS blocks).
    assert len(stored_hashes(subscriber.events)) == len(set(stored_hashes(subscriber.events))) == 4 + POOL_SLOTS
