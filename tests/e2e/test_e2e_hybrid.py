"""End to end with hybrid attention on real vLLM (CPU build) and the embedded pool.

The tiny models alternate sliding-window (64 tokens) and full-attention layers,
so vLLM's hybrid KV cache manager (on, since ``AioConnector`` is a
``SupportsHMA``) makes two KV cache groups and frees each prompt's sliding-window
blocks as the window passes them. Prompts are several windows long. vLLM's own
prefix cache is off, so a cached token can only come from the pool.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.assertions import assert_output_varies, assert_same_generation
from harness.engines import Engine, aio_config
from harness.preemption import IN_PROCESS, RUN
from harness.preemption import PROMPTS as PREEMPTED
from harness.prerequisites import ROOT, require
from harness.prompts import make_prompts

PROMPTS = make_prompts(11, [330, 700])
BLOCK = 32


def _model(preset: str) -> Path:
    require("vllm")
    from vllm_aio.devtools.tiny_model import PRESETS, ensure_model

    return ensure_model(ROOT / "models" / preset, PRESETS[preset])


@pytest.fixture(scope="module")
def swa_model() -> Path:
    return _model("tiny_swa")


@pytest.fixture(scope="module")
def swa_baseline(swa_model: Path, tmp_path_factory) -> list[dict]:
    (results,) = Engine(swa_model, tmp_path_factory.mktemp("hybrid-baseline")).run([PROMPTS])
    return results


def _warm_hits(warm: list[dict]) -> None:
    # Every full block but the one holding the last prompt token (always computed).
    for r in warm:
        assert r["cached"] >= (r["prompt_len"] - 1) // BLOCK * BLOCK - BLOCK, [r["cached"] for r in warm]


def test_hybrid_model_output_varies(swa_baseline):
    assert_output_varies(swa_baseline)


def test_warm_run_of_a_sliding_window_model_loads_every_group_and_matches_no_connector(
    swa_model, swa_baseline, tmp_path
):
    engine = Engine(swa_model, tmp_path)
    cold, warm = engine.run([PROMPTS, PROMPTS], aio_config())
    assert "kv_cache_groups=2 (window 64, full)" in engine.last_log
    assert all(r["cached"] == 0 for r in cold)
    _warm_hits(warm)
    assert engine.last_counters["hit_tokens"] == sum(r["cached"] for r in warm)
    assert_same_generation(cold, swa_baseline)
    assert_same_generation(warm, swa_baseline)


def test_a_lost_block_of_a_hybrid_model_recomputes_the_request(swa_model, swa_baseline, tmp_path):
    # vLLM 0.32 refuses failed block ids of several groups: the request is reported failed whole.
    engine = Engine(swa_model, tmp_path)
    config = aio_config(module="harness.faulty_connector", connector="FaultyAioConnector", local_pool_size="256MB")
    cold, warm = engine.run([PROMPTS, PROMPTS], config, env={"AIO_FAULT": "lost_and_torn"}, timeout=200)
    # Once per request: a request recomputed after a failed load is not offered the pool again.
    assert engine.last_log.count("vLLM recomputes the whole request") == len(PROMPTS)
    assert engine.last_counters["failed_hit_tokens"] > 0
    assert_same_generation(warm, swa_baseline)


@pytest.mark.parametrize(
    ("preset", "groups"),
    [("tiny_cohere2", "2 (window 65, full)"), ("tiny_gpt_oss", "2 (window 64, full)"),
     ("tiny_mistral_swa", "1 (window 64)")],  # vLLM's Cohere2 widens the window by one
)
def test_other_sliding_window_architectures_match_their_cold_run_when_warm(preset, groups, tmp_path):
    engine = Engine(_model(preset), tmp_path)
    cold, warm = engine.run([PROMPTS, PROMPTS], aio_config())
    assert f"kv_cache_groups={groups}" in engine.last_log
    _warm_hits(warm)
    assert_output_varies(cold)
    assert_same_generation(warm, cold)  # the cold pass as reference: see conftest


def test_a_preempted_hybrid_request_resumes_from_its_rescued_blocks(swa_model, tmp_path):
    # test_e2e_preemption.py's run on the hybrid model: the rescue copies out every
    # full-attention block and the sliding-window blocks still in the window, which
    # is all a resumption's hit needs; a window block vLLM freed earlier must never
    # be stored (it may hold another request's KV: the output would differ).
    # vLLM sets a sliding window's blocks aside for every sequence (4 x 3 of the 36 here):
    # the full-attention layers get 24 blocks, which 4 sequences of ~550 tokens overflow.
    run = {**RUN, "num_gpu_blocks_override": 36, "max_model_len": 640}
    engine = Engine(swa_model, tmp_path)
    (baseline,) = engine.run([PREEMPTED], env=IN_PROCESS, **run)
    recomputed_without = engine.last_recomputed_after_preemption
    assert engine.last_preemptions > 0 and recomputed_without > 0
    (got,) = engine.run([PREEMPTED], aio_config(local_pool_size="64MB"), env=IN_PROCESS, **run)
    assert engine.last_preemptions > 0
    assert engine.last_counters.get("load_failures", 0) == 0
    assert engine.last_recomputed_after_preemption <= 0.1 * recomputed_without, (
        engine.last_recomputed_after_preemption, recomputed_without)
    assert_same_generation(got, baseline)
