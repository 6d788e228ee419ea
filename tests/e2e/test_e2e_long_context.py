"""The longest prompt the tiny model allows, fully cached in the embedded pool, on real vLLM (CPU build).

Layerwise, so a block is stored as one value per layer: a warm pass must load
every part of every block, and a part evicted after the lookup said the block
was complete must be recomputed (``faulty_connector``'s ``evict_after_lookup``
evicts the pool's least recently used value for real, from the scheduler's
process, right after its lookup). A 128k-token prompt is tested the same way
without vLLM, over a fake forward (``test_long_prompt.py``).
"""

from __future__ import annotations

import json

from harness.assertions import assert_output_varies, assert_same_generation
from harness.engines import aio_config
from harness.prompts import make_prompts
from vllm_aio.pool.entry import HEADER_BYTES

MAX_MODEL_LEN = 8192  # the tiny model's max_position_embeddings
BLOCK = 32
PROMPT = make_prompts(7, [MAX_MODEL_LEN - 16])[0]
# Greedy tokens of a warm pass (the prompt's last token computed over loaded KV)
# match a cold one's to within LOGPROB_TOLERANCE; the 16th sits on a near tie.
MAX_TOKENS = 8
FULL_BLOCKS = len(PROMPT) // BLOCK
LONG = {"max_model_len": MAX_MODEL_LEN, "max_tokens": MAX_TOKENS}


def layer_value_bytes(model) -> int:
    """One stored part: header + one layer of one block (bf16, every KV head)."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return HEADER_BYTES + 2 * cfg["num_key_value_heads"] * head_dim * BLOCK * 2


def test_a_fully_cached_longest_prompt_loads_every_part_and_a_part_evicted_after_lookup_is_recomputed(
    engine, tiny_model
):
    config = aio_config(module="harness.faulty_connector", connector="FaultyAioConnector", local_pool_size="64MB",
                        transfer_mode="layerwise")
    cold, warm, evicted = engine.run([[PROMPT]] * 3, config, env={"AIO_FAULT": "evict_after_lookup"}, **LONG)
    assert (cold[0]["cached"], warm[0]["cached"]) == (0, FULL_BLOCKS * BLOCK)
    assert_output_varies(cold)
    for result in (warm, evicted):  # the cold pass as reference: see conftest
        assert_same_generation(result, cold)
    layers = json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]
    counters = engine.last_counters
    # Warm: every layer of every block; evicted: all of them but one part, whose block vLLM recomputed.
    assert counters["load_bytes"] == (2 * FULL_BLOCKS * layers - 1) * layer_value_bytes(tiny_model), counters
    assert counters["load_failures"] == 1, counters
    assert 0 < counters["failed_hit_tokens"] <= FULL_BLOCKS * BLOCK, counters  # from the evicted part's block on
    assert "1 pool blocks could not be loaded (1 missing); vLLM recomputes them" in engine.last_log
