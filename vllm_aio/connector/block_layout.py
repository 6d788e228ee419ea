"""Where one KV block's bytes live in vLLM's per-layer cache tensors.

A pool value is one block of every layer, in layer order; each layer
contributes one segment per block-indexed region of its tensor. Two shapes of
per-layer tensor occur in vLLM 0.32:

* ``[num_blocks, ...]`` (CPU attention, MLA, block-major layouts): one
  contiguous segment per block;
* ``[2, num_blocks, ...]`` (K and V stored apart, e.g. FlashAttention): two.

Only addresses and sizes are computed here; the backend does the copying.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from vllm_aio.backends import Segment


@dataclass(frozen=True)
class _Region:
    base: int  # address of block 0
    stride: int  # bytes between consecutive blocks
    size: int  # bytes of one block in this region


class BlockLayout:
    def __init__(self, kv_caches: Mapping[str, torch.Tensor], layer_names: Sequence[str], num_blocks: int) -> None:
        self.regions = [r for name in layer_names for r in _regions(name, kv_caches[name], num_blocks)]
        self.num_blocks = num_blocks

    @property
    def block_bytes(self) -> int:
        return sum(r.size for r in self.regions)

    def segments(self, block_id: int) -> list[Segment]:
        return [(r.base + block_id * r.stride, r.size) for r in self.regions]

    def memory_spans(self) -> list[Segment]:
        """(address, size) of each region's whole extent, for backend registration."""
        return [(r.base, r.stride * self.num_blocks) for r in self.regions]


def _regions(name: str, t: torch.Tensor, num_blocks: int) -> list[_Region]:
    elem = t.element_size()
    if t.shape[0] == num_blocks and t[0].is_contiguous():
        return [_Region(t.data_ptr(), t.stride(0) * elem, t[0].numel() * elem)]
    if t.dim() > 1 and t.shape[0] == 2 and t.shape[1] == num_blocks and t[0, 0].is_contiguous():
        return [
            _Region(t[kv].data_ptr(), t.stride(1) * elem, t[0, 0].numel() * elem) for kv in range(2)
        ]
    raise ValueError(
        f"layer {name}: KV cache of shape {tuple(t.shape)} and strides {t.stride()} has no "
        f"contiguous per-block region for {num_blocks} blocks; this layout is not supported"
    )
