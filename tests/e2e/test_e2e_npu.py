"""End to end on an Ascend NPU with vllm-ascend: a warm request served from the embedded pool.

Marked ``npu``: collected everywhere, skipped without an NPU, a failure in the
NPU workflow (``VLLM_AIO_REQUIRE_NPU=1``) when none is usable. The values go
through page-locked staging (torch_npu maps no host memory for kernels).
"""

from __future__ import annotations

import pytest

from conftest import Engine, assert_same_generation, make_prompts

pytestmark = pytest.mark.npu


def test_warm_request_on_npu_loads_its_prefix_from_the_pool(engine: Engine):
    (prompt,) = make_prompts(21, [600])
    config = {"kv_connector": "AioConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"local_pool_size": "256MB"}}
    # vllm-ascend's attention takes 128-token blocks.
    cold, warm = engine.run([[prompt], [prompt]], config, block_size=128, max_tokens=8)
    assert cold[0]["cached"] == 0
    assert warm[0]["cached"] == 512  # the prompt's 4 whole blocks
    assert_same_generation(warm, cold)  # the cold pass as reference: see conftest
