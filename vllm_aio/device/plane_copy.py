"""A batch of blocks between the paged KV cache and rows of one buffer, every plane in one launch.

A stored value holds a block's bytes of one layer or of every layer
(``block_layout.py``): 2 planes (K and V) per layer, each in its
own region of the layer's cache tensor. Moving a batch with torch's index
kernels takes one launch per plane (two for a gather: ``index_select``, then
the copy into the row), 128 launches for a whole-block value of a 32-layer
model: enough host time per batch to keep the direct save well below the
link's rate. The planes' addresses go to the
kernel as one table instead, and one launch moves every (block, plane) pair.

Device memory on both sides (the cache, a scratch or staging on the device):
many programs, one per (block, plane), unlike the link copies of
``link_copy.py`` that wait on host memory. Needs Triton (part of CUDA builds
of vLLM and torch); ``Device.plane_copies`` answers None without it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

# Words (int64) one program moves per access.
BLOCK = 1024
# Batches of fewer planes (a layerwise value: K and V of one layer) stay with torch's index kernels:
# one Triton launch costs the host more than their two to four launches.
MIN_PLANES = 8


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    # Not specialised on what changes between batches of one deployment (a row stride, where the
    # ids start), so the kernel compiled at start (``BlockLayout.warm_up``) serves every batch.
    @triton.jit(do_not_specialize=["row_stride"], do_not_specialize_on_alignment=["ids"])
    def copy_planes(rows, row_stride, planes, ids, width, block_stride, TO_CACHE: tl.constexpr,
                    BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1).to(tl.int64)
        b = tl.load(ids + r)
        block = tl.load(planes + j).to(tl.pointer_type(tl.int64)) + b * block_stride
        row = rows + r * row_stride + j * width  # the row holds the planes back to back
        offsets = tl.arange(0, BLOCK)
        for c in range(0, width, BLOCK):
            cols = c + offsets
            keep = cols < width
            if TO_CACHE:
                tl.store(block + cols, tl.load(row + cols, mask=keep), mask=keep)
            else:
                tl.store(row + cols, tl.load(block + cols, mask=keep), mask=keep)

    return copy_planes


class PlaneCopies:
    """Copies between blocks of a cache's planes and rows ``[n, planes x size]`` (int64 words).

    ``layers[i]``: layer ``i``'s planes as (address of block 0, bytes between blocks, bytes per
    block), every plane alike in stride and size, 8-byte aligned.
    """

    def __init__(self, layers: Sequence[Sequence[tuple[int, int, int]]], device: torch.device) -> None:
        self._layers = [[base for base, _, _ in planes] for planes in layers]
        _, stride, size = layers[0][0]
        self._stride, self._width = stride // 8, size // 8
        self._device = device
        self._tables: dict[tuple[int, ...], torch.Tensor] = {}  # the planes of a set of layers, on the device

    @staticmethod
    def fits(layers: Sequence[Sequence[tuple[int, int, int]]]) -> bool:
        """Whether every plane has one stride and one size, all in whole words."""
        shapes = {(stride, size) for planes in layers for _, stride, size in planes}
        bases_aligned = all(base % 8 == 0 for planes in layers for base, _, _ in planes)
        return len(shapes) == 1 and bases_aligned and all(s % 8 == 0 for s in next(iter(shapes)))

    def gather(self, block_ids: torch.Tensor, layers: Sequence[int], out: torch.Tensor) -> bool:
        """``out[r]`` = block ``block_ids[r]`` of ``layers``' planes, back to back; False (nothing
        copied) where ``out`` is not rows of whole words or the layers have fewer than ``MIN_PLANES``."""
        return self._copy(out, block_ids, layers, to_cache=False)

    def scatter(self, src: torch.Tensor, block_ids: torch.Tensor, layers: Sequence[int]) -> bool:
        """Block ``block_ids[r]`` of ``layers``' planes = ``src[r]``; False as ``gather``."""
        return self._copy(src, block_ids, layers, to_cache=True)

    def _copy(self, rows: torch.Tensor, block_ids: torch.Tensor, layers: Sequence[int], to_cache: bool) -> bool:
        table = self._table(tuple(layers))
        words = _words(rows) if len(table) >= MIN_PLANES else None
        if words is None:
            return False
        n = len(block_ids)
        if n == 0:
            return True
        assert words.shape[1] == len(table) * self._width, "a row holds every plane of the layers"
        grid = (n, len(table))
        _kernel()[grid](words, words.stride(0), table, block_ids, self._width, self._stride,
                        TO_CACHE=to_cache, BLOCK=BLOCK, num_warps=4)
        return True

    def _table(self, layers: tuple[int, ...]) -> torch.Tensor:
        table = self._tables.get(layers)
        if table is None:
            bases = [base for i in layers for base in self._layers[i]]
            table = self._tables[layers] = torch.tensor(bases, dtype=torch.int64, device=self._device)
        return table


def _words(rows: torch.Tensor) -> torch.Tensor | None:
    """uint8 rows ``[n, bytes]`` (any row stride) as int64 words, or None where they are not whole,
    aligned words."""
    if (rows.dtype != torch.uint8 or rows.dim() != 2 or rows.stride(1) != 1 or rows.shape[1] % 8
            or rows.stride(0) % 8 or rows.data_ptr() % 8):
        return None
    storage = torch.empty(0, dtype=torch.int64, device=rows.device).set_(rows.untyped_storage())
    return storage.as_strided((rows.shape[0], rows.shape[1] // 8), (rows.stride(0) // 8, 1),
                              rows.storage_offset() // 8)
