"""Unit tests of ``vllm_aio.device.host_copy``: batched copies, rows, the copy threads.

Thread counts are forced with ``threads=`` so that the multi-threaded path
runs on a 2-core machine too. No timing: speed lives in
``benchmarks/pool_bandwidth.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import threading

import numpy as np
import pytest

from vllm_aio.device import host_copy
from vllm_aio.device.host_copy import (
    MIN_BYTES_PER_THREAD,
    copy_many,
    copy_rows,
    copy_threads,
    shutdown_copy_threads,
)

KiB = 1 << 10


def random_bytes(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def addresses(buf: np.ndarray, offsets) -> np.ndarray:
    return buf.ctypes.data + np.asarray(offsets, dtype=np.int64)


def copy_threads_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("vllm_aio-copy")]


def scattered(sizes: list[int], seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """src, a zeroed dst of twice its size, and each piece's offsets: consecutive in src, shuffled in dst, with gaps."""
    src, dst = random_bytes(sum(sizes), seed), np.zeros(2 * sum(sizes), np.uint8)
    src_off = np.cumsum([0, *sizes[:-1]])
    dst_off, pos = np.zeros(len(sizes), np.int64), 0
    for i in np.random.default_rng(seed).permutation(len(sizes)):
        dst_off[i] = pos
        pos += 2 * sizes[i]  # the piece, then a gap as large, left untouched
    return src, dst, src_off, dst_off


# ---- copy_many ----------------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_copy_many_matches_numpy_over_scattered_pieces(threads):
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 300 * KiB, 64)  # ~9.6 MiB: several threads' worth
    sizes[::7] = 0  # empty copies among them
    sizes = sizes.tolist()
    src, dst, src_off, dst_off = scattered(sizes, seed=2)
    want = dst.copy()
    for s, d, n in zip(src_off, dst_off, sizes):
        want[d : d + n] = src[s : s + n]
    copy_many(addresses(dst, dst_off), addresses(src, src_off), np.array(sizes), threads=threads)
    assert np.array_equal(dst, want)


def test_copy_many_takes_uint64_addresses():
    src, dst = random_bytes(4 * KiB), np.zeros(4 * KiB, np.uint8)
    offsets = np.arange(4, dtype=np.uint64) * KiB
    sizes = np.full(4, KiB, np.uint64)
    copy_many(np.uint64(dst.ctypes.data) + offsets, np.uint64(src.ctypes.data) + offsets[::-1], sizes)
    assert np.array_equal(dst.reshape(4, KiB), src.reshape(4, KiB)[::-1])


def test_copy_many_of_nothing_copies_nothing():
    copy_many(np.array([], np.int64), np.array([], np.int64), np.array([], np.int64), threads=4)
    dst = np.zeros(16, np.uint8)
    copy_many(addresses(dst, [0]), addresses(random_bytes(16), [0]), np.array([0]), threads=4)
    assert not dst.any()


def test_one_huge_copy_is_shared_by_the_copy_threads():
    shutdown_copy_threads()
    size = 8 * MIN_BYTES_PER_THREAD + 13  # unaligned: the last part is short
    src, dst = random_bytes(size, seed=3), np.zeros(size, np.uint8)
    copy_many(addresses(dst, [0]), addresses(src, [0]), np.array([size]), threads=4)
    assert np.array_equal(dst, src)
    assert copy_threads_alive()  # parts ran on the pool (the caller took one)


def test_small_batch_starts_no_copy_thread():
    shutdown_copy_threads()
    size = 2 * MIN_BYTES_PER_THREAD - 1
    src, dst = random_bytes(size), np.zeros(size, np.uint8)
    copy_many(addresses(dst, [0]), addresses(src, [0]), np.array([size]), threads=8)
    assert np.array_equal(dst, src)
    assert not copy_threads_alive()


def test_one_thread_and_many_make_identical_bytes():
    rng = np.random.default_rng(4)
    sizes = rng.integers(1, 64 * KiB, 400).tolist()
    src, one, src_off, dst_off = scattered(sizes, seed=5)
    many = one.copy()
    for dst, threads in ((one, 1), (many, 8)):
        copy_many(addresses(dst, dst_off), addresses(src, src_off), np.array(sizes), threads=threads)
    assert np.array_equal(one, many)


@pytest.mark.parametrize("dst_n, src_n, size_n", [(3, 2, 2), (2, 3, 2), (2, 2, 3)])
def test_copy_many_of_mismatched_lengths_is_refused_before_copying(dst_n, src_n, size_n):
    src, dst = random_bytes(3 * KiB), np.zeros(3 * KiB, np.uint8)
    with pytest.raises(ValueError):
        copy_many(addresses(dst, np.arange(dst_n) * KiB), addresses(src, np.arange(src_n) * KiB),
                  np.full(size_n, KiB))
    assert not dst.any()


@pytest.mark.parametrize("bad", [np.array([[KiB]]), np.array([1.0 * KiB]), np.array([-1])])
def test_copy_many_of_bad_sizes_is_refused_before_copying(bad):
    src, dst = random_bytes(KiB), np.zeros(KiB, np.uint8)
    with pytest.raises(ValueError):
        copy_many(addresses(dst, [0]), addresses(src, [0]), bad)
    assert not dst.any()


# ---- copy_rows ----------------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("row, dst_stride, src_stride", [
    (16 * KiB, 16 * KiB, 16 * KiB),  # pool slots <-> a block-major plane: rows back to back
    (4 * KiB + 8, 64 * KiB, 5 * KiB),  # strided on both sides, unaligned rows
])
def test_copy_rows_matches_numpy_over_scattered_rows(threads, row, dst_stride, src_stride):
    rng = np.random.default_rng(6)
    n, num_src, num_dst = 300, 400, 500
    src = random_bytes(num_src * src_stride, seed=7)
    dst = np.zeros(num_dst * dst_stride, np.uint8)
    src_rows = rng.choice(num_src, n, replace=True)  # a gather may read a row twice
    dst_rows = rng.choice(num_dst, n, replace=False)
    want = dst.copy()
    for d, s in zip(dst_rows, src_rows):
        want[d * dst_stride :][:row] = src[s * src_stride :][:row]
    copy_rows(dst.ctypes.data, dst_stride, dst_rows, src.ctypes.data, src_stride, src_rows, row, threads=threads)
    assert np.array_equal(dst, want)


def test_copy_rows_of_nothing_copies_nothing():
    src, dst = random_bytes(KiB), np.zeros(KiB, np.uint8)
    copy_rows(dst.ctypes.data, KiB, np.array([], np.int64), src.ctypes.data, KiB, np.array([], np.int64), KiB)
    copy_rows(dst.ctypes.data, KiB, np.array([0]), src.ctypes.data, KiB, np.array([0]), 0, threads=4)
    assert not dst.any()


def test_one_huge_row_is_shared_by_the_copy_threads():
    shutdown_copy_threads()
    size = 8 * MIN_BYTES_PER_THREAD + 13
    src, dst = random_bytes(size, seed=8), np.zeros(size, np.uint8)
    copy_rows(dst.ctypes.data, size, np.array([0]), src.ctypes.data, size, np.array([0]), size, threads=4)
    assert np.array_equal(dst, src)
    assert copy_threads_alive()


def test_copy_rows_of_mismatched_lengths_is_refused_before_copying():
    src, dst = random_bytes(4 * KiB), np.zeros(4 * KiB, np.uint8)
    with pytest.raises(ValueError):
        copy_rows(dst.ctypes.data, KiB, np.arange(3), src.ctypes.data, KiB, np.arange(4), KiB)
    assert not dst.any()


def test_copy_rows_of_negative_size_is_refused():
    src, dst = random_bytes(KiB), np.zeros(KiB, np.uint8)
    with pytest.raises(ValueError):
        copy_rows(dst.ctypes.data, KiB, np.array([0]), src.ctypes.data, KiB, np.array([0]), -1)


# ---- the copy threads ---------------------------------------------------------------


def test_copy_threads_stop_on_shutdown_and_restart_on_next_copy():
    size = 4 * MIN_BYTES_PER_THREAD
    src, dst = random_bytes(size), np.zeros(size, np.uint8)
    copy_many(addresses(dst, [0]), addresses(src, [0]), np.array([size]), threads=2)
    shutdown_copy_threads()
    assert not copy_threads_alive()
    dst[:] = 0
    copy_many(addresses(dst, [0]), addresses(src, [0]), np.array([size]), threads=2)
    assert np.array_equal(dst, src)
    assert copy_threads_alive()


def test_copy_pool_is_shared_not_made_per_call():
    size = 8 * MIN_BYTES_PER_THREAD
    src, dst = random_bytes(size), np.zeros(size, np.uint8)
    for _ in range(20):
        copy_many(addresses(dst, [0]), addresses(src, [0]), np.array([size]), threads=4)
    assert len(copy_threads_alive()) <= max(3, copy_threads() - 1)


def _copy_in_forked_child(result) -> None:
    size = 8 * MIN_BYTES_PER_THREAD
    src, dst = random_bytes(size), np.zeros(size, np.uint8)
    copy_many(addresses(dst, [0]), addresses(src, [0]), np.array([size]), threads=4)  # would hang on the parent's pool
    result.put(bool(np.array_equal(dst, src)))


def test_forked_child_copies_with_threads_of_its_own():
    size = 8 * MIN_BYTES_PER_THREAD
    src, dst = random_bytes(size), np.zeros(size, np.uint8)
    copy_many(addresses(dst, [0]), addresses(src, [0]), np.array([size]), threads=4)  # the parent's pool exists
    ctx = mp.get_context("fork")
    result = ctx.Queue()
    child = ctx.Process(target=_copy_in_forked_child, args=(result,))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the forked child hung copying")
    assert child.exitcode == 0
    assert result.get(timeout=10) is True


@pytest.mark.parametrize("cores, want", [(1, 1), (2, 2), (3, 3), (8, 8), (16, 8), (128, 8)])
def test_copy_threads_follow_the_cores_we_may_use(monkeypatch, cores, want):
    monkeypatch.delenv(host_copy.THREADS_ENV, raising=False)
    monkeypatch.setattr(host_copy.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert copy_threads() == want


def test_copy_threads_env_overrides_the_core_count(monkeypatch):
    monkeypatch.setattr(host_copy.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv(host_copy.THREADS_ENV, "3")
    assert copy_threads() == 3
    monkeypatch.setenv(host_copy.THREADS_ENV, "0")
    assert copy_threads() == 1
