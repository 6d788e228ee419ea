"""End to end on an Ascend NPU with vllm-ascend: warm requests served from the pool.

Marked ``npu``: collected everywhere, skipped without an NPU, a failure in the
NPU workflow (``VLLM_AIO_REQUIRE_NPU=1``) when none is usable. Cases: eager on
the embedded pool (values through page-locked staging: torch_npu maps no host
memory for kernels); graph mode (vLLM's default ACL graphs, a ``vllm serve``
without ``--enforce-eager``, since the test engine runner is always eager);
MLA; and a Mooncake pool with the image's NPU build of Mooncake, over tcp as
the fixtures' memory-owning client speaks it: the NPU build starts its Ascend
transport in every client, the scheduler's included (``device.set_process_npu``).
Device-direct (``protocol: ascend``) needs a pool owner on the Ascend transport
and ``/etc/hccn.conf``, which this workflow does not have. vllm-ascend's
attention takes 128-token blocks. The /dev/shm the pools need is checked by the
workflow first (``NPU_SHM_BYTES``).
"""

from __future__ import annotations

import pytest
import requests

from harness.assertions import assert_same_generation
from harness.engines import Engine
from harness.prerequisites import ROOT
from harness.prompts import make_prompts
from harness.servers import serve

pytestmark = pytest.mark.npu
pytest_plugins = ["harness.mooncake_fixtures"]

BLOCK = 128
POOL = "256MB"
# What the cases' pools take of /dev/shm at most (one embedded pool at a time, and vLLM's own queues):
# the NPU workflow refuses to start the tests on a smaller /dev/shm (test_workflows.py checks it).
NPU_SHM_BYTES = 1 << 30


def embedded() -> dict:
    return {"kv_connector": "AioConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"local_pool_size": POOL}}


def test_warm_request_on_npu_loads_its_prefix_from_the_pool(engine: Engine):
    (prompt,) = make_prompts(21, [600])
    cold, warm = engine.run([[prompt], [prompt]], embedded(), block_size=BLOCK, max_tokens=8)
    assert cold[0]["cached"] == 0
    assert warm[0]["cached"] == 512  # the prompt's 4 whole blocks
    assert_same_generation(warm, cold)  # the cold pass as reference: see conftest


def test_warm_request_in_graph_mode_loads_its_prefix_from_the_pool(tiny_model, tmp_path):
    (prompt,) = make_prompts(22, [600])
    log = tmp_path / "server.log"
    args = ["--block-size", str(BLOCK), "--max-model-len", "4096", "--no-enforce-eager",
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details"]
    env = {"PYTHONHASHSEED": "0", "PYTHONPATH": str(ROOT)}
    with serve(tiny_model, log, args, embedded(), env, startup_s=600) as server:
        url = server.url
        cold, warm = (_complete(url, str(tiny_model), prompt) for _ in range(2))
    assert "enforce_eager=False" in log.read_text()  # the engine's config line: graphs, not eager
    assert cold[1] == 0 and warm[1] == 512
    assert warm[0] == cold[0]


def test_mla_warm_request_on_npu_loads_its_prefix_from_the_pool(tiny_mla_model, tmp_path):
    (prompt,) = make_prompts(23, [600])
    cold, warm = Engine(tiny_mla_model, tmp_path).run([[prompt], [prompt]], embedded(), block_size=BLOCK,
                                                      max_tokens=8)
    assert cold[0]["cached"] == 0 and warm[0]["cached"] == 512
    assert_same_generation(warm, cold)


def test_warm_request_on_npu_loads_its_prefix_from_mooncake(engine: Engine, mooncake_pool_factory):
    pool = mooncake_pool_factory("512MB")
    (prompt,) = make_prompts(24, [600])
    config = {"kv_connector": "AioConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"backend": "mooncake", **pool.config}}
    cold, warm = engine.run([[prompt], [prompt]], config, block_size=BLOCK, max_tokens=8)
    assert cold[0]["cached"] == 0 and warm[0]["cached"] == 512
    assert_same_generation(warm, cold)


def _complete(url: str, model: str, prompt: list[int]) -> tuple[str, int]:
    """(text, cached prompt tokens) of a greedy completion of ``prompt``'s token ids."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    reply = requests.post(f"{url}/v1/completions", json=body, timeout=300)
    reply.raise_for_status()
    result = reply.json()
    details = result["usage"].get("prompt_tokens_details") or {}
    return result["choices"][0]["text"], details.get("cached_tokens") or 0
