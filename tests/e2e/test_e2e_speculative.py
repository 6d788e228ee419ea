"""End to end on real vLLM (CPU build): pool hits under speculative decoding with vLLM's n-gram proposer.

The n-gram proposer needs no draft model: it proposes tokens that follow an earlier occurrence of
the last few tokens in the sequence, so the prompts repeat a segment. vLLM then verifies several
tokens a step (a step's scheduled tokens are no longer one per request), the step that follows a
hit included. Round two of each engine hits the pool (vLLM's own prefix cache off); every round
must give the tokens of vLLM alone with the same speculative decoding. The dynamic buffer refuses it
at start, naming the method.
"""

from __future__ import annotations

import pytest

from harness.assertions import assert_same_generation
from harness.engines import FLOAT32, aio_config
from harness.prompts import make_prompts

PROMPTS = [segment * 3 for segment in make_prompts(seed=81, lengths=[100, 110, 90])]
RUN = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                              "prompt_lookup_min": 2},
       "enable_prefix_caching": False, "max_tokens": 32, "max_model_len": 1024, **FLOAT32}
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.fixture(scope="module")
def baseline(tiny_model, tmp_path_factory):
    from harness.engines import Engine

    engine = Engine(tiny_model, tmp_path_factory.mktemp("speculative"))
    rounds = engine.run([PROMPTS, PROMPTS], env=IN_PROCESS, **RUN)
    assert "SpeculativeConfig(method='ngram'" in engine.last_log
    return rounds


@pytest.mark.parametrize("mode", ["whole_blocks", "layerwise", "async"])
def test_pool_hits_under_ngram_speculative_decoding_give_vllms_tokens(engine, baseline, mode):
    cold, warm = engine.run([PROMPTS, PROMPTS], aio_config(local_pool_size="64MB", transfer_mode=mode),
                            env=IN_PROCESS, **RUN)
    assert all(r["cached"] >= 0.8 * r["prompt_len"] for r in warm), [r["cached"] for r in warm]
    assert engine.last_counters.get("load_failures", 0) == 0
    assert_same_generation(cold, baseline[0])
    assert_same_generation(warm, baseline[1])


def test_the_dynamic_buffer_refuses_speculative_decoding_at_start_naming_the_method(engine):
    config = aio_config(local_pool_size="64MB", transfer_mode="dynamic_buffer", dynamic_buffer_count=2)
    with pytest.raises(AssertionError):
        engine.run([PROMPTS], config, env=IN_PROCESS, **RUN)
    assert "transfer_mode dynamic_buffer: speculative decoding (ngram) is not supported" in engine.last_log
