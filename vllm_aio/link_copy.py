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

The swap kernel is the dynamic buffer's per-layer copy: a layer's written
blocks out of its device buffer, then the next layer's blocks into the same
buffer, both in one launch. Its host cost per layer is what a step of
streamed layers pays on the forward thread, and on a host-bound forward every
microsecond of it counted about one and a half times in the step (the H200's
host, the dynamic-buffer benchmark's priority rows). So ``SwapLaunches``
launches the kernel compiled once with its arguments as integers: 12 us of
host time against 25 us for Triton's launch, which binds and specializes
every argument on every call (torch's index kernels took four launches of
~12 us each).

Needs Triton (part of CUDA builds of vLLM and torch); ``Device.copy_rows``
and ``Device.row_swaps`` fall back to torch's kernels without it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

# Programs of one copy: few enough to leave the SMs to the forward, enough to
# keep the link busy (8 to 66 ran at the same speed on the H200).
PROGRAMS = 16
# Programs of a swap (per plane). Measured on the H200 (dynamic-buffer benchmark, S=2, copies of
# 32 KiB rows): a prefill loading 1,024 scattered blocks a layer beside its compute took 1.50x
# the ideal step with 16 programs, 1.34x with 8, 1.24x with 4 (the copy's programs slowed the
# forward's kernels more than they sped the link); a decode whose step is the link's (32 x 2,048,
# scattered) 1.03x with 16, 1.05x with 8, 1.57x with 4. 8 is close to the best of both.
SWAP_PROGRAMS = 8
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

    # The row count and the index tensors change every step: a kernel specialized on them (a count
    # divisible by 16, an index 16-byte aligned) would be compiled again, or be wrong, for the next.
    @triton.jit(do_not_specialize=["rows"], do_not_specialize_on_alignment=["out_index", "in_index"])
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


class SwapLaunches:
    """The swap kernel between the layers of fixed tensors, on one stream: for each layer ``l``
    ``host[l]`` and ``device[l]``, ``[planes, blocks, width]`` of one dtype, columns contiguous,
    every layer's alike in shape and strides.

    ``rows`` sets the rows of the launches that follow (int64 index tensors on the device, of one
    length, -1 for no row; kept alive here); ``launch(done, load)`` copies ``done``'s out rows from
    ``device[done]`` to ``host[done]``, then ``load``'s in rows from ``host[load]`` to ``device[load]``
    (either may be None). Row r's copy out is read before its copy in overwrites it.

    The kernel is compiled (``warmup``) for the first launch of each kind and launched again with
    its arguments as integers, the tensors' pointers taken once (Triton 3.2 and later: a compiled
    kernel's launcher takes every argument, constexprs included).
    """

    def __init__(self, host: Sequence[torch.Tensor], device: Sequence[torch.Tensor], stream: int) -> None:
        first = host[0]
        for t in (*host, *device):
            assert t.dim() == 3 and t.dtype == first.dtype and t.stride(2) == 1, "[planes, blocks, width] rows"
            assert t.shape[::2] == first.shape[::2], "planes and widths must agree"
        assert len({t.stride() for t in host}) == 1 and len({t.stride() for t in device}) == 1
        self._host, self._device, self._stream = list(host), list(device), stream
        self._host_ptr = [t.data_ptr() for t in host]
        self._device_ptr = [t.data_ptr() for t in device]
        self._planes, self._width = first.shape[0], first.shape[2]
        self._host_strides, self._device_strides = host[0].stride()[:2], device[0].stride()[:2]
        self._compiled: dict[tuple, object] = {}
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None
        self._out = self._in = False  # whether the rows hold any row out, any row in

    def rows(self, out_index: torch.Tensor, in_index: torch.Tensor, any_out: bool, any_in: bool) -> None:
        self._index, self._out, self._in = (out_index, in_index), any_out, any_in

    def launch(self, done: int | None, load: int | None) -> None:
        out, into = done is not None and self._out, load is not None and self._in
        if not (out or into) or self._index is None:
            return
        out_index, in_index = self._index
        rows = len(out_index)
        # A skipped direction's tensors are not read: the other's stand in.
        d, ld = (done, load) if out and into else (done, done) if out else (load, load)
        constexprs = (out, into, BLOCK)
        key = (constexprs, self._host_ptr[d] % 16, self._device_ptr[d] % 16, self._host_ptr[ld] % 16,
               self._device_ptr[ld] % 16)
        grid = (min(SWAP_PROGRAMS, rows), self._planes, 1)
        args = self._arguments(self._host_ptr[d], self._device_ptr[d], self._device_ptr[ld], self._host_ptr[ld],
                               out_index.data_ptr(), in_index.data_ptr(), rows)
        compiled = self._compiled.get(key)
        if compiled is None:  # compiled for the tensors' types, then launched as every later launch
            typed = self._arguments(self._host[d], self._device[d], self._device[ld], self._host[ld], out_index,
                                    in_index, rows)
            compiled = self._compiled[key] = _swap_kernel().warmup(*typed, *constexprs, grid=grid, num_warps=8)
            compiled[grid](*args, *constexprs, stream=self._stream)  # loads the kernel on the device too
            return
        compiled.run(*grid, self._stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *constexprs)

    def _arguments(self, out_dst, out_src, in_dst, in_src, out_index, in_index, rows: int) -> tuple:
        (hp, hr), (dp, dr) = self._host_strides, self._device_strides
        return (out_dst, hp, hr, out_src, dp, dr, out_index, in_dst, dp, dr, in_src, hp, hr, in_index, rows,
                self._width)


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
