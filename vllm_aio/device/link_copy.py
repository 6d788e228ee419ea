"""Row copies across the host link that leave the device's SMs to the model.

A kernel that reads or writes mapped host memory (the embedded pool's slots,
the dynamic buffer's host copy) waits on the link, not on its SMs, yet torch's
``index_select`` / ``index_copy_`` launch a grid over every row and hold the
whole device while they wait. This kernel, a few programs each looping over
rows, moves as fast as ``index_select`` alone and, beside the forward's
compute on another stream, takes about the longer of the two where
``index_select`` takes their sum (docs/benchmarks.md, the link copy kernel).

Needs Triton (part of CUDA builds of vLLM and torch); ``Device.copy_rows``
falls back to torch's kernels without it. The dynamic buffer's swap kernel is
``buffer/swaps.py``'s.
"""

from __future__ import annotations

import functools

import torch

# Programs of one copy: few enough to leave the SMs to the forward, enough to
# keep the link busy (a wide range of counts ran at the same speed).
PROGRAMS = 16
# Elements one program moves per access.
BLOCK = 2048


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    # Not specialised on the row count, the strides or where an index starts (a slice of a larger
    # one), so the variant compiled at start (``MappedSlots.warm_up``) serves every batch.
    @triton.jit(do_not_specialize=["dst_stride", "src_stride", "rows"],
                do_not_specialize_on_alignment=["dst_index", "src_index"])
    def copy_rows(dst, dst_stride, dst_index, src, src_stride, src_index, rows, width,
                  DST_INDEXED: tl.constexpr, SRC_INDEXED: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        for r in range(tl.program_id(0), rows, tl.num_programs(0)):
            # int64: row x stride outgrows int32 in a pool of many slots
            d = tl.load(dst_index + r) if DST_INDEXED else r.to(tl.int64)
            s = tl.load(src_index + r) if SRC_INDEXED else r.to(tl.int64)
            for c in range(0, width, BLOCK):
                cols = c + offsets
                keep = cols < width
                tl.store(dst + d * dst_stride + cols, tl.load(src + s * src_stride + cols, mask=keep), mask=keep)

    return copy_rows


def copy_rows(dst: torch.Tensor, dst_index: torch.Tensor | None, src: torch.Tensor,
              src_index: torch.Tensor | None) -> None:
    """``dst[dst_index[r]] = src[src_index[r]]`` for every r (an index None: r itself),
    on the current stream. Rows are the first dimension of 2-D tensors of one dtype
    whose columns are contiguous; the index tensors are int64 on the device."""
    index = dst_index if dst_index is not None else src_index
    rows = len(index) if index is not None else len(dst)
    if rows == 0:
        return
    assert dst.dim() == src.dim() == 2 and dst.dtype == src.dtype and dst.shape[1] == src.shape[1]
    assert dst.stride(1) == src.stride(1) == 1, "columns must be contiguous"
    unread = index if index is not None else dst  # passed for an index the kernel does not read
    _kernel()[(min(PROGRAMS, rows),)](
        dst, dst.stride(0), unread if dst_index is None else dst_index,
        src, src.stride(0), unread if src_index is None else src_index,
        rows, dst.shape[1], DST_INDEXED=dst_index is not None, SRC_INDEXED=src_index is not None, BLOCK=BLOCK,
        num_warps=8,
    )
