"""The connector on vLLM versions this machine cannot run an engine of: 0.23.0 and 0.33.0's own sources.

Needs the sources unpacked in ``.vllm023`` and ``.vllm033`` (``make test-compat`` downloads the two
wheels once): a tier of its own, so that ``make test-unit`` runs offline. Each test imports the
connector over that version's sources in a subprocess and compares the parameters of its hooks with
the version's base class (``tests/unit/test_vllm_compat.py`` covers the seams on the vLLM installed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.prerequisites import ROOT

# Run against an older or newer vLLM's Python sources (make test-compat unpacks them: 0.23.0's CPU wheel
# into .vllm023, its compiled extension built for a torch this machine cannot install; 0.33.0's CUDA
# wheel into .vllm033, as the index has no CPU build of it), so no engine runs on them here.
PROBE = """
import inspect, json
import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm_aio import vllm_compat
from vllm_aio.connector.connector import AioConnector

def plan():  # a 5-layer plan in this vLLM's own form, as its planner makes it, put on 2 buffers
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm_aio.buffer.plan import alias_layers

    names, page = [f"layer.{i}" for i in range(5)], 4096
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    if vllm_compat.buffer_plan_form() == "shared_by":
        tensors = [KVCacheTensor(size=10 * page, shared_by=[n]) for n in names]
    else:
        tensors = [KVCacheTensor(size=50 * page, layers=names, layer_stride=10 * page, block_stride=page)]
    planned = alias_layers(KVCacheConfig(10, tensors, [KVCacheGroupSpec(names, spec)]), 2)
    return [[t.size, getattr(t, "shared_by", None) or t.layers, getattr(t, "offset", 0)]
            for t in planned.kv_cache_tensors]

def params(fn):
    return list(inspect.signature(fn).parameters)

hooks = {name: (params(getattr(AioConnector, name)), params(getattr(KVConnectorBase_V1, name)))
         for name in vars(AioConnector)
         if callable(getattr(AioConnector, name)) and not name.startswith("_") and hasattr(KVConnectorBase_V1, name)}
sleep_mode = AioConnector.supports_sleep_mode(None) if hasattr(KVConnectorBase_V1, "supports_sleep_mode") else None
print(json.dumps({"version": vllm.__version__, "hooks": hooks,
                  "failed_recving": vllm_compat.reports_failed_requests(),
                  "plan_form": vllm_compat.buffer_plan_form(),
                  "plan": plan(),
                  "cache_hit_source": vllm_compat.host_cache_hit_source() is not None,
                  "buffer_missing": vllm_compat.buffer_internals_missing(),
                  "sleep_mode": sleep_mode}))
"""


def probe(folder: str) -> dict:
    """What ``PROBE`` finds with the vLLM sources unpacked in ``folder`` first on the path."""

    sources = ROOT / folder
    if not (sources / ".unpacked").exists():
        if os.environ.get("CI"):
            pytest.fail(f"CI requires the vLLM sources in {folder} (make test-compat unpacks them)")
        pytest.skip(f"the vLLM sources of {folder} are not unpacked (make {folder}/.unpacked)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [sources / "src", sources / "deps", ROOT]))}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    wrong = {name: sig for name, sig in found["hooks"].items() if sig[0] != sig[1]}
    assert not wrong, f"hooks whose parameters differ from vLLM {found['version']}'s: {wrong}"
    return found


def test_the_connector_imports_on_vllm_0_23_and_its_hooks_take_that_versions_parameters():
    found = probe(".vllm023")
    assert found["version"] == "0.23.0"
    assert "get_finished" in found["hooks"] and "register_kv_caches" in found["hooks"]
    # What 0.23 lacks, the seams say so (and the settings that need it refuse at start).
    assert (found["failed_recving"], found["cache_hit_source"]) == (False, False)
    assert found["sleep_mode"] is None
    # The dynamic buffer plans there in 0.23's form: buffer b's tensor shared by the layers l % 2 == b.
    assert found["buffer_missing"] == [] and found["plan_form"] == "shared_by"
    assert found["plan"] == [[10 * 4096, ["layer.0", "layer.2", "layer.4"], 0], [10 * 4096, ["layer.1", "layer.3"], 0]]


def test_the_connector_imports_on_vllm_0_33_and_its_hooks_take_that_versions_parameters():
    found = probe(".vllm033")
    assert found["version"] == "0.33.0"
    assert {"get_transfer_results", "register_kv_caches", "supports_sleep_mode"} <= set(found["hooks"])
    assert (found["failed_recving"], found["plan_form"], found["cache_hit_source"]) == (True, "layers", True)
    region = 10 * 4096  # each layer at its buffer's offset of one 2-region allocation
    assert found["plan"] == [[2 * region, [f"layer.{i}"], (i % 2) * region] for i in range(5)]
    # The planner moved to kv_cache_planning and took a fourth parameter: the buffer finds and wraps it.
    assert found["buffer_missing"] == []
    assert found["sleep_mode"] is False  # the connector refuses sleep mode (AioConnector.supports_sleep_mode)
