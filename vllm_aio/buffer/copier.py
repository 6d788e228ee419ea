"""The dynamic buffer's copies between the host copy and the device buffers, on a transfer stream.

How blocks move (per layer; host copy and buffer index blocks alike):

* runs of consecutive block ids worth one copy each (``DIRECT_COPY_BYTES`` per
  plane: a DMA that large runs near the link's speed, and each enqueue costs
  the forward thread host time) are copied straight between the page-locked
  host copy and the buffer, no host work at all;
* the other blocks, where the device maps host memory (CUDA), move straight
  between the mapped host copy and the buffer in one kernel per layer, every
  plane at once (``swaps.RowSwaps``): layer ``l``'s written blocks out, then
  layer ``l + S``'s blocks in, two events and that launch of the forward
  thread's time a layer, no stream switch;
* elsewhere they pass through staging in chunks: gathered on the host
  (``BlockLayout.gather_planes``: no temporary, spread over threads), one
  host-device copy, one batched scatter per plane on the device; written
  blocks the reverse way. A staged write-back is completed (scattered into the
  host copy, its staging released) as soon as its copy has landed, so most
  scatters overlap the layers still computing.

The host gathers for staged loads run on the forward thread when the load is
enqueued: the device copies are asynchronous, so a gather already overlaps the
previous layer's transfer and compute.

Pinned blocks (``remap.py``) live at private places of each layer's buffer:
promoted ones are copied in with every layer's load, written ones back once
after the forward (no layer reuses a private place within the step).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from vllm_aio.buffer.host_kv import HostKV, words
from vllm_aio.buffer.steps import Blocks, Pinned, StepPlan
from vllm_aio.buffer.swaps import RowSwaps
from vllm_aio.device.accelerator import Device
from vllm_aio.device.block_layout import BlockLayout
from vllm_aio.device.staging import Slice, StagingBuffer, even_ranges

# A run of consecutive blocks whose every plane is at least this large is
# copied in place, host copy <-> device buffer, without staging.
DIRECT_COPY_BYTES = 1 << 20
# At most this many pinned blocks written in a step are written back one copy each.
PINNED_COPY_ROWS = 8


@dataclass(frozen=True)
class _Chunk:
    ids: torch.Tensor  # CPU int64: the host copy's side
    device_ids: torch.Tensor  # the same ids on the device (moved once per step, used by every layer)
    slots: torch.Tensor | None = None  # pinned blocks: their private slots on the device

    def cache_ids(self, private_base: int) -> torch.Tensor:
        """The blocks' ids in the device cache of a layer whose private blocks start at ``private_base``."""
        return self.device_ids if self.slots is None else self.slots + private_base


@dataclass(frozen=True)
class _Moves:
    """``Blocks`` with their device ids: runs, and staged chunks (none where the swap kernel moves the rest)."""

    runs: list[tuple[int, int]] = field(default_factory=list)
    chunks: list[_Chunk] = field(default_factory=list)


@dataclass(frozen=True)
class _Pending:
    """Staging lent to a copy on the transfer stream, returned once ``event`` has completed."""

    piece: Slice
    event: torch.Event | None
    finish: Callable[[], None] | None = None  # a write-back's scatter into the host copy


class _Staging:
    """Staging lent to the transfer stream's copies, oldest first (events on one stream complete in order)."""

    def __init__(self, device: Device, nbytes: int) -> None:
        self._device, self._buffer = device, StagingBuffer(device, nbytes)
        self._pending: deque[_Pending] = deque()

    def slice(self, nbytes: int) -> Slice:
        """Staging for one chunk; completes the oldest copies when it runs out."""
        while True:
            self.retire()
            piece = self._buffer.allocate(nbytes, 0)
            if piece is not None:
                return piece
            if not self._pending:
                raise RuntimeError(f"staging_buffer_size too small for {nbytes} bytes of one layer chunk")
            self._retire_oldest()

    def lend(self, piece: Slice, event: torch.Event | None, finish: Callable[[], None] | None = None) -> None:
        self._pending.append(_Pending(piece, event, finish))

    def retire(self, wait: bool = False) -> None:
        """Complete the copies that have landed (all of them, waiting, if ``wait``), oldest first."""
        while self._pending and (wait or Device.completed(self._pending[0].event)):
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        pending = self._pending.popleft()
        try:
            self._device.synchronize(pending.event)
            if pending.finish is not None:
                pending.finish()
        finally:
            self._buffer.release(pending.piece)


class Copier:
    def __init__(self, device: Device, host: HostKV, device_layout: BlockLayout, buffers: int, staging_bytes: int,
                 private_base: Callable[[int], int], resident_blocks: int = 0,
                 direct_copy_bytes: int = DIRECT_COPY_BYTES) -> None:
        """``private_base(layer)``: the layer's first private block id in its buffer, ``resident_blocks``
        (P) of them for each layer."""
        self.device, self._host, self._dev = device, host.layout, device_layout
        # The swap kernel takes a layer's planes as one strided tensor: not where a layer's tensors are
        # separate allocations on the device (vllm-ascend's (k, v)); those blocks are staged.
        stack = all(device_layout.stackable(i) for i in range(len(device_layout.planes)))
        self._mapped = host.mapped_layout if stack else None
        self._buffers, self._layers = buffers, len(device_layout.planes)
        self._private_base, self._resident_blocks = private_base, resident_blocks
        self.stream = device.new_stream()
        self._swaps = None  # the step's scattered blocks, written back and loaded (mapped)
        if self._mapped is not None:  # each layer's planes as the swap kernel takes them
            self._mapped_stacks = [words(self._mapped.stacked(i)) for i in range(self._layers)]
            self._device_stacks = [words(self._dev.stacked(i)) for i in range(self._layers)]
            starts = [t.data_ptr() for t in self._mapped_stacks]
            self._host_layer_bytes = starts[1] - starts[0] if len(starts) > 1 else 0
            assert all(b - a == self._host_layer_bytes for a, b in zip(starts, starts[1:])), "layers equally spaced"
            self._swaps = RowSwaps(device, self._mapped_stacks, self._device_stacks, self.stream)
        self._staging = _Staging(device, staging_bytes)
        # A chunk takes at most a quarter of staging, so loads and write-backs of a few layers fit at once.
        self._chunk_blocks = max(1, staging_bytes // (4 * max(self._host.layer_bytes(0), 1)))
        smallest_plane = min(p.size for planes in self._host.planes for p in planes)
        self.min_run = max(1, -(-direct_copy_bytes // max(smallest_plane, 1)))
        self._loads = self._writes = self._promoted = _Moves()
        self._pinned_written = Pinned(np.empty(0, np.int64), np.empty(0, np.int64))

    def prepare(self, plan: StepPlan) -> None:
        """The step's device ids, on the transfer stream, where they are read."""
        with self.device.on(self.stream):
            self._loads, self._writes = self._moves(plan.loads), self._moves(plan.write_backs)
            if self._swaps is not None:
                self._swaps.plan(plan.write_backs.rest, plan.loads.rest)
            self._promoted = self._pinned_moves(plan.promoted)
        self._pinned_written = plan.pinned_written

    def move(self, done: int | None, load: int | None) -> torch.Event | None:
        """Write back layer ``done``'s blocks, then load layer ``load`` into the buffer it leaves
        (either may be None: the first and the last layers of a step); the event ``load``'s compute
        waits for (recorded even with nothing loaded: it must follow the buffer's write-back)."""
        if self._mapped is None:
            if done is not None:
                self._write_back(done)
            return self._load(load) if load is not None else None
        if done is not None:
            # Even with nothing to write back: the next load into this buffer must follow the attention.
            self.device.wait(self.device.record(), self.stream)
            if self._writes.runs:
                with self.device.on(self.stream):
                    self._copy_runs(self._writes.runs, done, to_host=True)
        self._swaps.swap(done, load)
        if load is None:
            return None
        if self._loads.runs or self._promoted.chunks:
            with self.device.on(self.stream):
                self._copy_runs(self._loads.runs, load, to_host=False)
                self._copy_in_mapped(load, self._promoted.chunks)
        return self.device.record(self.stream)

    def write_back_pinned(self) -> None:
        """The pinned blocks the step wrote, every layer at once after the forward."""
        rows = self._pinned_written
        if not len(rows):
            return
        self.device.wait(self.device.record(), self.stream)
        if len(rows) > PINNED_COPY_ROWS:
            with self.device.on(self.stream):  # the chunks' device ids live on the transfer stream
                chunks = self._pinned_moves(rows).chunks
            for layer in range(self._layers):
                self._copy_out(layer, chunks)
            return
        with self.device.on(self.stream):
            if self._mapped is not None:
                # A few blocks (decodes), the host copy mapped: one strided copy per block and buffer
                # covers every layer on that buffer (its private places are P blocks apart).
                for block, slot in rows.pairs():
                    for buffer in range(min(self._buffers, self._layers)):
                        self._host_rows_of(buffer, block).copy_(self._private_rows_of(buffer, slot))
                return
            # A few blocks, staged: one DMA copy per block and plane, no index kernels.
            for layer in range(self._layers):
                base = self._private_base(layer)
                for h, d in zip(self._host.planes[layer], self._dev.planes[layer]):
                    for block, slot in rows.pairs():
                        h.blocks[block].copy_(d.blocks[base + slot], non_blocking=True)

    def retire(self) -> None:
        """Earlier write-backs that have landed: into the host copy now."""
        self._staging.retire()

    def drain(self) -> None:
        self._staging.retire(wait=True)
        # In-place write-backs land in the host copy without staging: wait for the stream itself.
        self.device.synchronize(self.device.record(self.stream))

    # ---- plans ---------------------------------------------------------------
    def _moves(self, blocks: Blocks) -> _Moves:
        if self._mapped is not None:  # the swap kernel moves the rest
            return _Moves(blocks.runs)
        rest = torch.from_numpy(blocks.rest)
        return _Moves(blocks.runs, [_Chunk(rest[a:b], self._to_device(rest[a:b]))
                                    for a, b in even_ranges(len(rest), self._chunk_blocks)])

    def _pinned_moves(self, pinned: Pinned) -> _Moves:
        """Pinned blocks, moved between the host copy and their private places (never in place)."""
        ids, slots = torch.from_numpy(pinned.blocks), torch.from_numpy(pinned.slots)
        return _Moves([], [_Chunk(ids[a:b], self._to_device(ids[a:b]), self._to_device(slots[a:b]))
                           for a, b in even_ranges(len(ids), self._chunk_blocks)])

    # ---- copies ------------------------------------------------------------
    def _copy_runs(self, runs: Sequence[tuple[int, int]], layer: int, to_host: bool) -> None:
        """Runs of consecutive blocks, one DMA copy each per plane, on the current stream."""
        for start, stop in runs:
            for d, h in zip(self._dev.planes[layer], self._host.planes[layer]):
                dst, src = (h, d) if to_host else (d, h)
                dst.blocks[start:stop].copy_(src.blocks[start:stop], non_blocking=True)

    def _copy_in_mapped(self, layer: int, chunks: Sequence[_Chunk]) -> None:
        """Chunks of blocks from the mapped host copy into the layer's device cache, a kernel per plane."""
        base = self._private_base(layer)
        for chunk in chunks:
            cache_ids = chunk.cache_ids(base)
            for d, m in zip(self._dev.planes[layer], self._mapped.planes[layer]):
                self.device.copy_rows(words(d.blocks), cache_ids, words(m.blocks), chunk.device_ids)

    def _load(self, layer: int) -> torch.Event | None:
        """Staged: the layer's blocks gathered on the host, one copy per chunk, scattered on the device."""
        host, dev = self._host, self._dev
        base = self._private_base(layer)
        with self.device.on(self.stream):
            self._copy_runs(self._loads.runs, layer, to_host=False)
        for chunk in [*self._loads.chunks, *self._promoted.chunks]:
            n = len(chunk.ids)
            piece = self._staging.slice(n * host.layer_bytes(layer))
            host.gather_planes(chunk.ids, layer, piece.tensor)
            with self.device.on(self.stream):
                if self.device.is_host:
                    dev.scatter_planes(piece.tensor, chunk.cache_ids(base), layer)
                else:
                    staged, cache_ids = self._to_device(piece.tensor), chunk.cache_ids(base)
                    for d, rows in zip(dev.planes[layer], dev.plane_rows(layer, staged, n)):
                        d.blocks.index_copy_(0, cache_ids, rows)
                event = self.device.record(self.stream)
            self._staging.lend(piece, event)
        return self.device.record(self.stream)

    def _write_back(self, layer: int) -> None:
        """Staged: the layer's written blocks out of its buffer (``_copy_out``)."""
        computed = self.device.record()  # the compute stream, after this layer's attention
        with self.device.on(self.stream):
            # Even with nothing to write back: the next load into this buffer must follow the attention.
            self.device.wait(computed, self.stream)
            self._copy_runs(self._writes.runs, layer, to_host=True)
        self._copy_out(layer, self._writes.chunks)

    def _copy_out(self, layer: int, chunks: Sequence[_Chunk]) -> None:
        """Scattered blocks of ``layer`` into the host copy, on the transfer stream (after what it waits for)."""
        dev, base = self._dev.planes[layer], self._private_base(layer)
        if self._mapped is not None:  # a kernel writes the host copy
            with self.device.on(self.stream):
                for chunk in chunks:
                    cache_ids = chunk.cache_ids(base)
                    for d, m in zip(dev, self._mapped.planes[layer]):
                        self.device.copy_rows(words(m.blocks), chunk.device_ids, words(d.blocks), cache_ids)
            return
        for chunk in chunks:
            n = len(chunk.ids)
            piece = self._staging.slice(n * self._host.layer_bytes(layer))
            with self.device.on(self.stream):
                if self.device.is_host:
                    self._dev.gather_planes(chunk.cache_ids(base), layer, piece.tensor)
                else:
                    scratch, cache_ids = self.device.empty(piece.tensor.numel()), chunk.cache_ids(base)
                    for d, rows in zip(dev, self._dev.plane_rows(layer, scratch, n)):
                        torch.index_select(d.blocks, 0, cache_ids, out=rows)
                    piece.tensor.copy_(scratch, non_blocking=True)
                event = self.device.record(self.stream)
            self._staging.lend(piece, event, partial(self._host.scatter_planes, piece.tensor, chunk.ids, layer))

    def _private_rows_of(self, buffer: int, slot: int) -> torch.Tensor:
        """Private slot ``slot`` of every layer on ``buffer``: ``[layers, planes, width]`` (a device view)."""
        stack = self._device_stacks[buffer]
        planes, row = stack.stride(0), stack.stride(1)
        layers = len(range(buffer, self._layers, self._buffers))
        offset = stack.storage_offset() + (self._private_base(buffer) + slot) * row
        return stack.as_strided((layers, stack.shape[0], stack.shape[2]), (self._resident_blocks * row, planes, 1),
                                offset)

    def _host_rows_of(self, buffer: int, block: int) -> torch.Tensor:
        """Block ``block`` of every layer on ``buffer`` in the mapped host copy: ``[layers, planes, width]``
        (``HostKV`` spaces the layers equally)."""
        stack = self._mapped_stacks[buffer]
        planes, row = stack.stride(0), stack.stride(1)
        layers = len(range(buffer, self._layers, self._buffers))
        step = self._buffers * self._host_layer_bytes // stack.element_size()
        return stack.as_strided((layers, stack.shape[0], stack.shape[2]), (step, planes, 1),
                                stack.storage_offset() + block * row)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        # From page-locked memory: see Device.indices.
        return host if self.device.is_host else host.pin_memory().to(self.device.torch_device, non_blocking=True)
