"""End to end with multi-head latent attention (a tiny DeepSeek-V2) at TP=2 on
the embedded pool. MLA caches one latent per token that every TP rank holds
identically, so the ranks must store a single copy between them.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from harness.assertions import assert_output_varies, assert_same_generation
from harness.engines import MLA, TP2, Engine, aio_config
from harness.prompts import PROMPTS
from vllm_aio.pool.entry import HEADER_BYTES

# A warm MLA request computes its last few prompt tokens through CPU_MLA's
# context path (the cached latent expanded, attention states merged) instead
# of one causal prefill: the loaded bytes are the cold run's, but the new
# tokens' latents round differently. Measured: warm logprobs within 0.09 of
# the cold run's (which is bit-exact with a no-connector run), tokens equal.
MLA_LOGPROB_TOLERANCE = 0.15


def _value_bytes(model: Path) -> int:
    """One stored value: the entry header, then a block of the latent (bf16) for every layer."""
    cfg = json.loads((model / "config.json").read_text())
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    return HEADER_BYTES + cfg["num_hidden_layers"] * MLA["block_size"] * latent * 2


def _keys_per_process(record_dir: Path) -> list[set[str]]:
    """What each process stored, as tests/harness/recording_connector.py wrote it."""
    return [set(path.read_text().split()) for path in sorted(record_dir.iterdir())]


def test_mla_ranks_store_one_copy_of_the_latent_half_each(tiny_mla_model, tmp_path):
    from vllm_aio.pool.host_pool import SharedHostPool

    prompts, name = PROMPTS["tp2"], f"mla-{uuid.uuid4().hex[:8]}"
    record_dir = tmp_path / "stored"
    record_dir.mkdir()
    config = aio_config(module="harness.recording_connector", connector="RecordingAioConnector", local_pool_name=name)
    env = {**TP2["env"], "AIO_RECORD_DIR": str(record_dir)}
    holder = SharedHostPool(name, _value_bytes(tiny_mla_model), 4096)
    try:
        cold, warm = Engine(tiny_mla_model, tmp_path).run(
            [prompts, prompts], config, env=env, tensor_parallel_size=2, **MLA
        )
        stored = holder.usage().num_ready
    finally:
        holder.close()
    blocks = sum(len(p) // MLA["block_size"] for p in prompts)
    assert stored == blocks
    rank_keys = _keys_per_process(record_dir)
    assert len(rank_keys) == 2 and not rank_keys[0] & rank_keys[1]
    # Each prompt's blocks alternate between the ranks: at most one more each.
    assert abs(len(rank_keys[0]) - len(rank_keys[1])) <= len(prompts), [len(k) for k in rank_keys]
    assert all(r["cached"] >= 0.8 * r["prompt_len"] for r in warm), [r["cached"] for r in warm]
    assert_output_varies(cold)
    assert_same_generation(warm, cold, MLA_LOGPROB_TOLERANCE)  # the cold pass as reference: see conftest
