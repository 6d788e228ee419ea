"""The seams over vLLM's internals that moved between 0.23, 0.27.1, 0.32 and 0.33 (``vllm_aio/vllm_compat.py``).

Each fallback against a stand-in of the older structure; the feature probes against the vLLM this
suite runs on (``make test`` runs the end-to-end tier on 0.32.0 and on 0.27.1); the connector on
0.23's and 0.33's own sources: ``tests/compat/``.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from harness.prerequisites import require
from vllm_aio import vllm_compat
from vllm_aio.errors import ConfigError


def test_a_setting_a_newer_vllm_needs_is_refused_naming_both():
    require("vllm")
    with pytest.raises(ConfigError,
                       match=r"dynamic_buffer_count needs vLLM 0\.32 or later \(one tensor\); this is vLLM \S+"):
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
