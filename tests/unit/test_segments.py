"""Unit tests of ``vllm_aio.backends.segments``: one value's copies and a batch's flattened segments.

The copies themselves (threads, splitting) are tested in ``test_host_copy.py``;
``LocalBackend``'s use of them (a batch's values, torn reads) in
``test_local_backend.py``.
"""

from __future__ import annotations

import numpy as np

from vllm_aio.backends.segments import FlatSegments, gather, scatter, total
from vllm_aio.device.host_copy import copy_many


def random_bytes(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def value_segments(buf: np.ndarray) -> list[tuple[int, int]]:
    """A value of 600 bytes scattered over three places of ``buf`` (1000 bytes), out of order."""
    return [(buf.ctypes.data + 500, 300), (buf.ctypes.data, 200), (buf.ctypes.data + 900, 100)]


def test_gather_copies_in_segment_order():
    src = random_bytes(1000)
    dst = np.zeros(600, np.uint8)
    gather(value_segments(src), dst.ctypes.data)
    assert np.array_equal(dst, np.concatenate([src[500:800], src[:200], src[900:]]))


def test_scatter_is_the_inverse_of_gather():
    src = random_bytes(600)
    dst = np.zeros(1000, np.uint8)
    scatter(src.ctypes.data, value_segments(dst))
    back = np.zeros(600, np.uint8)
    gather(value_segments(dst), back.ctypes.data)
    assert np.array_equal(back, src)
    assert total(value_segments(dst)) == 600


def test_flat_segments_gather_makes_the_same_bytes_as_gather_per_value():
    srcs = [random_bytes(1000, seed) for seed in range(3)]
    flat = FlatSegments.of([value_segments(s) for s in srcs])
    want, got = np.zeros((3, 600), np.uint8), np.zeros((3, 600), np.uint8)
    for row, src in zip(want, srcs):
        gather(value_segments(src), row.ctypes.data)
    copy_many(*flat.gather_copies([0, 1, 2], [row.ctypes.data for row in got]))
    assert np.array_equal(got, want)


def test_flat_segments_scatter_makes_the_same_bytes_as_scatter_per_value():
    src = random_bytes(3 * 600).reshape(3, 600)
    want, got = np.zeros((3, 1000), np.uint8), np.zeros((3, 1000), np.uint8)
    for row, dst in zip(src, want):
        scatter(row.ctypes.data, value_segments(dst))
    flat = FlatSegments.of([value_segments(dst) for dst in got])
    copy_many(*flat.scatter_copies([row.ctypes.data for row in src], [0, 1, 2]))
    assert np.array_equal(got, want)


def test_flat_segments_copy_only_the_chosen_values_in_the_order_given():
    srcs = [random_bytes(1000, seed) for seed in range(4)]
    flat = FlatSegments.of([value_segments(s) for s in srcs])
    got = np.zeros((2, 600), np.uint8)
    copy_many(*flat.gather_copies([3, 1], [row.ctypes.data for row in got]))
    for row, i in zip(got, (3, 1)):
        want = np.zeros(600, np.uint8)
        gather(value_segments(srcs[i]), want.ctypes.data)
        assert np.array_equal(row, want)


def test_flat_segments_totals_are_each_values_bytes_empty_ones_included():
    flat = FlatSegments.of([[(1000, 10), (5000, 20)], [], [(9000, 7)]])
    assert flat.totals().tolist() == [30, 0, 7]


def test_flat_segments_of_no_values_make_no_copies():
    flat = FlatSegments.of([])
    assert flat.totals().tolist() == []
    assert [len(a) for a in flat.gather_copies([], [])] == [0, 0, 0]
