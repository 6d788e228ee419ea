"""Unit tests of ``vllm_aio.device.block_layout.BlockLayout``: segment addresses and sizes."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import types
from types import SimpleNamespace

import pytest
import torch

from vllm_aio.device import block_layout
from vllm_aio.device.block_layout import BlockLayout
from vllm_aio.device.accelerator import npu_private_format

NUM_BLOCKS = 6


def every(layout: BlockLayout) -> range:
    return range(len(layout.planes))


def block_major(num_blocks: int = NUM_BLOCKS, dtype=torch.bfloat16) -> torch.Tensor:
    """``[num_blocks, 2, 32, 128]``: K and V of a block side by side."""
    return torch.zeros(num_blocks, 2, 32, 128, dtype=dtype)


def kv_split(num_blocks: int = NUM_BLOCKS, dtype=torch.float16) -> torch.Tensor:
    """``[2, num_blocks, 32, 8, 16]``: all K blocks, then all V blocks."""
    return torch.zeros(2, num_blocks, 32, 8, 16, dtype=dtype)


def test_block_major_layer_gives_one_segment_per_block_at_the_block_address():
    t = block_major()
    layout = BlockLayout({"l0": t}, ["l0"], NUM_BLOCKS)
    for b in range(NUM_BLOCKS):
        assert layout.segments(b, every(layout)) == [(t[b].data_ptr(), t[b].nbytes)]


def test_kv_split_layer_gives_a_k_and_a_v_segment_per_block():
    t = kv_split()
    layout = BlockLayout({"l0": t}, ["l0"], NUM_BLOCKS)
    for b in range(NUM_BLOCKS):
        assert layout.segments(b, every(layout)) == [
            (t[0, b].data_ptr(), t[0, b].nbytes),
            (t[1, b].data_ptr(), t[1, b].nbytes),
        ]


def test_block_bytes_sum_every_layers_share_of_one_block():
    a, b = block_major(), kv_split()
    layout = BlockLayout({"a": a, "b": b}, ["a", "b"], NUM_BLOCKS)
    assert layout.payload_bytes(every(layout)) == a[0].nbytes + 2 * b[0, 0].nbytes
    assert layout.payload_bytes(every(layout)) == sum(size for _, size in layout.segments(3, every(layout)))


def test_segments_follow_the_given_layer_order():
    a, b = block_major(), block_major()
    layout = BlockLayout({"a": a, "b": b}, ["b", "a"], NUM_BLOCKS)
    assert layout.segments(2, every(layout)) == [(b[2].data_ptr(), b[2].nbytes), (a[2].data_ptr(), a[2].nbytes)]


def test_layers_absent_from_layer_names_are_ignored():
    a, b = block_major(), block_major()
    layout = BlockLayout({"a": a, "b": b}, ["a"], NUM_BLOCKS)
    assert layout.segments(0, every(layout)) == [(a[0].data_ptr(), a[0].nbytes)]


def test_segments_of_a_block_address_exactly_its_bytes():
    t = block_major(dtype=torch.float32)
    t[4].fill_(1.0)
    layout = BlockLayout({"l": t}, ["l"], NUM_BLOCKS)
    [(addr, size)] = layout.segments(4, every(layout))
    first = (addr - t.data_ptr()) // t.element_size()
    flat = t.view(-1)
    assert flat[first : first + size // t.element_size()].eq(1.0).all()
    assert flat.eq(1.0).sum() == size // t.element_size()


def test_view_whose_blocks_are_strided_but_contiguous_inside_is_accepted():
    base = torch.zeros(NUM_BLOCKS, 3, 32, 128, dtype=torch.float16)
    t = base[:, :2]  # a padded block: blocks are 3 pages apart, 2 pages long
    layout = BlockLayout({"l": t}, ["l"], NUM_BLOCKS)
    assert layout.segments(5, every(layout)) == [(t[5].data_ptr(), t[5].nbytes)]


def test_non_contiguous_block_major_layer_raises_naming_the_layer():
    t = torch.zeros(2, 32, NUM_BLOCKS, 128).permute(2, 0, 1, 3)  # [num_blocks, 2, 32, 128], strided
    with pytest.raises(ValueError, match=r"layer model.layers.7.attn"):
        BlockLayout({"model.layers.7.attn": t}, ["model.layers.7.attn"], NUM_BLOCKS)


def test_non_contiguous_kv_split_layer_raises_naming_the_layer():
    t = torch.zeros(2, 32, NUM_BLOCKS, 8, 16).transpose(1, 2)  # [2, num_blocks, 32, 8, 16], strided
    with pytest.raises(ValueError, match=r"layer kv_b"):
        BlockLayout({"kv_a": kv_split(), "kv_b": t}, ["kv_a", "kv_b"], NUM_BLOCKS)


def test_layer_with_no_block_dimension_raises_naming_the_layer():
    t = torch.zeros(3, NUM_BLOCKS + 1, 16)
    with pytest.raises(ValueError, match=r"layer odd.*not supported"):
        BlockLayout({"odd": t}, ["odd"], NUM_BLOCKS)


def test_a_cache_in_a_private_npu_format_is_refused_naming_the_format_and_what_is_supported(monkeypatch):
    # vllm-ascend's 310P caches (FRACTAL_NZ): shape and strides read as ND, the bytes lie otherwise.
    monkeypatch.setattr(block_layout, "npu_private_format", lambda t: "FRACTAL_NZ (29)")
    with pytest.raises(ValueError,
                       match=r"layer l0: .*FRACTAL_NZ \(29\) format.*strided formats only \(NCHW, NHWC, ND"):
        BlockLayout({"l0": (block_major(), block_major())}, ["l0"], NUM_BLOCKS)


class StandInTorchNpu(types.ModuleType):
    """``torch_npu.get_npu_format``, answering one aclFormat for every tensor."""

    def __init__(self, code: int) -> None:
        super().__init__("torch_npu")
        self.get_npu_format = lambda tensor: code


@pytest.mark.parametrize(("code", "expected"), [(29, "FRACTAL_NZ (29)"), (3, "NC1HWC0 (3)"), (77, "aclFormat (77)"),
                                                (2, None), (0, None)])
def test_npu_tensors_are_told_apart_by_their_storage_format(monkeypatch, code, expected):
    monkeypatch.setitem(sys.modules, "torch_npu", StandInTorchNpu(code))
    on_npu = SimpleNamespace(device=SimpleNamespace(type="npu"))  # no NPU here: what the check reads of one
    assert npu_private_format(on_npu) == expected


def test_tensors_off_the_npu_have_no_private_format(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", StandInTorchNpu(29))
    assert npu_private_format(block_major()) is None


def test_memory_spans_of_block_major_layer_cover_the_tensor():
    t = block_major()
    layout = BlockLayout({"l": t}, ["l"], NUM_BLOCKS)
    assert layout.memory_spans() == [(t.data_ptr(), t.nbytes)]


def test_memory_spans_of_kv_split_layer_cover_k_and_v():
    t = kv_split()
    layout = BlockLayout({"l": t}, ["l"], NUM_BLOCKS)
    assert layout.memory_spans() == [(t[0].data_ptr(), t[0].nbytes), (t[1].data_ptr(), t[1].nbytes)]
    assert sum(size for _, size in layout.memory_spans()) == t.nbytes


def test_every_segment_lies_inside_a_memory_span():
    layout = BlockLayout({"a": block_major(), "b": kv_split()}, ["a", "b"], NUM_BLOCKS)
    spans = layout.memory_spans()
    for block in range(NUM_BLOCKS):
        for addr, size in layout.segments(block, every(layout)):
            assert any(start <= addr and addr + size <= start + length for start, length in spans)



def test_gather_then_scatter_moves_the_blocks_of_the_given_layers_only():
    src = {"a": block_major(), "b": kv_split(dtype=torch.bfloat16)}
    for t in src.values():
        t.copy_(torch.randn(t.shape))
    dst = {"a": block_major(), "b": kv_split(dtype=torch.bfloat16)}
    layout_src = BlockLayout(src, ["a", "b"], NUM_BLOCKS)
    layout_dst = BlockLayout(dst, ["a", "b"], NUM_BLOCKS)
    rows = torch.empty(2, layout_src.payload_bytes([1]), dtype=torch.uint8)
    layout_src.gather(torch.tensor([4, 1]), [1], rows)
    layout_dst.scatter(rows, torch.tensor([0, 5]), [1])
    assert torch.equal(dst["b"][:, 0], src["b"][:, 4]) and torch.equal(dst["b"][:, 5], src["b"][:, 1])
    assert dst["b"][:, 1:5].eq(0).all() and dst["a"].eq(0).all()


def test_gathered_row_holds_the_bytes_its_segments_address():
    t = kv_split()
    t.copy_(torch.randn(t.shape))
    layout = BlockLayout({"l": t}, ["l"], NUM_BLOCKS)
    row = torch.empty(1, layout.payload_bytes([0]), dtype=torch.uint8)
    layout.gather(torch.tensor([3]), [0], row)
    expected = b"".join(ctypes.string_at(addr, size) for addr, size in layout.segments(3, [0]))
    assert row.numpy().tobytes() == expected


def test_host_fast_paths_copy_strided_blocks_without_their_padding():
    base = torch.randn(NUM_BLOCKS, 3, 32, 128).to(torch.float16)
    t = base[:, :2]  # blocks 3 pages apart, 2 pages long
    layout = BlockLayout({"l": t}, ["l"], NUM_BLOCKS)
    ids = torch.tensor([5, 0, 2])
    planes = torch.empty(len(ids) * layout.layer_bytes(0), dtype=torch.uint8)
    layout.gather_planes(ids, 0, planes)
    assert torch.equal(planes.view(torch.float16).view(3, 2, 32, 128), t[ids])
    padding = base[:, 2].clone()
    layout.scatter_planes(planes, torch.tensor([1, 3, 4]), 0)
    assert torch.equal(t[[1, 3, 4]], t[ids]) and torch.equal(base[:, 2], padding)


def test_host_fast_paths_refuse_a_non_contiguous_buffer():
    layout = BlockLayout({"l": block_major()}, ["l"], NUM_BLOCKS)
    strided = torch.empty(4 * layout.layer_bytes(0), dtype=torch.uint8)[::2]
    with pytest.raises(ValueError):
        layout.gather_planes(torch.tensor([0, 1]), 0, strided)


@pytest.mark.parametrize("shape", [block_major, kv_split])
def test_stacked_view_holds_each_plane_of_each_block(shape):
    whole = shape(NUM_BLOCKS + 2)  # K/V split: the V plane starts past two unused blocks
    whole.view(-1).copy_(torch.randn(whole.numel()))
    t = whole[:, :NUM_BLOCKS] if shape is kv_split else whole[:NUM_BLOCKS]
    layout = BlockLayout({"l0": t}, ["l0"], NUM_BLOCKS)
    stacked = layout.stacked(0)
    assert stacked.shape == (len(layout.planes[0]), NUM_BLOCKS, layout.planes[0][0].size)
    for p, plane in enumerate(layout.planes[0]):
        assert torch.equal(stacked[p], plane.blocks)


def _mixed_layers(device: str) -> dict[str, torch.Tensor]:
    """Five K/V-split layers of random bits, each its own allocation (as vLLM's per-layer caches)."""
    return {f"l{i}": torch.randint(-(1 << 15), 1 << 15, (2, NUM_BLOCKS, 16, 8, 16), dtype=torch.int16,
                                   device=device).view(torch.bfloat16) for i in range(5)}


def plane_kernel_moves_blocks(device: str) -> None:
    """The plane kernel gathers a batch of blocks of some layers into rows past a header and
    scatters them elsewhere: the bytes of torch's per-plane path, no other block touched; it leaves
    a one-layer batch to that path."""
    from vllm_aio.device.plane_copy import PlaneCopies

    caches = _mixed_layers(device)
    names = list(caches)
    reference = BlockLayout(caches, names, NUM_BLOCKS)
    reference._kernel = None  # torch's index ops, plane by plane
    kernel = PlaneCopies([[(p.base, p.stride, p.size) for p in planes] for planes in reference.planes],
                         torch.device(device))
    ids, into = torch.tensor([4, 0, 2], device=device), torch.tensor([1, 5, 3], device=device)
    for layers in ([0, 1, 2, 3, 4], [3, 1, 4, 0]):
        slots = torch.zeros(len(ids), 64 + reference.payload_bytes(layers), dtype=torch.uint8, device=device)
        want = torch.zeros(len(ids), reference.payload_bytes(layers), dtype=torch.uint8, device=device)
        assert kernel.gather(ids, layers, slots[:, 64:])  # rows strided past a header, as the pool's slots
        reference.gather(ids, layers, want)
        assert torch.equal(slots[:, 64:], want) and slots[:, :64].eq(0).all()
        before = {n: t.clone() for n, t in caches.items()}
        assert kernel.scatter(slots[:, 64:], into, layers)
        for i, name in enumerate(names):
            moved = before[name].clone()
            if i in layers:
                moved[:, into] = before[name][:, ids]
            assert torch.equal(caches[name].view(torch.int16), moved.view(torch.int16))
            caches[name].copy_(before[name])
    one = torch.zeros(len(ids), reference.payload_bytes([2]), dtype=torch.uint8, device=device)
    assert not kernel.gather(ids, [2], one) and one.eq(0).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_plane_kernel_moves_every_plane_of_a_batch_like_the_per_plane_path_on_cuda():
    assert BlockLayout(_mixed_layers("cuda"), [f"l{i}" for i in range(5)], NUM_BLOCKS)._kernel is not None
    plane_kernel_moves_blocks("cuda")
    torch.cuda.synchronize()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test runs the kernel itself")
def test_plane_kernel_moves_every_plane_of_a_batch_like_the_per_plane_path_in_tritons_interpreter():
    """Where there is no GPU (CI): the CUDA kernel's logic on the CPU, run by Triton's interpreter
    (set before Triton is imported; Triton 3.9's, not every version's, takes the planes' table)."""
    pytest.importorskip("triton")
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])}
    run = subprocess.run([sys.executable, "-c", "import test_block_layout as t; t.plane_kernel_moves_blocks('cpu')"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
