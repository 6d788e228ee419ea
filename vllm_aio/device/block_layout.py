"""Where one KV block's bytes live in vLLM's per-layer cache tensors (or vllm-ascend's tuples of
tensors): each layer contributes one plane per block-indexed region, exposed as addresses
(``segments``) for backends that copy from host memory and as a ``[num_blocks, bytes]`` byte tensor
for batched gathers and scatters. The shapes and why the copies are batched:
``docs/architecture.md``, "Block layout".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_aio.device.accelerator import STRIDED_NPU_FORMATS, Device, npu_private_format
from vllm_aio.device.host_copy import copy_rows
from vllm_aio.device.segment import Segment


@dataclass(frozen=True)
class _Plane:
    base: int  # address of block 0
    stride: int  # bytes between consecutive blocks
    size: int  # bytes of one block in this plane
    blocks: torch.Tensor  # uint8 [num_blocks, size] view of the same bytes


# One layer's KV cache as a model runner registers it: a tensor (vLLM's), or a tuple or list of them (vllm-ascend's).
LayerCache = torch.Tensor | Sequence[torch.Tensor]


def cache_tensors(cache: LayerCache) -> tuple[torch.Tensor, ...]:
    return (cache,) if isinstance(cache, torch.Tensor) else tuple(cache)


class BlockLayout:
    def __init__(self, kv_caches: Mapping[str, LayerCache], layer_names: Sequence[str], num_blocks: int) -> None:
        self.planes = [
            [plane for t in cache_tensors(kv_caches[name]) for plane in _planes(name, t, num_blocks)]
            for name in layer_names
        ]
        self.num_blocks = num_blocks
        self.device = cache_tensors(kv_caches[layer_names[0]])[0].device
        # Where one kernel moves a batch's every plane (``plane_copy.py``); else one index op per plane.
        self._kernel = Device(self.device).plane_copies(
            [[(p.base, p.stride, p.size) for p in planes] for planes in self.planes])

    def layer_bytes(self, layer: int) -> int:
        return sum(p.size for p in self.planes[layer])

    def payload_bytes(self, layers: Sequence[int]) -> int:
        return sum(self.layer_bytes(i) for i in layers)

    def segments(self, block_id: int, layers: Sequence[int]) -> list[Segment]:
        return [(p.base + block_id * p.stride, p.size) for i in layers for p in self.planes[i]]

    def memory_spans(self) -> list[Segment]:
        """(address, size) of each plane's whole extent, for backend registration."""
        return [(p.base, p.stride * self.num_blocks) for planes in self.planes for p in planes]

    def gather(self, block_ids: torch.Tensor, layers: Sequence[int], out: torch.Tensor) -> None:
        """Copy the blocks' bytes of ``layers`` into ``out`` ``[n, payload]`` (same device)."""
        if self._kernel is not None and self._kernel.gather(block_ids, layers, out):
            return
        offset = 0
        for i in layers:
            for p in self.planes[i]:
                out[:, offset : offset + p.size].copy_(p.blocks.index_select(0, block_ids))
                offset += p.size

    def scatter(self, src: torch.Tensor, block_ids: torch.Tensor, layers: Sequence[int]) -> None:
        """Copy ``src`` ``[n, payload]`` (same device) into the blocks of ``layers``."""
        if self._kernel is not None and self._kernel.scatter(src, block_ids, layers):
            return
        offset = 0
        for i in layers:
            for p in self.planes[i]:
                p.blocks.index_copy_(0, block_ids, src[:, offset : offset + p.size])
                offset += p.size

    def warm_up(self, layer_sets: Iterable[Sequence[int]]) -> None:
        """Block 0 of each layer set copied out and back, unchanged, so the copy kernels compile and load
        now (Triton's on their first launch), not in the first request's step. At registration, before
        vLLM's first forward: no step reads the block meanwhile."""
        block = torch.zeros(1, dtype=torch.int64, device=self.device)
        for layers in layer_sets:
            rows = torch.empty((1, self.payload_bytes(layers)), dtype=torch.uint8, device=self.device)
            self.gather(block, layers, rows)
            self.scatter(rows, block, layers)
        Device.synchronize(Device(self.device).record())

    def copy_blocks(self, src_ids: torch.Tensor, dst_ids: torch.Tensor, layers: Sequence[int]) -> None:
        """Copy blocks ``src_ids[i]`` -> ``dst_ids[i]`` within the cache, for ``layers``."""
        for i in layers:
            for p in self.planes[i]:
                p.blocks.index_copy_(0, dst_ids, p.blocks.index_select(0, src_ids))

    def stackable(self, layer: int) -> bool:
        """Whether ``stacked`` can view the layer's planes: equally spaced in one allocation."""
        planes = self.planes[layer]
        storage = {p.blocks.untyped_storage().data_ptr() for p in planes}
        between = planes[1].base - planes[0].base if len(planes) > 1 else 0
        spaced = all(b.base - a.base == between and b.stride == a.stride for a, b in zip(planes, planes[1:]))
        return len(storage) == 1 and spaced

    def stacked(self, layer: int) -> torch.Tensor:
        """The layer's planes as one uint8 ``[planes, num_blocks, size]`` view (planes equally spaced,
        as in both supported shapes), for kernels that move every plane of a block at once."""
        planes = self.planes[layer]
        first = planes[0].blocks
        between = planes[1].base - planes[0].base if len(planes) > 1 else 0
        if not self.stackable(layer):
            raise ValueError(f"layer {layer}'s planes are not equally spaced in one allocation")
        return _bytes_of(first).as_strided((len(planes), *first.shape), (between, *first.stride()), first.storage_offset())

    # ---- host fast paths ---------------------------------------------------
    def plane_rows(self, layer: int, flat: torch.Tensor, n: int) -> list[torch.Tensor]:
        """``flat`` (uint8, ``n * layer_bytes``, any device) as each plane's ``[n, size]`` rows, back to back.

        The plane-major layout of ``gather_planes``: a plane's blocks are one
        contiguous region, so each plane moves with one copy and one batched
        index op, on the host and on the device alike.
        """
        rows, offset = [], 0
        for p in self.planes[layer]:
            rows.append(flat[offset : offset + n * p.size].view(n, p.size))
            offset += n * p.size
        return rows

    def gather_planes(self, block_ids: torch.Tensor, layer: int, out: torch.Tensor) -> None:
        """Copy the blocks of ``layer`` into ``out`` (``plane_rows`` layout); host memory only.

        ``block_ids`` is a CPU int64 tensor.
        """
        n = len(block_ids)
        ids = self._checked_ids(block_ids, out)
        rows = np.arange(n)
        for p, r in zip(self.planes[layer], self.plane_rows(layer, out, n)):
            copy_rows(r.data_ptr(), p.size, rows, p.base, p.stride, ids, p.size)

    def scatter_planes(self, src: torch.Tensor, block_ids: torch.Tensor, layer: int) -> None:
        """Copy ``src`` (``plane_rows`` layout) into the blocks of ``layer``; host memory only.

        ``block_ids`` must not repeat (the copy threads would race for a block).
        """
        n = len(block_ids)
        ids = self._checked_ids(block_ids, src)
        rows = np.arange(n)
        for p, r in zip(self.planes[layer], self.plane_rows(layer, src, n)):
            copy_rows(p.base, p.stride, ids, r.data_ptr(), p.size, rows, p.size)

    def _checked_ids(self, block_ids: torch.Tensor, buffer: torch.Tensor) -> np.ndarray:
        """``block_ids`` for ``copy_rows``, which copies between raw addresses: nothing out of place may reach it."""
        if self.device.type != "cpu" or buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("host fast paths need a host cache and a contiguous host buffer")
        if len(block_ids) and not (0 <= int(block_ids.min()) and int(block_ids.max()) < self.num_blocks):
            raise IndexError(f"block ids outside [0, {self.num_blocks})")
        return block_ids.numpy()


def check_groups_alias(kv_caches: Mapping[str, LayerCache], groups: Sequence[Sequence[str]]) -> None:
    """Check that every KV cache group's i-th layer is the same memory as group 0's.

    vLLM's hybrid allocator gives all groups one block pool and lays them over
    each other: a block id belongs to one group at a time, and its bytes sit
    at the same place in the i-th layer of every group. Values are read and
    written through group 0's layers alone, which is right only then.
    """
    for g, layers in enumerate(groups[1:], start=1):
        for i, (name, first) in enumerate(zip(layers, groups[0])):
            if _identity(kv_caches[name]) != _identity(kv_caches[first]):
                raise ValueError(
                    f"KV cache group {g}'s layer {i} ({name}) is not the memory of group 0's layer {i} "
                    f"({first}): AioConnector stores a hybrid model's blocks through group 0's layers, "
                    "which needs vLLM's overlaid group layout"
                )


def _identity(cache: LayerCache) -> list[tuple]:
    return [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in cache_tensors(cache)]


def _planes(name: str, t: torch.Tensor, num_blocks: int) -> list[_Plane]:
    if (private := npu_private_format(t)) is not None:
        raise ValueError(
            f"layer {name}: KV cache in the NPU's {private} format (vllm-ascend allocates it so on Ascend 310P), "
            f"whose bytes do not follow its strides; AioConnector moves blocks by their strides and supports "
            f"strided formats only ({', '.join(STRIDED_NPU_FORMATS.values())}): docs/ascend_layouts.md"
        )
    elem = t.element_size()
    rows = t.shape[0] // num_blocks if t.dim() and t.shape[0] % num_blocks == 0 else 0  # tensor rows per block
    if t.shape[0] == num_blocks and t[0].is_contiguous():
        starts = [t]
        stride = t.stride(0)
        size = t[0].numel()
    elif t.dim() > 1 and t.shape[0] == 2 and t.shape[1] == num_blocks and t[0, 0].is_contiguous():
        starts = [t[0], t[1]]
        stride = t.stride(1)
        size = t[0, 0].numel()
    elif rows > 1 and t[:rows].is_contiguous():  # a block split into kernel blocks, back to back (vllm-ascend)
        starts = [t]
        stride = t.stride(0) * rows
        size = t[:rows].numel()
    else:
        raise ValueError(
            f"layer {name}: KV cache of shape {tuple(t.shape)} and strides {t.stride()} has no "
            f"contiguous per-block region for {num_blocks} blocks; this layout is not supported"
        )
    storage = _bytes_of(t)
    return [
        _Plane(
            base=s.data_ptr(),
            stride=stride * elem,
            size=size * elem,
            blocks=storage.as_strided((num_blocks, size * elem), (stride * elem, 1), s.storage_offset() * elem),
        )
        for s in starts
    ]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s whole storage as an empty uint8 tensor to take byte views of (``as_strided``)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
