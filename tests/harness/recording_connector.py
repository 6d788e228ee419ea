"""AioConnector whose backends record every key their process stores, for end-to-end tests.

Loaded by real vLLM through ``kv_connector_module_path: harness.recording_connector``.
Each process appends the keys it puts, one a line, to ``$AIO_RECORD_DIR/<pid>``,
so a test can tell which worker (rank) stored what: through ``batch_put``, or
through the embedded pool's slots (``reserve_blocks``) on the direct path. Everything else (vLLM, the
connector, the pool) is the real thing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from vllm_aio.connector import AioConnector
from vllm_aio.pool.keys import block_key


class _Recorder:
    def __init__(self, inner: Any, path: str) -> None:
        self.inner, self.path = inner, path

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _record(self, keys: Sequence[str]) -> None:
        with open(self.path, "a") as log:
            log.write("".join(f"{key}\n" for key in keys))


class _RecordingSlots(_Recorder):
    def reserve(self, keys: Sequence[str], retention: int = 0) -> Any:
        self._record(keys)
        return self.inner.reserve(keys, retention)

    def reserve_blocks(self, namespace_digest: str, shard: str, tag: int | None, hashes: Sequence[bytes],
                       retention: int = 0) -> Any:
        self._record([block_key(namespace_digest, shard, h, tag) for h in hashes])
        return self.inner.reserve_blocks(namespace_digest, shard, tag, hashes, retention)


class _RecordingBackend(_Recorder):
    def batch_put(self, keys: Sequence[str], segments: Sequence[Any], retention: int = 0) -> Any:
        self._record(keys)
        return self.inner.batch_put(keys, segments, retention)

    def slots(self) -> Any:
        inner = self.inner.slots()
        return None if inner is None else _RecordingSlots(inner, self.path)


class RecordingAioConnector(AioConnector):
    """The real connector, whose backend also records the keys it puts."""

    def open_backend(self, cfg: Any, dep: Any, for_scheduler: bool) -> Any:
        path = os.path.join(os.environ["AIO_RECORD_DIR"], str(os.getpid()))
        return _RecordingBackend(super().open_backend(cfg, dep, for_scheduler), path)
