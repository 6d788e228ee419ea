"""Values moved between the KV cache and pool slots that the device maps: no staging, no host memcpy.

The embedded pool keeps every value in a fixed-size slot of one host mapping
(``pool/host_pool.py``). Where the device can map host memory
(``Device.map_host``: CUDA under unified addressing; the CPU trivially), that
mapping is mapped once per worker and a batch moves without staging:

* CUDA, load: the batch's slots into a device scratch (the bytes cross the
  link once: one DMA per run of consecutive slots, or one gather kernel over
  scattered ones), then the usual on-device scatter into the paged cache
  (``BlockLayout.scatter``) on a second stream; save: the usual on-device
  gather out of the cache, then the scratch into the reserved slots the same
  two ways. Kernels view the slots as int64 rows: 8-byte accesses keep each
  warp's reads of mapped memory wide.
* the CPU: one compiled row copy per layer plane between the slots and the
  cache (``host_copy.copy_rows``), on every core.

Either way the CPU writes the 64-byte headers and publishes the slots once
the copies have finished.

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

import ctypes
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_aio.backends import SlotStore, Status
from vllm_aio.device import host_copy
from vllm_aio.device.accelerator import Device, host_tensor
from vllm_aio.device.block_layout import BlockLayout
from vllm_aio.device.host_copy import copy_rows
from vllm_aio.device.mapped_host import MappedHost
from vllm_aio.log import get_logger
from vllm_aio.pool.entry import HASH_PREFIX_BYTES, HEADER_BYTES, describe
from vllm_aio.pool.keys import Unit

logger = get_logger(__name__)

_WORD = 8  # bytes of the int64 elements the kernels move
_OK, _MISSING, _FOREIGN = 0, 1, 2
_STATUS = {_OK: Status.OK, _MISSING: Status.MISSING, _FOREIGN: Status.FOREIGN}


@dataclass
class SlotLoad:
    """One chunk's copy from slots: what to recheck once ``event`` completes."""

    positions: np.ndarray  # of the chunk's blocks whose bytes are being copied
    slots: np.ndarray  # their pinned slots and versions
    versions: np.ndarray
    event: torch.Event | None

    def torn(self, store: SlotStore) -> list[int]:
        """Positions whose slot was evicted or rewritten since its pin (call after ``event``)."""
        Device.synchronize(self.event)
        if not len(self.slots):
            return []
        return self.positions[~store.unchanged(self.slots, self.versions)].tolist()


@dataclass
class LoadPlan:
    """What a chunk of distinct blocks needs for every unit it loads: made once per batch."""

    hashes: list[bytes]
    prefixes: np.ndarray  # [n, HASH_PREFIX_BYTES] uint8: each header's last field
    row_of: np.ndarray  # per destination block: its value's position in the chunk
    block_ids: np.ndarray  # the destination blocks
    device_index: torch.Tensor | None = None  # block_ids then row_of, on the device (made on first use)


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

    def warm_up(self, layer_sets: Iterable[Sequence[int]]) -> None:
        """Compile and load this path's copies at start (``BlockIO.warm_up``); no slot is written."""
        self._copies.warm_up(layer_sets)

    # ---- loads -------------------------------------------------------------
    @staticmethod
    def plan(hashes: list[bytes], targets: Sequence[list[int]]) -> LoadPlan:
        """The per-batch part of loading these distinct blocks (hashes) into their ``targets``."""
        prefixes = b"".join(h[:HASH_PREFIX_BYTES].ljust(HASH_PREFIX_BYTES, b"\0") for h in hashes)
        row_of = np.repeat(np.arange(len(targets), dtype=np.int64), [len(t) for t in targets])
        block_ids = np.fromiter((b for t in targets for b in t), dtype=np.int64, count=len(row_of))
        return LoadPlan(hashes, np.frombuffer(prefixes, dtype=np.uint8).reshape(-1, HASH_PREFIX_BYTES), row_of, block_ids)

    def load(
        self, plan: LoadPlan, namespace_digest: str, shard: str, unit: Unit, fixed_header: bytes
    ) -> tuple[list[Status], SlotLoad]:
        """Copy each value of ``plan`` to its blocks; a value whose header differs from
        ``fixed_header`` + its hash prefix is refused (``FOREIGN``), a missing one is ``MISSING``.

        Gathers on the current stream, scatters on a stream of its own; the
        returned ``SlotLoad`` carries the event after both and which blocks
        to recheck once it has completed. No Python work per block: a
        layerwise step runs this once per layer for the same blocks.
        """
        slots, versions = self.store.pin_blocks(namespace_digest, shard, unit.tag, plan.hashes)
        found = np.flatnonzero(slots >= 0)
        stored = self._host_rows[slots[found], :HEADER_BYTES]
        fixed = np.frombuffer(fixed_header, dtype=np.uint8)
        same = (stored[:, : len(fixed)] == fixed).all(axis=1) & (stored[:, len(fixed) :] == plan.prefixes[found]).all(axis=1)
        codes = np.full(len(slots), _MISSING, dtype=np.int8)
        codes[found] = np.where(same, _OK, _FOREIGN)
        for i in found[~same].tolist():
            logger.debug("vllm_aio: refused a value: stored %s", describe(self._host_rows[slots[i], :HEADER_BYTES].tobytes()))
        statuses = [_STATUS[c] for c in codes.tolist()]
        ok = found[same]
        if not len(ok):
            return statuses, SlotLoad(ok, ok, ok, None)
        if len(ok) == len(slots):  # the common case: every value there, the plan's indices as they are
            done = self._copies.to_cache(slots, plan, unit.layers)
        else:
            keep = np.isin(plan.row_of, ok)
            remap = np.full(len(slots), -1, dtype=np.int64)
            remap[ok] = np.arange(len(ok))
            partial = LoadPlan(plan.hashes, plan.prefixes, remap[plan.row_of[keep]], plan.block_ids[keep])
            done = self._copies.to_cache(slots[ok], partial, unit.layers)
        return statuses, SlotLoad(ok, slots[ok], versions[ok], done)

    # ---- saves -------------------------------------------------------------
    def reserve(
        self, namespace_digest: str, shard: str, unit: Unit, hashes: Sequence[bytes], retention: int = 0
    ) -> np.ndarray:
        """Per block hash: a slot to fill, ``SLOT_STORED`` if stored already, ``SLOT_NO_ROOM`` if
        the pool has no room. No key string is built: the ids come from the hashes, as for loads."""
        return self.store.reserve_blocks(namespace_digest, shard, unit.tag, hashes, retention)

    def copy_out(self, block_ids: Sequence[int], slots: np.ndarray, layers: Sequence[int]) -> torch.Event | None:
        """Cache blocks -> their reserved slots' payloads: gathered on the current stream,
        written across the link on a stream of its own (``written`` says when).

        Returns the event after the gather out of the cache (the blocks may be
        reused then; None: they may already).
        """
        return self._copies.from_cache(np.asarray(block_ids, dtype=np.int64), np.asarray(slots, dtype=np.int64),
                                       layers)

    def written(self) -> torch.Event | None:
        """An event after every slot write ``copy_out`` has enqueued so far (None: done already)."""
        return self._copies.written()

    def publish(self, slots: np.ndarray, headers: Sequence[bytes], written: torch.Event | None) -> list[bool]:
        """Once the payload copies behind ``written`` are done: headers in, slots visible."""
        Device.synchronize(written)
        if len(slots):
            raw = np.frombuffer(b"".join(headers), dtype=np.uint8).reshape(-1, HEADER_BYTES)
            self._host_rows[np.asarray(slots, dtype=np.int64), :HEADER_BYTES] = raw
        return self.store.commit(slots)

    def abandon(self, slots: np.ndarray, written: torch.Event | None) -> None:
        """Give reserved slots back, after the copies into them have finished."""
        Device.synchronize(written)
        self.store.abandon(slots)


class _KernelCopies:
    """An accelerator's copies between the mapped slots (int64 rows) and the cache.

    Between the slots and a device scratch, a batch whose slots lie in long
    runs (a batch saved together got consecutive slots) moves by DMA, one
    copy per run, on the copy engines; scattered slots move with one gather
    or scatter kernel (``Device.copy_rows``). torch's index kernels reading
    host memory held every SM for as long as the link took, so the layerwise
    pipeline ran the forward and them one after the other; ``copy_rows`` runs a few programs that leave the SMs to the
    forward (``link_copy.py``), and DMA none. The scratch <-> paged cache part
    is always a kernel (device memory only, short).
    """

    def __init__(self, mapped: MappedHost, store: SlotStore, layout: BlockLayout, device: Device) -> None:
        words = store.slot_size // _WORD
        self._rows = mapped.tensor.view(torch.int64).view(-1, words)
        self._host = host_tensor(*store.region()).view(torch.int64).view(-1, words)  # the same rows, for DMA
        self._slot_size = store.slot_size
        self._layout = layout
        self._device = device
        self._scatter_stream = device.new_stream()
        # Saves write the slots on a stream of their own, so the next piece's
        # gather out of the cache (device memory) overlaps this one's write
        # across the link instead of running after it.
        self._write_stream = device.new_stream()

    def warm_up(self, layer_sets: Iterable[Sequence[int]]) -> None:
        """The cache's copy kernels, and the link copy both ways between device rows shaped as the
        slots (same width, the payload at the same offset)."""
        self._layout.warm_up(layer_sets)
        a, b = (torch.zeros((1, self._rows.shape[1]), dtype=torch.int64, device=self._rows.device) for _ in "ab")
        index = self._device.indices([0])
        payload = slice(HEADER_BYTES // _WORD, None)
        self._device.copy_rows(a, None, b, index)
        self._device.copy_rows(a[:, payload], index, b[:, payload], None)
        Device.synchronize(self._device.record())

    def to_cache(self, slots: np.ndarray, plan: LoadPlan, layers: Sequence[int]) -> torch.Event:
        """Gather ``slots`` across the link, then scatter row ``plan.row_of[j]`` into block ``plan.block_ids[j]``."""
        n, m = len(slots), len(plan.block_ids)
        if plan.device_index is None:  # once per batch: the same blocks for every layer
            plan.device_index = self._device.indices(np.concatenate((plan.block_ids, plan.row_of)))
        runs = _runs(slots, self._slot_size)
        index = rows = torch.empty((n, self._rows.shape[1]), dtype=torch.int64, device=self._rows.device)
        if runs is None:
            index = self._device.indices(slots)
            self._device.copy_rows(rows, None, self._rows, index)  # across the link
        else:
            for start, end, slot in runs:  # across the link, by DMA
                rows[start:end].copy_(self._host[slot : slot + end - start], non_blocking=True)
        gathered = self._device.record()
        # The on-device scatter runs on a stream of its own, so the next
        # chunk's gather (link-bound) overlaps this one's scatter (memory-bound).
        with self._device.on(self._scatter_stream):
            self._device.wait(gathered, self._scatter_stream)
            if m != n:  # a value shared by several blocks: repeated on the device
                rows = rows.index_select(0, plan.device_index[m:])
            self._layout.scatter(rows.view(torch.uint8)[:, HEADER_BYTES:], plan.device_index[:m], layers)
            _keep_until_done(rows, index, plan.device_index, stream=self._scatter_stream)
            return self._device.record(self._scatter_stream)

    def from_cache(self, block_ids: np.ndarray, slots: np.ndarray, layers: Sequence[int]) -> torch.Event | None:
        n = len(block_ids)
        index = self._device.indices(np.concatenate((block_ids, slots)))
        scratch = self._device.empty(n * self._slot_size).view(torch.int64).view(n, -1)
        self._layout.gather(index[:n], layers, scratch.view(torch.uint8)[:, HEADER_BYTES:])
        gathered = self._device.record()
        runs = _runs(slots, self._slot_size)
        with self._device.on(self._write_stream):
            self._device.wait(gathered, self._write_stream)
            if runs is None:
                payload = slice(HEADER_BYTES // _WORD, None)
                self._device.copy_rows(self._rows[:, payload], index[n:], scratch[:, payload], None)  # across the link
            else:  # whole rows: the headers (scratch bytes here) are written by ``publish`` afterwards
                for start, end, slot in runs:
                    self._host[slot : slot + end - start].copy_(scratch[start:end], non_blocking=True)
            _keep_until_done(scratch, index, stream=self._write_stream)
        return gathered

    def written(self) -> torch.Event | None:
        return self._device.record(self._write_stream)


class _HostCopies:
    """The CPU: each layer plane moves with one ``copy_rows`` call between the slots and the cache."""

    def __init__(self, store: SlotStore, layout: BlockLayout) -> None:
        self._base = store.region()[0] + HEADER_BYTES  # the payload of slot 0
        self._slot_size = store.slot_size
        self._layout = layout

    @staticmethod
    def warm_up(layer_sets: Iterable[Sequence[int]]) -> None:
        host_copy.warm_up()

    def _planes(self, layers: Sequence[int]) -> list[tuple[int, int, int, int]]:
        """(plane base, plane stride, bytes, offset in the payload) of each plane of ``layers``."""
        out, offset = [], 0
        for layer in layers:
            for p in self._layout.planes[layer]:
                out.append((p.base, p.stride, p.size, offset))
                offset += p.size
        return out

    def to_cache(self, slots: np.ndarray, plan: LoadPlan, layers: Sequence[int]) -> None:
        src, dst = slots[plan.row_of], plan.block_ids
        self._check(dst)
        for base, stride, size, offset in self._planes(layers):
            copy_rows(base, stride, dst, self._base + offset, self._slot_size, src, size)

    def from_cache(self, block_ids: np.ndarray, slots: np.ndarray, layers: Sequence[int]) -> None:
        self._check(block_ids)
        for base, stride, size, offset in self._planes(layers):
            copy_rows(self._base + offset, self._slot_size, slots, base, stride, block_ids, size)

    @staticmethod
    def written() -> None:
        return None  # copy_rows has returned: the slots hold the bytes

    def _check(self, block_ids: np.ndarray) -> None:
        # copy_rows does not check bounds: a bad block id must not become a wild write.
        if len(block_ids) and not (0 <= block_ids.min() and block_ids.max() < self._layout.num_blocks):
            raise IndexError(f"block ids outside [0, {self._layout.num_blocks})")


# A DMA pays where it moves at least this much at once: one copy per small value
# runs far below the link's rate (issue 12).
_MIN_DMA_BYTES = 2 << 20
# More copies than this per batch cost the host more than a kernel launch.
_MAX_DMA_RUNS = 64


def _runs(slots: np.ndarray, slot_size: int) -> list[tuple[int, int, int]] | None:
    """[start, end) positions of ``slots`` that are consecutive slots, with the first slot of
    each; None when the runs are too short or too many for DMA to pay."""
    if not len(slots):
        return None
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    if len(starts) > _MAX_DMA_RUNS or len(slots) * slot_size < _MIN_DMA_BYTES * len(starts):
        return None
    ends = np.concatenate((breaks, [len(slots)]))
    return list(zip(starts.tolist(), ends.tolist(), slots[starts].tolist()))


def _keep_until_done(*tensors: torch.Tensor, stream: torch.Stream | None) -> None:
    """Tensors allocated on another stream, used on ``stream``: not reused before its work ends."""
    if stream is not None:
        for t in tensors:
            t.record_stream(stream)


def _host_rows(store: SlotStore) -> np.ndarray:
    """The slots as a numpy ``[slots, slot_size]`` view (torch's fancy indexing of so large a
    view reads a batch's headers orders of magnitude slower than numpy's)."""
    address, nbytes = store.region()
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address)).reshape(-1, store.slot_size)
