"""The dynamic buffer's per-layer copy: a layer's written blocks out of its device buffer, then the
next layer's blocks into the same buffer, between the buffer and the mapped host copy of every layer.

Its host cost per layer is what a step of streamed layers pays on the forward thread, and on a
host-bound forward that time counts in the step more than once over (the dynamic-buffer
benchmark's priority rows). So ``SwapLaunches`` launches the kernel compiled once with its
arguments as integers, through Triton's launcher (``vllm_compat.launch``), rather than Triton's
own launch, which binds and specializes every argument on every call.

Needs Triton (part of CUDA builds of vLLM and torch); ``RowSwaps`` falls back to torch's index
kernels without it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from vllm_aio import vllm_compat
from vllm_aio.device import link_copy
from vllm_aio.device.accelerator import Device

# Programs of a swap (per plane): more slow the forward's kernels beside it more than they speed
# the link (a prefill of scattered blocks), fewer leave a decode whose step is the link's short
# of it (docs/benchmarks.md, the swap kernel's programs).
SWAP_PROGRAMS = 8


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

    The kernel is compiled for the first launch of each kind and launched again with its arguments
    as integers, the tensors' pointers taken once (``vllm_compat.launch``: Triton's launcher ABI).
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
        constexprs = (out, into, link_copy.BLOCK)
        key = (constexprs, self._host_ptr[d] % 16, self._device_ptr[d] % 16, self._host_ptr[ld] % 16,
               self._device_ptr[ld] % 16)
        grid = (min(SWAP_PROGRAMS, rows), self._planes, 1)
        args = self._arguments(self._host_ptr[d], self._device_ptr[d], self._device_ptr[ld], self._host_ptr[ld],
                               out_index.data_ptr(), in_index.data_ptr(), rows)
        compiled = self._compiled.get(key)
        if compiled is None:  # compiled for the tensors' types, then launched as every later launch
            typed = self._arguments(self._host[d], self._device[d], self._device[ld], self._host[ld], out_index,
                                    in_index, rows)
            compiled = vllm_compat.compile_kernel(_swap_kernel(), grid, (*typed, *constexprs), num_warps=8)
            self._compiled[key] = compiled
            vllm_compat.first_launch(compiled, grid, self._stream, (*args, *constexprs))
            return
        vllm_compat.launch(compiled, grid, self._stream, (*args, *constexprs))

    def _arguments(self, out_dst, out_src, in_dst, in_src, out_index, in_index, rows: int) -> tuple:
        (hp, hr), (dp, dr) = self._host_strides, self._device_strides
        return (out_dst, hp, hr, out_src, dp, dr, out_index, in_dst, dp, dr, in_src, hp, hr, in_index, rows,
                self._width)


class RowSwaps:
    """The rows of a buffer written back and then reloaded, layer by layer: the dynamic buffer's
    per-layer copy.

    ``host[l]`` and ``device[l]`` are layer ``l``'s ``[planes, blocks, width]`` views, one side
    possibly mapped host memory (``HostMemory.device_view``). ``plan`` sets a step's rows (one
    host-to-device copy); ``swap(done, load)`` then copies layer ``done``'s out rows from its device
    side to its host side, and after them ``load``'s in rows from its host side to its device side,
    on ``stream``; a row both copied out and in is read before it is overwritten.

    CUDA with Triton: one kernel for both directions and every plane, launched with a few
    microseconds of host time (``SwapLaunches``); elsewhere torch's index kernels, the
    copy out first.
    """

    def __init__(self, device: Device, host: Sequence[torch.Tensor], device_side: Sequence[torch.Tensor],
                 stream: torch.Stream | None) -> None:
        """Between each layer's ``host[l]`` and ``device_side[l]``, on ``stream``."""
        self._device, self._host, self._device_side, self._stream = device, host, device_side, stream
        self._launches = None
        if device.torch_device.type == "cuda" and link_copy.available():
            vllm_compat.require_triton_launcher("transfer_mode dynamic_buffer")
            with device.on(stream):
                handle = torch.cuda.current_stream(device.torch_device).cuda_stream
            self._launches = SwapLaunches(host, device_side, handle)
        self._out_rows = self._in_rows = torch.empty(0, dtype=torch.int64)

    def plan(self, out_rows: np.ndarray, in_rows: np.ndarray) -> None:
        """The step's rows: out of the buffer (written back), then into it (loaded)."""
        both = np.union1d(out_rows, in_rows)
        # Paired for the kernel: row r's block to move out, and in, -1 for none.
        paired = [np.full(len(both), -1, dtype=np.int64) for _ in range(2)]
        for pairs, rows in zip(paired, (out_rows, in_rows)):
            pairs[np.searchsorted(both, rows)] = rows
        with self._device.on(self._stream):  # ahead of the swaps on that stream
            flat = self._device.indices(np.concatenate([*paired, out_rows, in_rows]).astype(np.int64))
        n, n_out = len(both), len(out_rows)
        self._out_rows, self._in_rows = flat[2 * n : 2 * n + n_out], flat[2 * n + n_out :]
        if self._launches is not None:
            self._launches.rows(flat[:n], flat[n : 2 * n], len(out_rows) > 0, len(in_rows) > 0)

    def swap(self, done: int | None, load: int | None) -> None:
        if self._launches is not None:
            self._launches.launch(done, load)
            return
        with self._device.on(self._stream):
            if done is not None and self._out_rows.numel():
                rows = self._out_rows
                self._host[done].index_copy_(1, rows, self._device_side[done].index_select(1, rows))
            if load is not None and self._in_rows.numel():
                rows = self._in_rows
                self._device_side[load].index_copy_(1, rows, self._host[load].index_select(1, rows))
