"""The dynamic layer buffer: L layers time-share S device KV buffers.

vLLM's cache was re-planned (``vllm_aio/buffer_plan.py``) so that layer ``l``
lives in device buffer ``l % S`` and every layer's full KV lives here, in host
memory (page-locked on accelerators). Each step the worker makes the step's
blocks of layer ``l`` resident in its buffer before layer ``l`` runs, and
copies the K/V the step wrote back to host before layer ``l + S`` reuses the
buffer.

Ordering, per step (``S = 2``, hooks named as vLLM calls them):

* step start (``begin_step``): apply vLLM's block zeroing and copy-on-write
  copies to the host copy, then load layers ``0 .. S-1``;
* after layer ``l``'s attention (``layer_done``): write back layer ``l``'s
  newly written blocks, then load layer ``l + S`` into the same buffer
  (same stream, so the load cannot overtake the write-back);
* before layer ``l + 1`` writes its K/V (``before_layer``): the compute stream
  waits for that layer's load event. Loading inside ``wait_for_layer_load``
  would be too late: vLLM writes the step's new K/V into the cache before
  it calls that hook, and the load would overwrite them.

Why two buffers suffice (the design note's argument): if loading a layer is
faster than its forward, the load of ``l + 1`` is done before it is needed;
if slower, the buffer that load targets was released by ``l - 1`` one layer
earlier. Measured on an H200: S = 2 within 1.12x of max(compute, transfer),
S = 3 or 4 no better (benchmarks/dynamic_buffer.py).

Copies are batched per layer (one gather, one host-device copy, one scatter
per plane and chunk): per-block copies used a fifth of an H200's PCIe link.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from vllm_aio.connector.block_layout import BlockLayout
from vllm_aio.connector.staging import Slice, StagingBuffer
from vllm_aio.device import Device
from vllm_aio.log import get_logger

logger = get_logger(__name__)


@dataclass
class BufferStep:
    """What one step needs from the buffer (sent by the scheduler half)."""

    resident: list[int] = field(default_factory=list)  # blocks the step's attention reads
    written: list[int] = field(default_factory=list)  # blocks the step writes new K/V into
    zeroed: list[int] = field(default_factory=list)  # new blocks vLLM zeroes before the step
    copies: list[tuple[int, int]] = field(default_factory=list)  # vLLM's copy-on-write (src, dst)


class LayerBuffer:
    def __init__(
        self, device_caches: Mapping[str, torch.Tensor], layer_names: Sequence[str], num_blocks: int,
        buffers: int, staging_bytes: int,
    ) -> None:
        first = device_caches[layer_names[0]]
        self.device = Device(first.device)
        # The full KV of every layer; vLLM's blocks index it like the device cache.
        self.host_caches = {
            name: torch.empty(
                device_caches[name].shape, dtype=device_caches[name].dtype, pin_memory=not self.device.is_host
            )
            for name in layer_names
        }
        self._device_layout = BlockLayout(device_caches, layer_names, num_blocks)
        self._host_layout = BlockLayout(self.host_caches, layer_names, num_blocks)
        self.buffers = buffers
        self.num_layers = len(layer_names)
        self._stream = self.device.new_stream()
        self._staging = StagingBuffer(self.device, staging_bytes)
        self._chunk_blocks = max(1, staging_bytes // (4 * max(self._host_layout.layer_bytes(0), 1)))
        self._in_flight: deque[tuple[Slice, torch.Event | None]] = deque()
        self._write_backs: list[tuple[Slice, torch.Event | None, int, torch.Tensor]] = []
        self._loaded: dict[int, torch.Event | None] = {}
        self._resident = self._written = torch.empty(0, dtype=torch.int64)

    @property
    def host_bytes(self) -> int:
        return sum(t.nbytes for t in self.host_caches.values())

    # ---- per step ----------------------------------------------------------
    def begin_step(self, step: BufferStep) -> None:
        self._apply_block_updates(step)
        self._resident = torch.tensor(sorted(set(step.resident)), dtype=torch.int64)
        self._written = torch.tensor(sorted(set(step.written)), dtype=torch.int64)
        for layer in range(min(self.buffers, self.num_layers)):
            self._load(layer)
        self.before_layer(0)

    def before_layer(self, layer: int) -> None:
        """Order layer ``layer``'s compute after its load (no host wait on accelerators)."""
        self.device.wait(self._loaded.pop(layer, None))

    def layer_done(self, layer: int) -> None:
        """Layer ``layer`` has written its K/V: save them, then reuse its buffer."""
        self._write_back(layer)
        if layer + self.buffers < self.num_layers:
            self._load(layer + self.buffers)

    def end_step(self) -> None:
        """Host memory holds every block the step wrote (the pool may read it)."""
        for piece, event, layer, ids in self._write_backs:
            self.device.synchronize(event)
            self._host_layout.scatter(piece.tensor.view(len(ids), -1), ids, [layer])
            self._staging.release(piece)
        self._write_backs.clear()

    def _apply_block_updates(self, step: BufferStep) -> None:
        every = range(self.num_layers)
        if step.zeroed:
            for plane in (p for layer in every for p in self._host_layout.planes[layer]):
                plane.blocks.index_fill_(0, torch.tensor(step.zeroed, dtype=torch.int64), 0)
        if step.copies:
            src = torch.tensor([s for s, _ in step.copies], dtype=torch.int64)
            dst = torch.tensor([d for _, d in step.copies], dtype=torch.int64)
            for layer in every:
                rows = torch.empty(len(src), self._host_layout.layer_bytes(layer), dtype=torch.uint8)
                self._host_layout.gather(src, [layer], rows)
                self._host_layout.scatter(rows, dst, [layer])

    # ---- copies ------------------------------------------------------------
    def _load(self, layer: int) -> None:
        event = None
        for ids in self._resident.split(self._chunk_blocks):
            piece = self._slice(len(ids) * self._host_layout.layer_bytes(layer))
            rows = piece.tensor.view(len(ids), -1)
            self._host_layout.gather(ids, [layer], rows)
            with self.device.on(self._stream):
                self._device_layout.scatter(self._to_device(rows), self._to_device(ids), [layer])
                event = self.device.record(self._stream)
            self._done_with(piece, event)
        self._loaded[layer] = event

    def _write_back(self, layer: int) -> None:
        computed = self.device.record()  # the compute stream, after this layer's attention
        for ids in self._written.split(self._chunk_blocks):
            piece = self._slice(len(ids) * self._host_layout.layer_bytes(layer))
            rows = piece.tensor.view(len(ids), -1)
            with self.device.on(self._stream):
                self.device.wait(computed, self._stream)
                if self.device.is_host:
                    self._device_layout.gather(ids, [layer], rows)
                else:
                    scratch = self.device.empty(rows.numel()).view(rows.shape)
                    self._device_layout.gather(self._to_device(ids), [layer], scratch)
                    rows.copy_(scratch, non_blocking=True)
                event = self.device.record(self._stream)
            self._write_backs.append((piece, event, layer, ids))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host if self.device.is_host else host.to(self.device.torch_device, non_blocking=True)

    def _slice(self, nbytes: int) -> Slice:
        """Staging for one chunk; waits for the oldest copies when it runs out."""
        while True:
            while self._in_flight and _completed(self._in_flight[0][1]):
                self._staging.release(self._in_flight.popleft()[0])
            piece = self._staging.allocate(nbytes, 0)
            if piece is not None:
                return piece
            if self._in_flight:
                self.device.synchronize(self._in_flight[0][1])
            elif self._write_backs:
                self.end_step()  # write-backs hold the rest of the staging
            else:
                raise RuntimeError(f"staging_buffer_size too small for {nbytes} bytes of one layer chunk")

    def _done_with(self, piece: Slice, event: torch.Event | None) -> None:
        if event is None:
            self._staging.release(piece)
        else:
            self._in_flight.append((piece, event))


def _completed(event: torch.Event | None) -> bool:
    return event is None or event.query()
