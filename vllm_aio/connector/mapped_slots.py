"""Values moved between the KV cache and pool slots that the device maps: no staging, no host memcpy.

The embedded pool keeps every value in a fixed-size slot of one host mapping
(``pool/host_pool.py``). Where the device can map host memory
(``Device.map_host``: CUDA under unified addressing; the CPU trivially), that
mapping is mapped once per worker and a batch moves as kernels on the
transfer stream:

* load: one gather of the batch's slots from the mapping into a device
  scratch (the bytes cross the link once, read by the kernel), then the usual
  on-device scatter into the paged cache (``BlockLayout.scatter``);
* save: the usual on-device gather out of the cache into a scratch, then one
  scatter of the payloads into the reserved slots; the CPU writes the
  64-byte headers and publishes the slots once the kernel has finished.

Slots are viewed as int64 rows: 8-byte loads and stores keep each warp's
accesses to mapped memory wide (issue 12's measurements were taken so).

The pool's guarantees stay: a load pins each slot's version, checks the
header in host memory before the copy, and ``Loaded.settle`` rechecks the
versions once the copy's event has completed, so a slot evicted and rewritten
during the copy is reported as a load error (vLLM discards that step's
output for the request and recomputes). A save writes only slots it reserved
(``WRITING``: never read, evicted or handed out) and gives up a slot only
after its kernel finished, so a late copy can never land in a slot someone
else owns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ctypes

import numpy as np
import torch

from vllm_aio.backends import SlotStore, Status
from vllm_aio.connector.block_layout import BlockLayout
from vllm_aio.device import Device, MappedHost
from vllm_aio.host_copy import copy_rows
from vllm_aio.pool.entry import HEADER_BYTES

_WORD = 8  # bytes of the int64 elements the kernels move


@dataclass
class SlotLoad:
    """One chunk's copy from slots: what to recheck once ``event`` completes."""

    positions: list[int]  # of the chunk's blocks whose bytes are being copied
    pins: list[tuple[int, int]]  # their (slot, version)
    event: torch.Event | None

    def torn(self, store: SlotStore) -> list[int]:
        """Positions whose slot was evicted or rewritten since its pin (call after ``event``)."""
        Device.synchronize(self.event)
        return [p for p, (slot, version) in zip(self.positions, self.pins) if not store.still_valid(slot, version)]


class MappedSlots:
    """Loads and saves of distinct keys straight between pool slots and the cache."""

    def __init__(self, store: SlotStore, mapped: MappedHost, layout: BlockLayout, device: Device) -> None:
        self.store = store
        self._mapped = mapped
        size = store.slot_size
        if size % _WORD or HEADER_BYTES % _WORD:
            raise ValueError(f"slot size {size} is not a multiple of {_WORD} bytes")
        self._host_rows = _host_rows(store)  # what the CPU reads and writes (headers)
        # Chosen once: device kernels over the mapping, or (the CPU) compiled host copies.
        self._copies = _HostCopies(store, layout) if device.is_host else _KernelCopies(mapped, store, layout, device)

    @classmethod
    def open(cls, store: SlotStore | None, layout: BlockLayout, device: Device) -> "MappedSlots | None":
        """The direct path, where the backend has slots and the device maps host memory; else None."""
        if store is None or store.slot_size % _WORD:
            return None
        address, nbytes = store.region()
        mapped = device.map_host(address, nbytes)
        return None if mapped is None else cls(store, mapped, layout, device)

    def close(self) -> None:
        self._mapped.release()

    # ---- loads -------------------------------------------------------------
    def load(
        self,
        keys: Sequence[str],
        expected: Sequence[bytes],
        targets: Sequence[list[int]],
        layers: Sequence[int],
        check: Callable[[torch.Tensor, list[bytes], list[Status]], list[Status]],
    ) -> tuple[list[Status], SlotLoad]:
        """Copy each key's payload to every block of its ``targets``; ``check`` refuses foreign headers.

        Gathers on the current stream, scatters on a stream of its own; the
        returned ``SlotLoad`` carries the event after both and which blocks
        to recheck once it has completed.
        """
        pins = self.store.pin_for_read(keys)
        found = [i for i, p in enumerate(pins) if p is not None]
        statuses = [Status.MISSING] * len(keys)
        if found:
            stored = torch.from_numpy(self._host_rows[[pins[i][0] for i in found], :HEADER_BYTES])
            got = check(stored, [expected[i] for i in found], [Status.OK] * len(found))
            for i, status in zip(found, got):
                statuses[i] = status
        ok = [i for i in found if statuses[i] is Status.OK]
        if not ok:
            return statuses, SlotLoad([], [], None)
        row_of, ids = zip(*[(r, dst) for r, i in enumerate(ok) for dst in targets[i]])
        done = self._copies.to_cache([pins[i][0] for i in ok], list(row_of), list(ids), layers)
        return statuses, SlotLoad(ok, [pins[i] for i in ok], done)

    # ---- saves -------------------------------------------------------------
    def reserve(self, keys: Sequence[str]) -> list[int | None]:
        """Per key: a slot to fill, None if stored already, -1 if the pool has no room."""
        return self.store.reserve(keys)

    def copy_out(self, block_ids: Sequence[int], slots: Sequence[int], layers: Sequence[int]) -> torch.Event | None:
        """Cache blocks -> their reserved slots' payloads, on the current stream.

        Returns the event after the gather out of the cache (the blocks may be
        reused then; None: they may already); the payloads are in the slots
        once the stream's work enqueued so far has completed.
        """
        return self._copies.from_cache(list(block_ids), list(slots), layers)

    def publish(self, slots: Sequence[int], headers: Sequence[bytes], written: torch.Event | None) -> list[bool]:
        """Once the payload copies behind ``written`` are done: headers in, slots visible."""
        Device.synchronize(written)
        if slots:
            raw = np.frombuffer(b"".join(headers), dtype=np.uint8).reshape(-1, HEADER_BYTES)
            self._host_rows[list(slots), :HEADER_BYTES] = raw
        return self.store.commit(slots)

    def abandon(self, slots: Sequence[int], written: torch.Event | None) -> None:
        """Give reserved slots back, after the copies into them have finished."""
        Device.synchronize(written)
        self.store.abandon(slots)


class _KernelCopies:
    """An accelerator's kernels over the mapped slots (viewed as int64 rows)."""

    def __init__(self, mapped: MappedHost, store: SlotStore, layout: BlockLayout, device: Device) -> None:
        self._rows = mapped.tensor.view(torch.int64).view(-1, store.slot_size // _WORD)
        self._slot_size = store.slot_size
        self._layout = layout
        self._device = device
        self._scatter_stream = device.new_stream()

    def to_cache(self, slots: list[int], row_of: list[int], ids: list[int], layers: Sequence[int]) -> torch.Event:
        """Gather ``slots`` across the link, then scatter row ``row_of[j]`` into block ``ids[j]``."""
        # One index transfer, before any kernel of the chunk.
        index = self._device.indices(slots + ids + row_of)
        n, m = len(slots), len(ids)
        rows = self._rows.index_select(0, index[:n])  # across the link
        gathered = self._device.record()
        # The on-device scatter runs on a stream of its own, so the next
        # chunk's gather (link-bound) overlaps this one's scatter (memory-bound).
        with self._device.on(self._scatter_stream):
            self._device.wait(gathered, self._scatter_stream)
            if m != n:  # a value shared by several blocks: repeated on the device
                rows = rows.index_select(0, index[n + m :])
            self._layout.scatter(rows.view(torch.uint8)[:, HEADER_BYTES:], index[n : n + m], layers)
            _keep_until_done(rows, index, stream=self._scatter_stream)
            return self._device.record(self._scatter_stream)

    def from_cache(self, block_ids: list[int], slots: list[int], layers: Sequence[int]) -> torch.Event | None:
        n = len(block_ids)
        index = self._device.indices(block_ids + slots)
        scratch = self._device.empty(n * self._slot_size).view(torch.int64).view(n, -1)
        self._layout.gather(index[:n], layers, scratch.view(torch.uint8)[:, HEADER_BYTES:])
        gathered = self._device.record()
        payload = slice(HEADER_BYTES // _WORD, None)
        self._rows[:, payload].index_copy_(0, index[n:], scratch[:, payload])  # across the link
        return gathered


class _HostCopies:
    """The CPU: each layer plane moves with one ``copy_rows`` call between the slots and the cache."""

    def __init__(self, store: SlotStore, layout: BlockLayout) -> None:
        self._base = store.region()[0] + HEADER_BYTES  # the payload of slot 0
        self._slot_size = store.slot_size
        self._layout = layout

    def _planes(self, layers: Sequence[int]) -> list[tuple[int, int, int, int]]:
        """(plane base, plane stride, bytes, offset in the payload) of each plane of ``layers``."""
        out, offset = [], 0
        for layer in layers:
            for p in self._layout.planes[layer]:
                out.append((p.base, p.stride, p.size, offset))
                offset += p.size
        return out

    def to_cache(self, slots: list[int], row_of: list[int], ids: list[int], layers: Sequence[int]) -> None:
        src = np.asarray(slots, dtype=np.int64)[row_of]
        dst = np.asarray(ids, dtype=np.int64)
        self._check(dst)
        for base, stride, size, offset in self._planes(layers):
            copy_rows(base, stride, dst, self._base + offset, self._slot_size, src, size)

    def from_cache(self, block_ids: list[int], slots: list[int], layers: Sequence[int]) -> None:
        src = np.asarray(block_ids, dtype=np.int64)
        dst = np.asarray(slots, dtype=np.int64)
        self._check(src)
        for base, stride, size, offset in self._planes(layers):
            copy_rows(self._base + offset, self._slot_size, dst, base, stride, src, size)

    def _check(self, block_ids: np.ndarray) -> None:
        # copy_rows does not check bounds: a bad block id must not become a wild write.
        if len(block_ids) and not (0 <= block_ids.min() and block_ids.max() < self._layout.num_blocks):
            raise IndexError(f"block ids outside [0, {self._layout.num_blocks})")


def _keep_until_done(*tensors: torch.Tensor, stream: torch.Stream | None) -> None:
    """Tensors allocated on another stream, used on ``stream``: not reused before its work ends."""
    if stream is not None:
        for t in tensors:
            t.record_stream(stream)


def _host_rows(store: SlotStore) -> np.ndarray:
    """The slots as a numpy ``[slots, slot_size]`` view (torch's fancy indexing of so large a
    view took 5 ms to read 256 headers, numpy's microseconds)."""
    address, nbytes = store.region()
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address)).reshape(-1, store.slot_size)
