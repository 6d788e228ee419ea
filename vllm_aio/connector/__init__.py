"""vLLM loads the connector from here: ``kv_connector_module_path: vllm_aio.connector``."""

from vllm_aio.connector.connector import AioConnector

__all__ = ["AioConnector"]
