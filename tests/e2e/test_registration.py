"""``"kv_connector": "AioConnector"`` without ``kv_connector_module_path``: the ``vllm_aio_connector`` plugin.

The module-path form runs in every other end-to-end test (``conftest.aio_config``).
"""

from __future__ import annotations

import pytest

from harness.engines import Engine
from harness.prerequisites import require
from harness.prompts import make_prompts
from harness.servers import PLUGINS


@pytest.fixture(scope="module")
def factory():
    require("vllm")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory


def _transfer_config(**fields):
    from vllm.config.kv_transfer import KVTransferConfig

    return KVTransferConfig(kv_role="kv_both", **fields)


def test_registering_twice_is_harmless_and_names_our_connector(factory):
    from vllm_aio.connector.connector import AioConnector
    from vllm_aio.registration import register

    register()
    register()  # vLLM may load general plugins more than once per process
    assert factory.get_connector_class(_transfer_config(kv_connector="AioConnector")) is AioConnector


def test_other_connectors_resolve_as_before(factory):
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    from vllm_aio.registration import register

    register()
    assert factory.get_connector_class(_transfer_config(kv_connector="ExampleConnector")) is ExampleConnector
    # A module path still wins over our registered name, as for any connector.
    by_path = _transfer_config(kv_connector="RecordingAioConnector",
                               kv_connector_module_path="harness.recording_connector")
    assert factory.get_connector_class(by_path).__name__ == "RecordingAioConnector"


def test_subclasses_of_the_connector_in_other_modules_count_as_ours(factory):
    # The dynamic buffer's plan (buffer/plan.py) runs for them too: the tests' fault-injecting
    # connector once ran its buffer over caches vLLM never laid out for it.
    from vllm_aio.registration import selects_aio

    assert selects_aio(_transfer_config(kv_connector="RecordingAioConnector",
                                        kv_connector_module_path="harness.recording_connector"))
    assert selects_aio(_transfer_config(kv_connector="AioConnector", kv_connector_module_path="vllm_aio.connector"))
    assert not selects_aio(_transfer_config(
        kv_connector="ExampleConnector",
        kv_connector_module_path="vllm.distributed.kv_transfer.kv_connector.v1.example_connector"))
    assert not selects_aio(_transfer_config(kv_connector="ExampleConnector"))


def test_plugin_lists_the_servers_use_load_the_registration(monkeypatch, factory):
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    monkeypatch.setenv("VLLM_PLUGINS", PLUGINS)
    assert "vllm_aio_connector" in load_plugins_by_group(DEFAULT_PLUGINS_GROUP)


def test_connector_named_alone_serves_a_warm_hit(engine: Engine):
    (prompt,) = make_prompts(11, [300])
    config = {"kv_connector": "AioConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"local_pool_size": "64MB"}}
    # VLLM_PLUGINS naming only this plugin: the registration must come from it in every engine process.
    cold, warm = engine.run([[prompt], [prompt]], config, env={"VLLM_PLUGINS": "vllm_aio_connector"}, max_tokens=4)
    assert cold[0]["cached"] == 0
    assert warm[0]["cached"] == 288  # the prompt's 9 whole 32-token blocks
    assert warm[0]["token_ids"] == cold[0]["token_ids"]
