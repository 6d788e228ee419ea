"""Registers ``AioConnector`` by name, so a config needs no ``kv_connector_module_path``.

This module is a ``vllm.general_plugins`` entry point (see setup.py): vLLM
calls ``register`` in every process it starts (API server, engine core,
workers), maybe more than once, and with ``VLLM_PLUGINS`` set only if that
list names ``vllm_aio_connector``. Registration is lazy in vLLM's factory:
nothing of the connector is imported until a config names it.

``kv_connector_module_path: vllm_aio.connector`` keeps working, and takes
priority over the registry in vLLM's factory.
"""

from __future__ import annotations

from typing import Any

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
