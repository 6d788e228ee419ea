"""The reference ``Backend``: a dict of bytes in this process, copied to and from segments.

As little as the contract (``vllm_aio/backends/base.py``) allows, so that it
is obviously right: tests use it where a real store would only add noise, and
the contract suite (``test_backend_contract.py``) holds every real backend to
what it does. Unbounded: nothing is ever evicted.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

from vllm_aio.backends.base import Backend, Status, distinct_only
from vllm_aio.device.segment import Segment


class MemoryBackend(Backend):
    def __init__(self, value_bytes: int | None = None) -> None:
        self.value_bytes = value_bytes  # of every value; None: any
        self.values: dict[str, bytes] = {}  # guarded by _lock
        self._lock = threading.Lock()
        self._closed = False

    def describe(self) -> str:
        return f"memory values={len(self.values)}"

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        with self._lock:
            return [key in self.values for key in keys]

    def batch_put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], retention: int = 0) -> list[Status]:
        self._check_open()
        return distinct_only(self._put, keys, segments, self.value_bytes, Status.ERROR)

    def _put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        out = []
        for key, segs in zip(keys, segments):
            value = b"".join(ctypes.string_at(address, size) for address, size in segs)
            with self._lock:
                stored = self.values.setdefault(key, value) is value
            out.append(Status.OK if stored else Status.EXISTS)
        return out

    def batch_get(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        self._check_open()
        return distinct_only(self._get, keys, segments, self.value_bytes, Status.CORRUPT)

    def _get(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        out = []
        for key, segs in zip(keys, segments):
            with self._lock:
                value = self.values.get(key)
            if value is None:
                out.append(Status.MISSING)
            elif len(value) != sum(size for _, size in segs):
                out.append(Status.CORRUPT)
            else:
                offset = 0
                for address, size in segs:
                    ctypes.memmove(address, value[offset:offset + size], size)
                    offset += size
                out.append(Status.OK)
        return out

    def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MemoryBackend is closed")
