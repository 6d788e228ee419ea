"""Row copies across the host link that leave the device's SMs to the model.

A kernel that reads or writes mapped host memory (the embedded pool's slots,
the dynamic buffer's host copy) waits on the link, not on its SMs, yet torch's
``index_select`` / ``index_copy_`` launch a grid over every row and hold the
whole device while they wait. Measured on an H200 with a bf16 8192^3 matmul
loop on another stream (20 matmuls, 28 ms alone) and ten gathers of 1,024
scattered 64 KiB rows from mapped host memory (14 ms alone): with
``index_select`` both together took 41.6 ms, the sum; with this kernel, 8 to 66
programs each looping over rows, 29.4-31.4 ms, the longer of the two. Alone it
moved 46 GB/s, as ``index_select`` (47 GB/s) did, against 55 GB/s for one large
pinned copy. Batched DMA (``cuMemcpyBatchAsync``, one call for every row) was
measured too: 25 GB/s for 32 KiB rows, 34 GB/s for 64 KiB, 3 GB/s for 8 KiB.

``swap_rows`` is the dynamic buffer's per-layer copy: a layer's written
blocks out of its device buffer, then the next layer's blocks into the same
buffer, both in one launch. Its host cost per layer is what a step of
streamed layers pays on the forward thread: one Triton launch (~20 us on an
H200 host) where torch's index kernels took four (~12 us each).

Needs Triton (part of CUDA builds of vLLM and torch); ``Device.copy_rows``
and ``Device.swap_rows`` fall back to torch's kernels without it.
"""

from __future__ import annotations

import functools

import torch

# Programs of one copy: few enough to leave the SMs to the forward, enough to
# keep the link busy (8 to 66 ran at the same speed on the H200).
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

    @triton.jit
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


@functools.cache
def _swap_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _row(dst, dst_plane, dst_row, src, src_plane, src_row, plane, b, width, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        d = dst + plane * dst_plane + b * dst_row
        s = src + plane * src_plane + b * src_row
        for c in range(0, width, BLOCK):
            cols = c + offsets
            keep = cols < width
            tl.store(d + cols, tl.load(s + cols, mask=keep), mask=keep)

    @triton.jit
    def swap_rows(out_dst, out_dst_plane, out_dst_row, out_src, out_src_plane, out_src_row, out_index,
                  in_dst, in_dst_plane, in_dst_row, in_src, in_src_plane, in_src_row, in_index, rows, width,
                  OUT: tl.constexpr, IN: tl.constexpr, BLOCK: tl.constexpr):
        plane = tl.program_id(1).to(tl.int64)
        for r in range(tl.program_id(0), rows, tl.num_programs(0)):
            if OUT:
                b = tl.load(out_index + r)
                if b >= 0:
                    _row(out_dst, out_dst_plane, out_dst_row, out_src, out_src_plane, out_src_row, plane, b, width,
                         BLOCK)
            if OUT and IN:
                # Row r's copy out has been read by every thread before its copy in overwrites the row.
                tl.debug_barrier()
            if IN:
                b = tl.load(in_index + r)
                if b >= 0:
                    _row(in_dst, in_dst_plane, in_dst_row, in_src, in_src_plane, in_src_row, plane, b, width, BLOCK)

    return swap_rows


def swap_rows(out: tuple[torch.Tensor, torch.Tensor] | None, out_index: torch.Tensor,
              into: tuple[torch.Tensor, torch.Tensor] | None, in_index: torch.Tensor) -> None:
    """For every r: ``dst[:, out_index[r]] = src[:, out_index[r]]`` for ``out`` = (dst, src), then the
    same for ``into`` with ``in_index``, on the current stream. Row r's first copy is done before its
    second starts, so the second may overwrite what the first reads. An index of -1 copies nothing;
    a pair of None is skipped. Tensors are ``[planes, rows, width]`` of one dtype, columns contiguous;
    the index tensors int64 on the device, of one length."""
    pairs = [p for p in (out, into) if p is not None]
    rows = len(out_index)
    if rows == 0 or not pairs:
        return
    for dst, src in pairs:
        assert dst.dim() == src.dim() == 3 and dst.dtype == src.dtype
        assert dst.shape[::2] == src.shape[::2] == pairs[0][0].shape[::2], "planes and widths must agree"
        assert dst.stride(2) == src.stride(2) == 1, "columns must be contiguous"
    planes, width = pairs[0][0].shape[0], pairs[0][0].shape[2]
    (od, os), (id_, is_) = out or pairs[0], into or pairs[0]  # a skipped pair's arguments are not read
    _swap_kernel()[(min(PROGRAMS, rows), planes)](
        od, od.stride(0), od.stride(1), os, os.stride(0), os.stride(1), out_index,
        id_, id_.stride(0), id_.stride(1), is_, is_.stride(0), is_.stride(1), in_index, rows, width,
        OUT=out is not None, IN=into is not None, BLOCK=BLOCK, num_warps=8,
    )


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
