"""The package's ``vllm.general_plugins`` entry points (setup.py), and which configs run its connector.

vLLM calls each plugin in every process it starts (API server, engine core,
workers), maybe more than once, and with ``VLLM_PLUGINS`` set only if that list
names it. ``register`` (``vllm_aio_connector``) registers ``AioConnector`` by
name, so a config needs no ``kv_connector_module_path``; registration is lazy in
vLLM's factory: nothing of the connector is imported until a config names it.
``kv_connector_module_path: vllm_aio.connector`` keeps working, and takes
priority over the registry in vLLM's factory. ``register_buffer_plan``
(``vllm_aio_buffer_plan``) lets ``transfer_mode: dynamic_buffer`` re-plan vLLM's
KV cache (``buffer/plan.py``), where the AioConnector runs with it. No torch at
import: this module is loaded in every process.
"""

from __future__ import annotations

from typing import Any

from vllm_aio.buffer.plan import patch_planner
from vllm_aio.config import AioConfig, parse_extra_config

CONNECTOR = "AioConnector"
MODULE = "vllm_aio.connector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR, MODULE, CONNECTOR)
    except ValueError:
        pass  # the factory raises on a second registration: an earlier call in this process made it


def selects_aio(transfer_config: Any) -> bool:
    """Whether a ``KVTransferConfig`` runs this package's connector: by module path, by its registered
    name, or as a subclass of it in a module of the user's (imported here, as vLLM's factory will)."""
    if transfer_config is None:
        return False
    module = transfer_config.kv_connector_module_path
    if not module:
        return transfer_config.kv_connector == CONNECTOR
    if str(module).startswith("vllm_aio"):
        return True
    import importlib

    from vllm_aio.connector import AioConnector

    chosen = getattr(importlib.import_module(module), transfer_config.kv_connector or "", None)
    return isinstance(chosen, type) and issubclass(chosen, AioConnector)


def register_buffer_plan() -> None:
    """Patch vLLM's KV cache planner for the dynamic buffer, in each vLLM process before the cache is
    planned; the patched planner changes nothing unless the AioConnector runs with the buffer."""
    patch_planner(aio_config)


def aio_config(vllm_config: Any) -> AioConfig | None:
    """The AioConnector's config in ``vllm_config``, parsed; None when another connector runs."""
    transfer = vllm_config.kv_transfer_config
    return parse_extra_config(transfer.kv_connector_extra_config) if selects_aio(transfer) else None
