"""The dynamic layer buffer's order of work: L layers time-share S device KV buffers (layer ``l`` in
buffer ``l % S``, every layer's KV in a host copy). Each step loads layers ``0 .. S-1`` at its start,
and after layer ``l``'s attention writes back what it wrote and loads layer ``l + S`` into the same
buffer; the compute stream waits for a layer's load before that layer writes its K/V. Resident
blocks live at private ids past vLLM's. Why this order and why two buffers suffice:
``docs/transfer_modes.md``, "The dynamic buffer, layer by layer".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from vllm_aio.buffer.copier import DIRECT_COPY_BYTES, Copier
from vllm_aio.buffer.host_kv import HostKV
from vllm_aio.buffer.remap import BlockRemap
from vllm_aio.buffer.residency import private_blocks
from vllm_aio.buffer.steps import StepPlanner
from vllm_aio.device.accelerator import Device, npu_private_format
from vllm_aio.device.block_layout import BlockLayout, LayerCache, cache_tensors
from vllm_aio.log import get_logger
from vllm_aio.shared.metadata import BufferStep

logger = get_logger(__name__)


class LayerBuffer:
    def __init__(
        self, device_caches: Mapping[str, LayerCache], layer_names: Sequence[str], num_blocks: int,
        buffers: int, staging_bytes: int, direct_copy_bytes: int = DIRECT_COPY_BYTES, resident_blocks: int = 0,
        block_tokens: int = 0,
    ) -> None:
        """``num_blocks``: the device caches' blocks, the private ones of ``resident_blocks`` (P per
        layer) included; ``block_tokens``: tokens per block (with resident blocks: vLLM's slot mapping)."""
        check_buffers_shared(device_caches, layer_names, buffers)
        self.device = Device(cache_tensors(device_caches[layer_names[0]])[0].device)
        # vLLM's blocks; the private ones follow them in the device caches.
        self.num_blocks = num_blocks - private_blocks(len(layer_names), buffers, resident_blocks)
        self.host = HostKV(self.device, device_caches, layer_names, num_blocks, self.num_blocks)
        self._host_layout = self.host.layout
        self._remap = None
        if resident_blocks:
            self._remap = BlockRemap(self.device, self.num_blocks, resident_blocks, buffers, block_tokens)
        self.buffers = buffers
        self.num_layers = len(layer_names)
        self._copier = Copier(self.device, self.host, BlockLayout(device_caches, layer_names, num_blocks), buffers,
                              staging_bytes, self._private_base, resident_blocks, direct_copy_bytes)
        self._planner = StepPlanner(self._copier.min_run)
        self._loaded: dict[int, torch.Event | None] = {}
        self._layer_names = list(layer_names)
        self._pinned_before = False  # the first resident step is logged
        self._pinned_ids: tuple[torch.Tensor, torch.Tensor] | None = None  # the pinned blocks and slots on the device
        self._streams = False

    @property
    def host_caches(self) -> dict[str, LayerCache]:
        """Every layer's vLLM blocks in host memory, indexed like the device caches."""
        return self.host.caches

    @property
    def host_bytes(self) -> int:
        return self.host.nbytes

    # ---- per step ----------------------------------------------------------
    def begin_step(self, step: BufferStep, forward_context: object = None) -> None:
        """``forward_context``: vLLM's, whose tables point at the pinned blocks during the step."""
        self._copier.drain()  # a step that ended without end_step: the host copy must be settled
        if self._remap is not None:
            self._remap.end()  # and vLLM's tables its own
        self._apply_block_updates(step)
        # vLLM's own cache updates (block copies) on the compute stream come before our loads.
        self.device.wait(self.device.record(), self._copier.stream)
        plan = self._planner.plan(step)
        if plan.pinned_changed:
            # vLLM's tables are rewritten on the compute stream, where they are read.
            blocks = plan.pinned.blocks
            self._pinned_ids = (self.device.indices(blocks), self.device.indices(plan.pinned.slots(blocks)))
        self._copier.prepare(plan)
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
        # A step whose blocks are all pinned: the forward thread only points the tables at each pass.
        self._streams = plan.moves_layers
        if self._streams:
            for layer in range(min(self.buffers, self.num_layers)):
                self._loaded[layer] = self._copier.move(None, layer)
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
        self._copier.retire()
        following = layer + self.buffers
        load = following if following < self.num_layers else None
        event = self._copier.move(layer, load)
        if load is not None:
            self._loaded[load] = event

    def end_step(self) -> None:
        """Host memory holds every block the step wrote (the pool may read it); vLLM's tables are its own."""
        self._copier.write_back_pinned()
        if self._remap is not None:
            self._remap.end()
        self._copier.drain()

    def close(self) -> None:
        """Wait for every copy, then release the page-locked host copy (views stay readable, unpinned)."""
        self._copier.drain()
        self.host.release()

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

    def _private_base(self, layer: int) -> int:
        return self._remap.private_base(layer) if self._remap is not None else self.num_blocks


def check_buffers_shared(caches: Mapping[str, LayerCache], layer_names: Sequence[str], buffers: int) -> None:
    """Refuse caches that vLLM did not lay out for the buffer: layer ``l`` must be buffer ``l % S``'s
    memory (``plan.py``), every tensor of it where a layer's cache is a tuple (vllm-ascend's).
    Unshared, every layer keeps KV memory of its own: the buffer would stream nothing, and vLLM
    would run on the blocks of a cache that was never re-planned."""
    for name in layer_names:
        if (private := next(filter(None, map(npu_private_format, cache_tensors(caches[name]))), None)) is not None:
            raise ValueError(
                f"transfer_mode dynamic_buffer: layer {name}'s KV cache is in the NPU's {private} format (vllm-ascend "
                "on Ascend 310P), whose blocks cannot be copied by their strides; the buffer runs on Atlas A2/A3 "
                "(ND caches) with vllm-ascend on vLLM 0.23-0.28"
            )
    for i, name in enumerate(layer_names[buffers:], start=buffers):
        first = layer_names[i % buffers]
        if [t.data_ptr() for t in cache_tensors(caches[name])] != [t.data_ptr() for t in cache_tensors(caches[first])]:
            raise ValueError(
                f"transfer_mode dynamic_buffer: layer {name} is not the memory of buffer {i % buffers} ({first}): "
                "vLLM did not re-plan its KV cache for the buffer. The vllm_aio_buffer_plan plugin does, "
                "in every vLLM process, when the package is installed and, with VLLM_PLUGINS set, that "
                "list names vllm_aio_buffer_plan"
            )
