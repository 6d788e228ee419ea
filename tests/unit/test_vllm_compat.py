"""The seams over vLLM's internals that moved between 0.23, 0.27.1, 0.32 and 0.33 (``vllm_aio/vllm_compat.py``).

Each fallback against a stand-in of the older structure; the feature probes against the vLLM this
suite runs on (``make test`` runs the end-to-end tier on 0.32.0 and on 0.27.1).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from conftest import require
from vllm_aio import vllm_compat
from vllm_aio.errors import ConfigError


def test_a_setting_a_newer_vllm_needs_is_refused_naming_both():
    require("vllm")
    with pytest.raises(ConfigError, match=r"dynamic_buffer_count needs vLLM 0\.32 or later \(one tensor\); this is vLLM \S+"):
        vllm_compat.require(False, "dynamic_buffer_count", "one tensor")
    vllm_compat.require(True, "dynamic_buffer_count", "one tensor")


def test_fields_older_vllm_lacks_take_the_values_it_implied():
    old_spec = SimpleNamespace(block_size=32)
    assert vllm_compat.dcp_sharded(old_spec) is True  # before 0.32 every attention group was DCP-sharded
    assert vllm_compat.extra_retained_tokens(old_spec) == 0
    assert vllm_compat.failed_recving(SimpleNamespace(invalid_block_ids=set())) == set()
    assert vllm_compat.kv_cache_block_copies(SimpleNamespace()) == []


def test_fields_0_32_has_are_read_as_they_are():
    spec = SimpleNamespace(dcp_sharded=False, extra_retained_tokens=16)
    assert vllm_compat.dcp_sharded(spec) is False and vllm_compat.extra_retained_tokens(spec) == 16
    assert vllm_compat.failed_recving(SimpleNamespace(failed_recving={"r"})) == {"r"}
    copy = SimpleNamespace(src_block_id=1, dst_block_id=2)
    assert vllm_compat.kv_cache_block_copies(SimpleNamespace(kv_cache_block_copies=[copy])) == [copy]
    assert vllm_compat.hash_block_size(SimpleNamespace(hash_block_size=64), vllm_config=None) == 64
    assert vllm_compat.kv_cache_layout(SimpleNamespace(kv_cache_layout="HND"), vllm_config=None) == "HND"


def test_the_probes_agree_with_the_vllm_installed():
    require("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1 import base
    from vllm.v1.kv_cache_interface import KVCacheTensor
    from vllm.v1.outputs import KVConnectorOutput

    fields = {f.name for f in dataclasses.fields(KVCacheTensor)}
    assert vllm_compat.buffer_plan_form() == ("layers" if "layer_stride" in fields else "shared_by")
    assert vllm_compat.buffer_internals_missing() == []  # every supported vLLM has one form of the plan
    assert vllm_compat.reports_failed_requests() == ("failed_recving" in KVConnectorOutput.__dataclass_fields__)
    # Only a vLLM that asks get_transfer_results has its result type.
    assert hasattr(base.KVConnectorBase_V1, "get_transfer_results") == hasattr(base, "KVConnectorTransferResults")
    if hasattr(base, "KVConnectorTransferResults"):
        results = vllm_compat.transfer_results({"a"}, {"b"})
        assert (results.finished_recving, results.failed_recving) == ({"a"}, {"b"})


# Run against an older or newer vLLM's Python sources (make test-unit unpacks them: 0.23.0's CPU wheel
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
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT

    sources = ROOT / folder
    if not (sources / ".unpacked").exists():
        if os.environ.get("CI"):
            pytest.fail(f"CI requires the vLLM sources in {folder} (make test-unit unpacks them)")
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
