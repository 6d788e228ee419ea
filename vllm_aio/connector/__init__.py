"""vLLM loads the connector from here: by its registered name ``AioConnector``
(``vllm_aio/registration.py``) or by ``kv_connector_module_path: vllm_aio.connector``.

``AioConnector`` is imported on first access, so the torch-only parts of this
package (block layout, staging, block I/O) import where vLLM is absent, as on
a device used for benchmarks.
"""

from typing import Any

__all__ = ["AioConnector"]


def __getattr__(name: str) -> Any:
    if name == "AioConnector":
        from vllm_aio.connector.connector import AioConnector

        return AioConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
