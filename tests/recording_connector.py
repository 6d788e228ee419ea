"""AioConnector whose backends record every key their process stores, for end-to-end tests.

Loaded by real vLLM through ``kv_connector_module_path: recording_connector``.
Each process appends the keys it puts, one a line, to ``$AIO_RECORD_DIR/<pid>``,
so a test can tell which worker (rank) stored what. Everything else (vLLM, the
connector, the pool) is the real thing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from vllm_aio.connector import AioConnector


class _RecordingBackend:
    def __init__(self, inner: Any, path: str) -> None:
        self.inner, self.path = inner, path

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def batch_put(self, keys: Sequence[str], segments: Sequence[Any]) -> Any:
        with open(self.path, "a") as log:
            log.write("".join(f"{key}\n" for key in keys))
        return self.inner.batch_put(keys, segments)


class RecordingAioConnector(AioConnector):
    """The real connector, whose backend also records the keys it puts."""

    def open_backend(self, cfg: Any, dep: Any, for_scheduler: bool) -> Any:
        path = os.path.join(os.environ["AIO_RECORD_DIR"], str(os.getpid()))
        return _RecordingBackend(super().open_backend(cfg, dep, for_scheduler), path)
