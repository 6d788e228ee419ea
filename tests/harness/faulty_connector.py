"""AioConnector with faults injected at the backend boundary, for end-to-end tests.

Loaded by real vLLM through ``kv_connector_module_path: harness.faulty_connector``;
``AIO_FAULT`` picks the fault, or ``AIO_FAULT_FILE`` names a file whose
contents (a fault, or ``none``) are read at every call, so that a test
switches the fault between rounds of one engine. Everything else (vLLM, the
connector, the embedded pool) is the real thing.

Segments of a load are ``[header, payload...]`` (host KV cache). The embedded
pool's direct path (``Backend.slots``) gets the same faults at its slot store:
a missing pin, a version that changed during the copy, a scribbled payload.

- ``lost_and_torn``: on load, the 3rd block of each request is reported
  MISSING (evicted after lookup) and the 5th is filled with garbage and
  reported CORRUPT (torn read); vLLM must recompute both.
- ``silent_garbage``: the 3rd block is filled with garbage but reported OK:
  a negative control proving the tests notice wrong KV.
- ``pool_down``: every backend call raises.
- ``evict_after_lookup``: the second lookup that finds blocks (in a run of
  one request at a time, the second warm pass) then evicts the pool's least
  recently used value, for real, as ``vllm-aio pool clear`` would (a lease
  does not stop that): one part of a block the lookup counted is gone before
  its load.
- ``skip_buffer_load``: the dynamic buffer never loads layer 3 (a negative
  control: attention then reads another layer's KV).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from vllm_aio.backends import Status
from vllm_aio.connector import AioConnector
from vllm_aio.pool.entry import HEADER_BYTES

# Imported where used: the buffer and the pool load numba, which vLLM's config check must not
# find loaded when this module is imported from it (``AioConnector.__init__`` says why).


def fault_in_force() -> str:
    path = os.environ.get("AIO_FAULT_FILE")
    if path is None:
        return os.environ["AIO_FAULT"]
    try:
        with open(path) as f:
            return f.read().strip() or "none"
    except FileNotFoundError:
        return "none"


class _FaultyBackend:
    def __init__(self, inner) -> None:
        self.inner = inner

    @property
    def fault(self) -> str:
        return fault_in_force()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _down(self) -> None:
        if self.fault == "pool_down":
            raise ConnectionError("injected: pool unreachable")

    def batch_exists(self, keys):
        self._down()
        return self.inner.batch_exists(keys)

    def count_complete_blocks(self, parts, hashes):
        self._down()
        found = self.inner.count_complete_blocks(parts, hashes)
        if found and self.fault == "evict_after_lookup":
            self.hits = getattr(self, "hits", 0) + 1
            if self.hits == 2:
                _evict_one(self.inner.pool)
        return found

    def batch_put(self, keys, segments, retention=0):
        self._down()
        return self.inner.batch_put(keys, segments, retention)

    def slots(self):
        inner = self.inner.slots()
        return None if inner is None else _FaultySlots(inner)

    def batch_get(self, keys, segments):
        self._down()
        statuses = self.inner.batch_get(keys, segments)
        if len(keys) > 2 and self.fault in ("lost_and_torn", "silent_garbage"):
            # Garbage in the payload only: the value's header stays valid, so
            # only the status tells the connector that the block is bad.
            _scribble(segments[2][1:])
            statuses[2] = Status.OK if self.fault == "silent_garbage" else Status.MISSING
        if len(keys) > 4 and self.fault == "lost_and_torn":
            _scribble(segments[4][1:])
            statuses[4] = Status.CORRUPT
        return statuses


class _FaultySlots:
    """The embedded pool's slot store with the same faults as ``_FaultyBackend.batch_get``."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self._torn: set[int] = set()

    @property
    def fault(self) -> str:
        return fault_in_force()

    def __getattr__(self, name):  # the mapping itself (region, slot_size) stays
        if self.fault == "pool_down" and name in ("reserve", "reserve_blocks", "commit", "abandon"):
            raise ConnectionError("injected: pool unreachable")
        return getattr(self.inner, name)

    def pin_blocks(self, namespace_digest, shard, tag, hashes):
        if self.fault == "pool_down":
            raise ConnectionError("injected: pool unreachable")
        slots, versions = self.inner.pin_blocks(namespace_digest, shard, tag, hashes)
        if len(hashes) > 2 and slots[2] >= 0:
            if self.fault == "silent_garbage":  # the payload only: the header still matches
                address = self.inner.region()[0] + int(slots[2]) * self.inner.slot_size
                _scribble([(address + HEADER_BYTES, self.inner.slot_size - HEADER_BYTES)])
            elif self.fault == "lost_and_torn":
                slots[2] = -1
        if len(hashes) > 4 and slots[4] >= 0 and self.fault == "lost_and_torn":
            self._torn.add(int(slots[4]))
        return slots, versions

    def unchanged(self, slots, versions):
        valid = self.inner.unchanged(slots, versions)
        for i, slot in enumerate(slots.tolist()):
            if slot in self._torn:  # rewritten while it was copied
                self._torn.discard(slot)
                valid[i] = False
        return valid


def _evict_one(pool) -> None:
    """Evict the least recently used value, as ``vllm-aio pool clear`` does (leases do not stop it):
    the pool really lost it. Its 64-byte header names exactly one value."""
    from vllm_aio.pool.host_pool import READY

    ready = np.flatnonzero(pool._state == READY)
    oldest = int(ready[np.argmin(pool._last_used[ready])])
    (header,) = pool.read_headers([oldest], HEADER_BYTES)
    assert pool.evict_values(header) == 1


def _scribble(segments) -> None:
    for address, size in segments:
        ctypes.memset(address, 0x3C, size)


class FaultyAioConnector(AioConnector):
    def open_backend(self, cfg, dep, for_scheduler):
        return _FaultyBackend(super().open_backend(cfg, dep, for_scheduler))

    def register_kv_caches(self, kv_caches):
        from vllm_aio.buffer.participant import BufferHooks

        super().register_kv_caches(kv_caches)
        hooks = self._worker._buffer
        if fault_in_force() == "skip_buffer_load" and isinstance(hooks, BufferHooks):
            # A negative control has to break the buffer from inside: its layer load.
            copier = hooks.buffer._copier
            load = copier._load
            copier._load = lambda layer: None if layer == 3 else load(layer)
