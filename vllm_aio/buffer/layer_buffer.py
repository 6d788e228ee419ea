"""The dynamic layer buffer: L layers time-share S device KV buffers.

vLLM's cache was re-planned (``vllm_aio/buffer_plan.py``) so that layer ``l``
lives in device buffer ``l % S`` and every layer's full KV lives here, in host
memory (page-locked on accelerators). Each step the worker makes the step's
blocks of layer ``l`` resident in its buffer before layer ``l`` runs, and
copies the K/V the step wrote back to host before layer ``l + S`` reuses the
buffer.

Ordering, per step (``S = 2``, hooks named as vLLM calls them):

* step start (``begin_step``): apply vLLM's block zeroing and copy-on-write
  copies to the host copy, then load layers ``0 .. S-1`` (after whatever the
  compute stream was given before: vLLM's own block copies in the cache);
* after layer ``l``'s attention (``layer_done``): write back layer ``l``'s
  newly written blocks, then load layer ``l + S`` into the same buffer
  (same stream, and after layer ``l``'s attention even when nothing is
  written back, so the load cannot overtake the write-back or the attention);
* before layer ``l + 1`` writes its K/V (``before_layer``): the compute stream
  waits for that layer's load event (which also follows the buffer's previous
  write-back). Loading inside ``wait_for_layer_load`` would be too late: vLLM
  writes the step's new K/V into the cache before it calls that hook, and the
  load would overwrite them.

Why two buffers suffice: if loading a layer is
faster than its forward, the load of ``l + 1`` is done before it is needed;
if slower, the buffer that load targets was released by ``l - 1`` one layer
earlier. Measured on an H200: S = 2 within 1.12x of max(compute, transfer),
S = 3 or 4 no better (benchmarks/dynamic_buffer.py).

How blocks move (per layer, host copy <-> device buffer; both index blocks
alike, so a block is at the same place in both):

* runs of consecutive block ids worth one copy each (``direct_copy_bytes``
  per plane, 1 MiB: a DMA that large runs near the link's speed, and one
  enqueue costs the forward thread ~10 us) are copied straight between the
  page-locked host copy and the buffer, no host work at all;
* the other blocks, where the device maps host memory (CUDA: the host copy
  registered and viewed as a device tensor), move straight between the host
  copy and the buffer in one kernel per layer, every plane at once
  (``Device.row_swaps``): layer ``l``'s written blocks out, then layer
  ``l + S``'s blocks in. A streamed layer then costs the forward thread two
  events and that launch, no stream switch: 35 us of host time a layer on an
  H200 host, from 90 us with Triton's own launch and a stream switch. On a
  host-bound forward that time is the step's overhead, about one and a half
  times over (the dynamic-buffer benchmark's priority rows);
* elsewhere they pass through staging in chunks: gathered on the host
  (``BlockLayout.gather_planes``: no temporary, spread over threads), one
  host-device copy, one batched scatter per plane on the device; written
  blocks the reverse way. Per-block copies used a fifth of an H200's PCIe
  link; the host gather this replaces (``index_select`` then a copy) ran at
  ~2.5 GB/s on the H200 host.

A staged write-back is completed as soon as its copy has landed (checked at
every ``layer_done`` and whenever staging runs short): scattered into the
host copy and its staging released. ``end_step`` only waits for the rest, in
order, so most scatters overlap the layers still computing.

The host gathers for staged loads run on the forward thread, when
``layer_done`` enqueues the load: the device copies are asynchronous, so a
gather already overlaps the previous layer's transfer and compute; a helper
thread gathering ahead would only also hide it behind the forward thread's
own kernel launches (not done).

Measured on an H200 (benchmarks/dynamic_buffer.py, ``vllm_aio S=2``, block
ids of a fresh cache, so loads mostly in place): 0.94-1.04x the idealised
S = 2 pipeline on every row, from 2.2-22x before.

Resident blocks (``dynamic_buffer_resident_blocks``, ``connector/residency.py``):
the step's ``pinned`` blocks live past vLLM's blocks, at private ids of each
layer's buffer (``BlockRemap.private_base``), and vLLM's tables are pointed
there layer by layer (``block_remap.py``). They are not loaded; a ``promoted``
block is copied from the host copy to its private place in every layer (with
that layer's load), and a written one is copied back from there once, after the
forward (no layer reuses a private place within the step). A step whose blocks
are all pinned does no per-layer copies at all. The host copy covers vLLM's
blocks only.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from vllm_aio.buffer.plan import private_blocks
from vllm_aio.connector.block_layout import BlockLayout
from vllm_aio.buffer.remap import BlockRemap
from vllm_aio.buffer.swaps import RowSwaps
from vllm_aio.connector.metadata import AioConnectorMetadata, BufferStep
from vllm_aio.connector.staging import Slice, StagingBuffer, even_ranges
from vllm_aio.device import Device, HostMemory
from vllm_aio.log import get_logger

logger = get_logger(__name__)


# A run of consecutive blocks whose every plane is at least this large is
# copied in place, host copy <-> device buffer, without staging.
DIRECT_COPY_BYTES = 1 << 20
# At most this many pinned blocks written in a step are written back one copy each.
PINNED_COPY_ROWS = 8
# Each layer's region of the host copy starts on a page.
_HOST_ALIGN = 4096


@dataclass(frozen=True)
class _Chunk:
    ids: torch.Tensor  # CPU int64: the host copy's side
    device_ids: torch.Tensor  # the same ids on the device (moved once per step, used by every layer)
    slots: torch.Tensor | None = None  # pinned blocks: their private slots on the device

    def cache_ids(self, private_base: int) -> torch.Tensor:
        """The blocks' ids in the device cache of a layer whose private blocks start at ``private_base``."""
        return self.device_ids if self.slots is None else self.slots + private_base


@dataclass(frozen=True)
class _Plan:
    """How one step moves a set of blocks in every layer."""

    runs: list[tuple[int, int]]  # [start, stop) of consecutive ids copied in place
    chunks: list[_Chunk]  # the other ids, through staging (or, pinned blocks, by a copy kernel)
    # The other ids where the host copy is mapped: one swap kernel a layer moves them (``RowSwaps``).
    rest: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))


_NOTHING = _Plan([], [])


@dataclass(frozen=True)
class _Pending:
    """Staging lent to a copy on the transfer stream, returned once ``event`` has completed."""

    piece: Slice
    event: torch.Event | None
    finish: Callable[[], None] | None = None  # a write-back's scatter into the host copy


class _PinnedSlots:
    """A step's pinned blocks (``BufferStep.pinned``) as sorted arrays, looked up without a dict
    (a long request pins thousands of blocks, every step)."""

    def __init__(self, pinned: Sequence[tuple[int, int]]) -> None:
        # fromiter: half the time of asarray on a list of pairs
        flat = np.fromiter(itertools.chain.from_iterable(pinned), dtype=np.int64, count=2 * len(pinned))
        pairs = flat.reshape(-1, 2)
        order = np.argsort(pairs[:, 0], kind="stable")
        self.blocks, self._slots = pairs[order, 0], pairs[order, 1]

    def holds(self, blocks: np.ndarray) -> np.ndarray:
        """Which of ``blocks`` are pinned."""
        at = np.minimum(np.searchsorted(self.blocks, blocks), max(len(self.blocks) - 1, 0))
        return self.blocks[at] == blocks if len(self.blocks) else np.zeros(len(blocks), dtype=bool)

    def slots(self, blocks: np.ndarray) -> np.ndarray:
        """The private slots of ``blocks``, every one pinned."""
        return self._slots[np.searchsorted(self.blocks, blocks)]


class LayerBuffer:
    def __init__(
        self, device_caches: Mapping[str, torch.Tensor], layer_names: Sequence[str], num_blocks: int,
        buffers: int, staging_bytes: int, direct_copy_bytes: int = DIRECT_COPY_BYTES, resident_blocks: int = 0,
        block_tokens: int = 0,
    ) -> None:
        """``num_blocks``: the device caches' blocks, the private ones of ``resident_blocks`` (P per
        layer) included; ``block_tokens``: tokens per block (with resident blocks: vLLM's slot mapping)."""
        check_buffers_shared(device_caches, layer_names, buffers)
        first = device_caches[layer_names[0]]
        self.device = Device(first.device)
        # vLLM's blocks; the private ones follow them in the device caches.
        self.num_blocks = num_blocks - private_blocks(len(layer_names), buffers, resident_blocks)
        # The full KV of every layer, one page-locked allocation; vLLM's blocks index it like the device cache.
        self._host_memory, self.host_caches = _host_copy(
            self.device, {n: _first_blocks(device_caches[n], num_blocks, self.num_blocks) for n in layer_names},
            layer_names,
        )
        self._device_layout = BlockLayout(device_caches, layer_names, num_blocks)
        self._host_layout = BlockLayout(self.host_caches, layer_names, self.num_blocks)
        self._remap = None
        self._resident_blocks = resident_blocks
        if resident_blocks:
            self._remap = BlockRemap(self.device, self.num_blocks, resident_blocks, buffers, block_tokens)
        # The host copy as the device's kernels see it, where the device maps host memory.
        mapped = _device_views(self._host_memory, self.host_caches)
        self._mapped_layout = None if mapped is None else BlockLayout(mapped, layer_names, self.num_blocks)
        if self._mapped_layout is not None:  # each layer's planes as the swap kernel takes them
            self._mapped_stacks = [_words(self._mapped_layout.stacked(i)) for i in range(len(layer_names))]
            self._device_stacks = [_words(self._device_layout.stacked(i)) for i in range(len(layer_names))]
            starts = [t.data_ptr() for t in self._mapped_stacks]
            self._host_layer_bytes = starts[1] - starts[0] if len(starts) > 1 else 0
            assert all(b - a == self._host_layer_bytes for a, b in zip(starts, starts[1:])), "layers equally spaced"
        self.buffers = buffers
        self.num_layers = len(layer_names)
        self._stream = self.device.new_stream()
        self._swaps = None  # the step's scattered blocks, written back and loaded (mapped)
        if self._mapped_layout is not None:
            self._swaps = RowSwaps(self.device, self._mapped_stacks, self._device_stacks, self._stream)
        self._staging = StagingBuffer(self.device, staging_bytes)
        # A chunk takes at most a quarter of staging, so loads and write-backs of a few layers fit at once.
        self._chunk_blocks = max(1, staging_bytes // (4 * max(self._host_layout.layer_bytes(0), 1)))
        smallest_plane = min(p.size for planes in self._host_layout.planes for p in planes)
        self._min_run = max(1, -(-direct_copy_bytes // max(smallest_plane, 1)))
        self._pending: deque[_Pending] = deque()  # oldest first: events on one stream complete in order
        self._loaded: dict[int, torch.Event | None] = {}
        self._layer_names = list(layer_names)
        self._pinned_before = False  # the first resident step is logged
        self._resident = self._written = self._promoted = _NOTHING
        self._pinned = _PinnedSlots([])  # the step's pinned blocks and their slots
        self._pinned_list: list[tuple[int, int]] = []  # as the step named them
        self._pinned_ids: tuple[torch.Tensor, torch.Tensor] | None = None  # their blocks and slots on the device
        self._pinned_rows: list[tuple[int, int]] = []  # the step's written pinned blocks: (block id, slot)
        self._streams = False

    @property
    def host_bytes(self) -> int:
        return sum(t.nbytes for t in self.host_caches.values())

    # ---- per step ----------------------------------------------------------
    def begin_step(self, step: BufferStep, forward_context: object = None) -> None:
        """``forward_context``: vLLM's, whose tables point at the pinned blocks during the step."""
        self._drain()  # a step that ended without end_step: the host copy must be settled
        if self._remap is not None:
            self._remap.end()  # and vLLM's tables its own
        self._apply_block_updates(step)
        # vLLM's own cache updates (block copies) on the compute stream come before our loads.
        self.device.wait(self.device.record(), self._stream)
        if step.pinned != self._pinned_list:  # a decode keeps its pinned blocks from step to step
            self._pinned, self._pinned_list = _PinnedSlots(step.pinned), step.pinned
            blocks = self._pinned.blocks
            # vLLM's tables are rewritten on the compute stream, where they are read.
            self._pinned_ids = (self.device.indices(blocks), self.device.indices(self._pinned.slots(blocks)))
        pinned = self._pinned
        written = np.asarray(step.written, dtype=np.int64)
        kept = pinned.holds(written)
        with self.device.on(self._stream):  # the step's device ids live on the transfer stream
            self._resident = self._plan(step.resident)
            self._written = self._plan(written[~kept])
            if self._swaps is not None:
                self._swaps.plan(self._written.rest, self._resident.rest)
            self._promoted = self._pinned_plan(np.asarray(step.promoted, dtype=np.int64))
        rows = np.unique(written[kept])
        self._pinned_rows = list(zip(rows.tolist(), pinned.slots(rows).tolist()))
        if step.pinned:
            if self._remap is None:
                raise RuntimeError("dynamic buffer: pinned blocks without dynamic_buffer_resident_blocks")
            if not self._pinned_before:
                logger.info("vllm_aio: dynamic buffer: first resident step: %d blocks kept on the device in "
                            "every layer, %d filled from host memory", len(step.pinned), len(step.promoted))
                self._pinned_before = True
            self._remap.begin(*self._pinned_ids)
            self._remap.attach(forward_context, self._layer_names)
        self._loaded.clear()
        # Whether the layers move blocks: a step whose blocks are all pinned (and none promoted) needs
        # no per-layer copies or events; the forward thread then only points the tables at each pass.
        self._streams = any((self._resident.runs, self._resident.chunks, len(self._resident.rest),
                             self._written.runs, self._written.chunks, len(self._written.rest), self._promoted.chunks))
        if self._streams:
            for layer in range(min(self.buffers, self.num_layers)):
                self._move(None, layer)
        self.before_layer(0)

    def before_layer(self, layer: int) -> None:
        """Order layer ``layer``'s compute after its load (no host wait on accelerators), and
        point vLLM's tables at the layer's private blocks."""
        self.device.wait(self._loaded.pop(layer, None))
        if self._remap is not None and layer < self.num_layers:
            self._remap.apply(layer)

    def layer_done(self, layer: int) -> None:
        """Layer ``layer`` has written its K/V: save them, then reuse its buffer."""
        if not self._streams:  # every block of the step is pinned: the layers need no copies
            return
        self._retire()  # earlier write-backs that have landed: into the host copy now
        following = layer + self.buffers
        self._move(layer, following if following < self.num_layers else None)

    def end_step(self) -> None:
        """Host memory holds every block the step wrote (the pool may read it); vLLM's tables are its own."""
        self._write_back_pinned()
        if self._remap is not None:
            self._remap.end()
        self._drain()

    def close(self) -> None:
        """Wait for every copy, then release the page-locked host copy (views stay readable, unpinned)."""
        self._drain()
        self._host_memory.release()

    def _drain(self) -> None:
        self._retire(wait=True)
        # In-place write-backs land in the host copy without staging: wait for the stream itself.
        self.device.synchronize(self.device.record(self._stream))

    def _apply_block_updates(self, step: BufferStep) -> None:
        every = range(self.num_layers)
        if step.zeroed:
            for plane in (p for layer in every for p in self._host_layout.planes[layer]):
                plane.blocks.index_fill_(0, torch.tensor(step.zeroed, dtype=torch.int64), 0)
        if step.copies:
            src = torch.tensor([s for s, _ in step.copies], dtype=torch.int64)
            dst = torch.tensor([d for _, d in step.copies], dtype=torch.int64)
            for layer in every:
                rows = torch.empty(len(src) * self._host_layout.layer_bytes(layer), dtype=torch.uint8)
                self._host_layout.gather_planes(src, layer, rows)
                self._host_layout.scatter_planes(rows, dst, layer)

    def _plan(self, block_ids: Sequence[int]) -> _Plan:
        """Split the step's blocks into in-place runs and the rest (same for every layer): staged
        chunks, or, where the host copy is mapped, ids for the step's swap kernel."""
        runs, rest = _runs(block_ids, self._min_run)
        if self._mapped_layout is not None:
            return _Plan(runs, [], rest.numpy())
        chunks = [_Chunk(ids, self._to_device(ids)) for ids in _even_chunks(rest, self._chunk_blocks)]
        return _Plan(runs, chunks)

    def _pinned_plan(self, block_ids: np.ndarray) -> _Plan:
        """The step's pinned blocks ``block_ids``, moved between the host copy and their private
        places (never in place)."""
        if not len(block_ids):
            return _NOTHING
        unique = np.unique(block_ids)
        ids, slots = torch.from_numpy(unique), torch.from_numpy(self._pinned.slots(unique))
        chunks = [
            _Chunk(ids[a:b], self._to_device(ids[a:b]), self._to_device(slots[a:b]))
            for a, b in even_ranges(len(ids), self._chunk_blocks)
        ]
        return _Plan([], chunks)

    # ---- copies ------------------------------------------------------------
    def _move(self, done: int | None, load: int | None) -> None:
        """Write back layer ``done``'s blocks, then load layer ``load`` into the buffer it leaves
        (either may be None: the first and the last layers of a step)."""
        if self._mapped_layout is None:
            if done is not None:
                self._write_back(done)
            if load is not None:
                self._load(load)
            return
        # The host copy is mapped: two events and one swap kernel a layer, the forward thread's whole
        # cost of a streamed layer (with a copy per run of consecutive blocks).
        if done is not None:
            # Even with nothing to write back: the next load into this buffer must follow the attention.
            self.device.wait(self.device.record(), self._stream)
            if self._written.runs:
                with self.device.on(self._stream):
                    self._copy_runs(self._written.runs, done, to_host=True)
        self._swaps.swap(done, load)
        if load is None:
            return
        if self._resident.runs or self._promoted.chunks:
            with self.device.on(self._stream):
                self._copy_runs(self._resident.runs, load, to_host=False)
                self._copy_in_mapped(load, self._promoted.chunks)
        self._loaded[load] = self.device.record(self._stream)

    def _copy_runs(self, runs: Sequence[tuple[int, int]], layer: int, to_host: bool) -> None:
        """Runs of consecutive blocks, one DMA copy each per plane, on the current stream."""
        for start, stop in runs:
            for d, h in zip(self._device_layout.planes[layer], self._host_layout.planes[layer]):
                dst, src = (h, d) if to_host else (d, h)
                dst.blocks[start:stop].copy_(src.blocks[start:stop], non_blocking=True)

    def _copy_in_mapped(self, layer: int, chunks: Sequence[_Chunk]) -> None:
        """Chunks of blocks from the mapped host copy into the layer's device cache, a kernel per plane."""
        base = self._private_base(layer)
        for chunk in chunks:
            cache_ids = chunk.cache_ids(base)
            for d, m in zip(self._device_layout.planes[layer], self._mapped_layout.planes[layer]):
                self.device.copy_rows(_words(d.blocks), cache_ids, _words(m.blocks), chunk.device_ids)

    def _load(self, layer: int) -> None:
        """Staged: the layer's blocks gathered on the host, one copy per chunk, scattered on the device."""
        host, dev = self._host_layout.planes[layer], self._device_layout.planes[layer]
        base = self._private_base(layer)
        chunks = [*self._resident.chunks, *self._promoted.chunks]
        with self.device.on(self._stream):
            self._copy_runs(self._resident.runs, layer, to_host=False)
        for chunk in chunks:
            n = len(chunk.ids)
            piece = self._slice(n * self._host_layout.layer_bytes(layer))
            self._host_layout.gather_planes(chunk.ids, layer, piece.tensor)
            with self.device.on(self._stream):
                if self.device.is_host:
                    self._device_layout.scatter_planes(piece.tensor, chunk.cache_ids(base), layer)
                else:
                    staged, cache_ids = self._to_device(piece.tensor), chunk.cache_ids(base)
                    for d, rows in zip(dev, self._device_layout.plane_rows(layer, staged, n)):
                        d.blocks.index_copy_(0, cache_ids, rows)
                event = self.device.record(self._stream)
            self._pending.append(_Pending(piece, event))
        # Recorded even with nothing loaded: the layer's compute must still follow
        # the write-back of the layer that used this buffer before.
        self._loaded[layer] = self.device.record(self._stream)

    def _write_back(self, layer: int) -> None:
        """Staged: the layer's written blocks out of its buffer (``_copy_out``)."""
        computed = self.device.record()  # the compute stream, after this layer's attention
        with self.device.on(self._stream):
            # Even with nothing to write back: the next load into this buffer must follow the attention.
            self.device.wait(computed, self._stream)
            self._copy_runs(self._written.runs, layer, to_host=True)
        self._copy_out(layer, self._written.chunks)

    def _write_back_pinned(self) -> None:
        """The pinned blocks the step wrote, every layer at once after the forward: no layer reuses
        their private places within the step, and the next step starts after ``end_step``."""
        if not self._pinned_rows:
            return
        self.device.wait(self.device.record(), self._stream)
        if len(self._pinned_rows) > PINNED_COPY_ROWS:
            with self.device.on(self._stream):  # the plan's device ids live on the transfer stream
                chunks = self._pinned_plan(np.array([b for b, _ in self._pinned_rows], dtype=np.int64)).chunks
            for layer in range(self.num_layers):
                self._copy_out(layer, chunks)
            return
        if self._mapped_layout is not None:
            # A few blocks (decodes), the host copy mapped: one strided copy per block and buffer
            # covers every layer on that buffer (its private places are P blocks apart).
            with self.device.on(self._stream):
                for block, slot in self._pinned_rows:
                    for buffer in range(min(self.buffers, self.num_layers)):
                        self._host_rows_of(buffer, block).copy_(self._private_rows_of(buffer, slot))
            return
        # A few blocks, staged: one DMA copy per block and plane, no index kernels (three launches a layer).
        with self.device.on(self._stream):
            for layer in range(self.num_layers):
                base = self._private_base(layer)
                for h, d in zip(self._host_layout.planes[layer], self._device_layout.planes[layer]):
                    for block, slot in self._pinned_rows:
                        h.blocks[block].copy_(d.blocks[base + slot], non_blocking=True)

    def _private_rows_of(self, buffer: int, slot: int) -> torch.Tensor:
        """Private slot ``slot`` of every layer on ``buffer``: ``[layers, planes, width]`` (a device view)."""
        stack = self._device_stacks[buffer]
        planes, row = stack.stride(0), stack.stride(1)
        layers = len(range(buffer, self.num_layers, self.buffers))
        offset = stack.storage_offset() + (self._private_base(buffer) + slot) * row
        return stack.as_strided((layers, stack.shape[0], stack.shape[2]), (self._resident_blocks * row, planes, 1),
                                offset)

    def _host_rows_of(self, buffer: int, block: int) -> torch.Tensor:
        """Block ``block`` of every layer on ``buffer`` in the mapped host copy: ``[layers, planes, width]``.
        ``_host_copy`` spaces the layers equally."""
        stack = self._mapped_stacks[buffer]
        planes, row = stack.stride(0), stack.stride(1)
        layers = len(range(buffer, self.num_layers, self.buffers))
        step = self.buffers * self._host_layer_bytes // stack.element_size()
        return stack.as_strided((layers, stack.shape[0], stack.shape[2]), (step, planes, 1),
                                stack.storage_offset() + block * row)

    def _copy_out(self, layer: int, chunks: Sequence[_Chunk]) -> None:
        """Scattered blocks of ``layer`` into the host copy, on the transfer stream (after what it waits for)."""
        dev, base = self._device_layout.planes[layer], self._private_base(layer)
        if self._mapped_layout is not None:  # a kernel writes the host copy
            with self.device.on(self._stream):
                for chunk in chunks:
                    cache_ids = chunk.cache_ids(base)
                    for d, m in zip(dev, self._mapped_layout.planes[layer]):
                        self.device.copy_rows(_words(m.blocks), chunk.device_ids, _words(d.blocks), cache_ids)
            return
        for chunk in chunks:
            n = len(chunk.ids)
            piece = self._slice(n * self._host_layout.layer_bytes(layer))
            with self.device.on(self._stream):
                if self.device.is_host:
                    self._device_layout.gather_planes(chunk.cache_ids(base), layer, piece.tensor)
                else:
                    scratch, cache_ids = self.device.empty(piece.tensor.numel()), chunk.cache_ids(base)
                    for d, rows in zip(dev, self._device_layout.plane_rows(layer, scratch, n)):
                        torch.index_select(d.blocks, 0, cache_ids, out=rows)
                    piece.tensor.copy_(scratch, non_blocking=True)
                event = self.device.record(self._stream)
            scatter = partial(self._host_layout.scatter_planes, piece.tensor, chunk.ids, layer)
            self._pending.append(_Pending(piece, event, scatter))

    def _private_base(self, layer: int) -> int:
        return self._remap.private_base(layer) if self._remap is not None else self.num_blocks

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        # From page-locked memory: see Device.indices.
        return host if self.device.is_host else host.pin_memory().to(self.device.torch_device, non_blocking=True)

    # ---- staging -----------------------------------------------------------
    def _slice(self, nbytes: int) -> Slice:
        """Staging for one chunk; completes the oldest copies when it runs out."""
        while True:
            self._retire()
            piece = self._staging.allocate(nbytes, 0)
            if piece is not None:
                return piece
            if not self._pending:
                raise RuntimeError(f"staging_buffer_size too small for {nbytes} bytes of one layer chunk")
            self._retire_oldest()

    def _retire(self, wait: bool = False) -> None:
        """Complete the copies that have landed (all of them, waiting, if ``wait``), oldest first."""
        while self._pending and (wait or Device.completed(self._pending[0].event)):
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        pending = self._pending.popleft()
        try:
            self.device.synchronize(pending.event)
            if pending.finish is not None:
                pending.finish()
        finally:
            self._staging.release(pending.piece)


class BufferHooks:
    """The buffer as one participant of the worker's per-step hooks.

    Each hook runs only in steps the scheduler planned for the buffer (vLLM
    also runs forwards without connector metadata, e.g. to profile).
    """

    def __init__(self, buffer: LayerBuffer, layer_names: Sequence[str]) -> None:
        self.buffer = buffer
        self._index = {name: i for i, name in enumerate(layer_names)}

    def begin_step(self, meta: AioConnectorMetadata, forward_context: object = None) -> None:
        if meta.buffer is not None:
            self.buffer.begin_step(meta.buffer, forward_context)

    def after_layer(self, layer_name: str, meta: AioConnectorMetadata) -> None:
        if meta.buffer is not None and layer_name in self._index:
            layer = self._index[layer_name]
            self.buffer.layer_done(layer)
            self.buffer.before_layer(layer + 1)

    def end_step(self, meta: AioConnectorMetadata) -> None:
        if meta.buffer is not None:
            self.buffer.end_step()  # saves read the host copy after this

    def close(self) -> None:
        self.buffer.close()


class NoBuffer:
    """Every layer resident on the device: the hooks have nothing to do."""

    def begin_step(self, meta: AioConnectorMetadata, forward_context: object = None) -> None:
        pass

    def after_layer(self, layer_name: str, meta: AioConnectorMetadata) -> None:
        pass

    def end_step(self, meta: AioConnectorMetadata) -> None:
        pass

    def close(self) -> None:
        pass


def check_buffers_shared(caches: Mapping[str, torch.Tensor], layer_names: Sequence[str], buffers: int) -> None:
    """Refuse caches that vLLM did not lay out for the buffer: layer ``l`` must be buffer ``l % S``'s
    memory (``buffer_plan.py``). Unshared, every layer keeps KV memory of its own: the buffer would
    stream nothing, and vLLM would run on the blocks of a cache that was never re-planned."""
    for name in layer_names:
        if not isinstance(caches[name], torch.Tensor):
            raise ValueError(
                f"dynamic_buffer_layers: layer {name}'s KV cache is {type(caches[name]).__name__} of tensors, as "
                "vllm-ascend's NPU runner allocates it; the buffer lays out vLLM's own allocation (one tensor a "
                "layer), which vllm-ascend replaces: use another transfer mode there"
            )
    for i, name in enumerate(layer_names[buffers:], start=buffers):
        first = layer_names[i % buffers]
        if caches[name].data_ptr() != caches[first].data_ptr():
            raise ValueError(
                f"dynamic_buffer_layers: layer {name} is not the memory of buffer {i % buffers} ({first}): "
                "vLLM did not re-plan its KV cache for the buffer. The vllm_aio_buffer_plan plugin does, "
                "in every vLLM process, when the package is installed and, with VLLM_PLUGINS set, that "
                "list names vllm_aio_buffer_plan"
            )


def _host_copy(
    device: Device, caches: Mapping[str, torch.Tensor], names: Sequence[str]
) -> tuple[HostMemory, dict[str, torch.Tensor]]:
    """One host allocation for every layer's full KV, viewed per layer (contiguous, the caches' shapes).

    One allocation, not one per layer: page-locking costs per call, and
    ``Device.host_memory`` takes exactly the bytes asked for.
    """
    offsets, end = [], 0
    for name in names:
        offsets.append(end)
        end += -(-caches[name].nbytes // _HOST_ALIGN) * _HOST_ALIGN
    memory = device.host_memory(end)
    views = {}
    for name, offset in zip(names, offsets):
        cache = caches[name]
        views[name] = memory.tensor[offset : offset + cache.nbytes].view(cache.dtype).view(cache.shape)
    return memory, views


def _device_views(memory: HostMemory, host_caches: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Each layer's host copy as a tensor on the device (same bytes, mapped), or None where unmapped."""
    whole = memory.device_view()
    if whole is None:
        return None
    base = memory.tensor.data_ptr()
    views = {}
    for name, t in host_caches.items():
        offset = t.data_ptr() - base
        views[name] = whole[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
    return views


def _first_blocks(cache: torch.Tensor, num_blocks: int, keep: int) -> torch.Tensor:
    """``cache``'s first ``keep`` of ``num_blocks`` blocks (``[num_blocks, ...]`` or ``[2, num_blocks, ...]``)."""
    if keep == num_blocks:
        return cache
    return cache[:keep] if cache.shape[0] == num_blocks else cache[:, :keep]


def _words(rows: torch.Tensor) -> torch.Tensor:
    """``[..., n, bytes]`` rows as int64 words where they allow it: kernels reading or writing
    mapped host memory move 8 bytes per access instead of 1."""
    if rows.shape[-1] % 8 == 0 and all(s % 8 == 0 for s in rows.stride()[:-1]) and rows.data_ptr() % 8 == 0:
        return rows.view(torch.int64)
    return rows


def _runs(block_ids: Sequence[int], min_run: int) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """The distinct ids as [start, stop) runs of at least ``min_run`` consecutive ids, and the rest (sorted)."""
    ids = np.unique(np.asarray(block_ids, dtype=np.int64))
    if not len(ids):
        return [], torch.empty(0, dtype=torch.int64)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [len(ids)]))
    long = stops - starts >= min_run
    runs = [(int(ids[a]), int(ids[b - 1]) + 1) for a, b in zip(starts[long], stops[long])]
    rest = ids[np.repeat(~long, stops - starts)]
    return runs, torch.from_numpy(rest)


def _even_chunks(ids: torch.Tensor, max_rows: int) -> list[torch.Tensor]:
    """``ids`` in as few chunks of at most ``max_rows`` as possible, of nearly equal sizes (none for no ids)."""
    return [ids[a:b] for a, b in even_ranges(len(ids), max_rows)]
