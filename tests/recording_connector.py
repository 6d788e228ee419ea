"""AioConnector whose backends record every key their process stores, for end-to-end tests.

Loaded by real vLLM through ``kv_connector_module_path: recording_connector``.
Each process appends the keys it puts, one a line, to ``$AIO_RECORD_DIR/<pid>``,
so a test can tell which worker (rank) stored what. Everything else (vLLM, the
connector, the pool) is the real thing. Tests must not import this module:
importing it replaces the backends of every connector built in the process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from vllm_aio.connector import AioConnector
from vllm_aio.connector import connector as _connector

_create_backend = _connector.create_backend


class _RecordingBackend:
    def __init__(self, inner: Any, path: str) -> None:
        self.inner, self.path = inner, path

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def batch_put(self, keys: Sequence[str], segments: Sequence[Any]) -> Any:
        with open(self.path, "a") as log:
            log.write("".join(f"{key}\n" for key in keys))
        return self.inner.batch_put(keys, segments)


def _recording_backend(*args: Any, **kwargs: Any) -> _RecordingBackend:
    path = os.path.join(os.environ["AIO_RECORD_DIR"], str(os.getpid()))
    return _RecordingBackend(_create_backend(*args, **kwargs), path)


# vLLM imports this module in every process that builds the connector.
_connector.create_backend = _recording_backend


class RecordingAioConnector(AioConnector):
    """The real connector; importing this module installed the recording backends."""

