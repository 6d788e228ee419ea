"""End to end on real vLLM (CPU build) with a real Mooncake pool on loopback:
``MOONCAKE_CONFIG_PATH`` files written for vLLM's MooncakeStoreConnector and
vllm-ascend's AscendStoreConnector run unchanged, and their ``tenant_id`` keeps
two engines on one master apart. The extra config names only the backend.

The master runs with ``--enable_multi_tenants`` and a quota file naming the
tenants, as a deployment that uses tenants would (the backend keeps tenants'
keys apart on any master: tests/test_mooncake_backend.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.assertions import assert_same_generation
from harness.engines import Engine, aio_config
from harness.prompts import PROMPTS
from vllm_aio.devtools.mooncake_pool import MooncakePool

IGNORING = "ignoring keys that mean nothing to vllm_aio: "


def vllm_file(pool: MooncakePool, tenant: str) -> dict:
    """As vLLM's MooncakeStoreConnector reads it (vllm/distributed/mooncake_store.py), standalone-store."""
    return {
        "metadata_server": "P2PHANDSHAKE", "master_server_address": pool.master_address, "protocol": "tcp",
        "device_name": "", "mode": "standalone-store", "global_segment_size": 0, "local_buffer_size": "16MB",
        "enable_offload": False, "tenant_id": tenant,
    }


def ascend_file(pool: MooncakePool, tenant: str) -> dict:
    """As vllm-ascend's AscendStoreConnector reads it, over tcp (ascend_store/backend/mooncake_backend.py)."""
    return {
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "device_name": "",
        "use_ascend_direct": False, "alloc_in_same_node": True, "master_server_address": pool.master_address,
        "global_segment_size": 0, "local_buffer_size": "16MB", "tenant_id": tenant,
    }


def run_with_file(engine: Engine, settings: dict, rounds: list) -> list[list[dict]]:
    path = engine.workdir / f"mooncake-{settings['tenant_id']}.json"
    path.write_text(json.dumps(settings))
    return engine.run(rounds, aio_config("kv_both", backend="mooncake"), env={"MOONCAKE_CONFIG_PATH": str(path)})


def cached_fraction(result: dict) -> float:
    return result["cached"] / result["prompt_len"]


@pytest.fixture(scope="module")
def tenant_pool(tmp_path_factory: pytest.TempPathFactory):
    """One pool whose master keeps tenants "a" and "b" apart."""
    from harness.mooncake_fixtures import require_mooncake  # a plugin module: imported late, as pytest wants

    require_mooncake()
    logs = tmp_path_factory.mktemp("mooncake-tenants")
    quota = logs / "tenants.yaml"
    quota.write_text("version: 1\ntenants:\n  - name: a\n    quota: 256MB\n  - name: b\n    quota: 256MB\n")
    args = ("--enable_multi_tenants=true", f"--tenant_quota_connector_uri={quota}")
    with MooncakePool("512MB", log_dir=logs, master_args=args) as pool:
        yield pool


@dataclass
class Run:
    rounds: list[list[dict]]
    log: str


@pytest.fixture(scope="module")
def tenant_a(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, tenant_pool: MooncakePool) -> Run:
    """Tenant "a" with a vLLM file: round one stores the prompts, round two finds them in the pool
    (vLLM's own prefix cache is off in these runs)."""
    engine = Engine(tiny_model, tmp_path_factory.mktemp("tenant-a"))
    rounds = run_with_file(engine, vllm_file(tenant_pool, "a"), [PROMPTS["warm"], PROMPTS["warm"]])
    return Run(rounds, engine.last_log)


def test_vllm_store_connector_file_runs_unchanged_and_hits_the_pool(
    tenant_a: Run, tenant_pool: MooncakePool, baseline
) -> None:
    stored, loaded = tenant_a.rounds
    assert all(r["cached"] == 0 for r in stored), [r["cached"] for r in stored]
    assert all(cached_fraction(r) >= 0.8 for r in loaded), [r["cached"] for r in loaded]
    assert_same_generation(stored, baseline["warm"])
    assert_same_generation(loaded, baseline["warm"])
    assert IGNORING + "enable_offload (" in tenant_a.log
    # The start-up line describes the store the file chose (MooncakeBackend.describe).
    assert f"backend=mooncake master={tenant_pool.master_address} protocol=tcp" in tenant_a.log
    assert "tenant_id=a global_segment_size=0.00GiB" in tenant_a.log


def test_other_tenant_on_the_same_master_sees_none_of_its_blocks(
    tenant_a: Run, tenant_pool: MooncakePool, engine: Engine, baseline
) -> None:
    first, second = run_with_file(engine, ascend_file(tenant_pool, "b"), [PROMPTS["warm"], PROMPTS["warm"]])
    assert all(r["cached"] == 0 for r in first), [r["cached"] for r in first]
    # Its own blocks do hit: the misses come from the tenant, not from a broken lookup.
    assert all(cached_fraction(r) >= 0.8 for r in second), [r["cached"] for r in second]
    assert_same_generation(first, baseline["warm"])
    assert_same_generation(second, baseline["warm"])
    assert IGNORING + "alloc_in_same_node (" in engine.last_log
    assert "use_ascend_direct (" in engine.last_log
