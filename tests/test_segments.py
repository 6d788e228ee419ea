"""Unit tests of ``vllm_aio.backends.segments``: copy batches, their split and the copy threads.

``LocalBackend``'s use of them (a batch's values, torn reads) is tested in
``test_local_backend.py``. Thread counts are forced with ``threads=`` so that
the multi-threaded path runs on a 2-core machine too.
"""

from __future__ import annotations

import multiprocessing as mp
import threading

import numpy as np
import pytest

from vllm_aio.backends import segments
from vllm_aio.backends.segments import (
    MIN_BYTES_PER_THREAD,
    CopyBatch,
    copy_all,
    copy_threads,
    gather,
    scatter,
    shutdown_copy_threads,
)

KiB = 1 << 10


def random_bytes(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def scattered_copies(src: np.ndarray, dst: np.ndarray, sizes: list[int], seed: int = 0) -> list[tuple[int, int, int]]:
    """Copies of consecutive pieces of ``src`` to shuffled places of ``dst`` (same total)."""
    offsets = np.cumsum([0, *sizes[:-1]])
    order = np.random.default_rng(seed).permutation(len(sizes))
    out, pos = [], 0
    for i in order:
        out.append((dst.ctypes.data + pos, src.ctypes.data + int(offsets[i]), sizes[i]))
        pos += sizes[i]
    return out


@pytest.fixture
def recorded_threads(monkeypatch):
    """The name of the thread that ran each chunk."""
    used: list[str] = []
    real_run = segments._run

    def recording_run(*chunk):
        used.append(threading.current_thread().name)
        real_run(*chunk)

    monkeypatch.setattr(segments, "_run", recording_run)
    return used


# ---- copy batches ---------------------------------------------------------------


def one_copy(dst: np.ndarray, src: np.ndarray) -> CopyBatch:
    return CopyBatch([(dst.ctypes.data, src.ctypes.data, src.nbytes)])


def test_batch_gather_makes_the_same_bytes_as_gather():
    src = random_bytes(1000)
    segs = [(src.ctypes.data + 500, 300), (src.ctypes.data, 200), (src.ctypes.data + 900, 100)]
    want, got = np.zeros(600, np.uint8), np.zeros(600, np.uint8)
    gather(segs, want.ctypes.data)
    batch = CopyBatch()
    batch.gather(segs, got.ctypes.data)
    copy_all(batch)
    assert np.array_equal(got, want)
    assert np.array_equal(got[:300], src[500:800])


def test_batch_scatter_makes_the_same_bytes_as_scatter():
    src = random_bytes(600)
    want, got = np.zeros(1000, np.uint8), np.zeros(1000, np.uint8)
    segs_of = lambda buf: [(buf.ctypes.data + 500, 300), (buf.ctypes.data, 200), (buf.ctypes.data + 900, 100)]  # noqa: E731
    scatter(src.ctypes.data, segs_of(want))
    batch = CopyBatch()
    batch.scatter(src.ctypes.data, segs_of(got))
    copy_all(batch)
    assert np.array_equal(got, want)
    assert np.array_equal(got[500:800], src[:300])


# ---- splitting a batch between threads ---------------------------------------------


@pytest.mark.parametrize("sizes, parts", [
    ([1000] * 10, 4),  # many equal copies
    ([7, 5000, 3, 64, 999], 3),  # uneven: boundaries fall inside copies
    ([1 << 20], 8),  # one huge copy shared by every thread
    ([100] * 3, 8),  # fewer bytes than parts * 64
])
def test_split_covers_every_byte_once_in_order_in_balanced_chunks(sizes, parts):
    copies, pos = [], 0
    for size in sizes:  # dst and src apart by a constant: pieces must keep it
        copies.append((10**9 + pos, pos, size))
        pos += size
    batch = CopyBatch()
    batch.dst, batch.src, batch.size = [c[0] for c in copies], [c[1] for c in copies], [c[2] for c in copies]
    chunks = [list(zip(*chunk)) for chunk in segments._split(batch, parts, pos)]  # unmerged, as given
    pieces = [c for chunk in chunks for c in chunk]
    assert 1 <= len(chunks) <= parts
    assert all(chunks) and all(size > 0 for _, _, size in pieces)
    assert all(dst - src == 10**9 for dst, src, _ in pieces)
    # Consecutive and complete: each piece starts where the previous ended.
    assert [src for _, src, _ in pieces] == list(np.cumsum([0] + [s for _, _, s in pieces[:-1]]))
    assert sum(s for _, _, s in pieces) == pos
    share = -(-pos // parts)
    assert all(sum(s for _, _, s in chunk) <= share + 63 for chunk in chunks)


# ---- copy_all -----------------------------------------------------------------------


def test_large_batch_is_shared_by_several_threads_and_copies_every_byte(recorded_threads):
    sizes = [256 * KiB + 13 * i for i in range(16)]  # ~4 MiB, uneven, unaligned
    src, dst = random_bytes(sum(sizes), seed=1), np.zeros(sum(sizes), np.uint8)
    copies = scattered_copies(src, dst, sizes, seed=2)
    copy_all(CopyBatch(copies), threads=4)
    assert len(recorded_threads) == 4
    assert recorded_threads.count(threading.current_thread().name) == 1  # the caller copied a chunk too
    assert sum(name.startswith("vllm_aio-copy") for name in recorded_threads) == 3
    want = np.zeros_like(dst)
    for d, s, n in copies:
        want[d - dst.ctypes.data:][:n] = src[s - src.ctypes.data:][:n]
    assert np.array_equal(dst, want)


def test_one_huge_copy_is_split_between_threads(recorded_threads):
    src, dst = random_bytes(8 << 20, seed=3), np.zeros(8 << 20, np.uint8)
    copy_all(one_copy(dst, src), threads=4)
    assert len(recorded_threads) == 4
    assert np.array_equal(dst, src)


def test_small_batch_is_copied_on_the_calling_thread(recorded_threads):
    src, dst = random_bytes(2 * MIN_BYTES_PER_THREAD - 1), np.zeros(2 * MIN_BYTES_PER_THREAD - 1, np.uint8)
    copy_all(one_copy(dst, src), threads=8)
    assert recorded_threads == [threading.current_thread().name]
    assert np.array_equal(dst, src)


def test_threads_are_capped_by_bytes_per_thread(recorded_threads):
    size = 3 * MIN_BYTES_PER_THREAD
    src, dst = random_bytes(size), np.zeros(size, np.uint8)
    copy_all(one_copy(dst, src), threads=8)
    assert len(recorded_threads) == 3
    assert np.array_equal(dst, src)


def test_batch_of_small_copies_gets_one_thread_per_64_kib_of_average_copy(recorded_threads):
    # 64 pieces, each copied to a place not right after the previous one's: nothing merges.
    for piece, want_threads in ((64 * KiB, 1), (128 * KiB, 2), (256 * KiB, 4)):
        recorded_threads.clear()
        src, dst = random_bytes(64 * piece), np.zeros(2 * 64 * piece, np.uint8)
        copies = [(dst.ctypes.data + 2 * i * piece, src.ctypes.data + i * piece, piece) for i in range(64)]
        copy_all(CopyBatch(copies), threads=8)
        assert len(recorded_threads) == want_threads, piece
        assert np.array_equal(dst.reshape(64, 2, piece)[:, 0], src.reshape(64, piece))


def test_back_to_back_copies_merge_into_one():
    base_dst, base_src = 10**9, 0
    batch = CopyBatch((base_dst + 100 * i, base_src + 100 * i, 100) for i in range(5))
    assert batch.copies() == [(base_dst, base_src, 500)]
    assert len(batch) == 1


def test_copies_merge_only_where_both_sides_are_back_to_back():
    copies = [
        (1000, 0, 100),
        (1100, 100, 50),  # merges
        (1150, 500, 50),  # destination follows, source does not
        (2000, 550, 10),  # source follows, destination does not
        (2010, 560, 0),  # empty: dropped
        (2010, 560, 5),  # merges with (2000, 550, 10) across the empty one
    ]
    assert CopyBatch(copies).copies() == [(1000, 0, 150), (1150, 500, 50), (2000, 550, 15)]


def test_batch_gather_of_back_to_back_segments_is_one_copy():
    batch = CopyBatch()
    batch.gather([(5000, 100), (5100, 28)], 9000)  # a value's segments adjacent in memory
    batch.gather([(5128, 72)], 9128)  # the next value, adjacent on both sides
    assert batch.copies() == [(9000, 5000, 200)]


def test_merged_back_to_back_values_are_shared_by_threads(recorded_threads):
    # 64 KiB values alone stay on one thread; back to back on both sides, they are one copy.
    src, dst = random_bytes(4 << 20), np.zeros(4 << 20, np.uint8)
    piece = 64 * KiB
    copy_all(CopyBatch((dst.ctypes.data + i * piece, src.ctypes.data + i * piece, piece) for i in range(64)), threads=4)
    assert len(recorded_threads) == 4
    assert np.array_equal(dst, src)


def test_empty_batch_copies_nothing(recorded_threads):
    copy_all(CopyBatch(), threads=8)
    assert recorded_threads == [threading.current_thread().name]


def test_failure_in_a_copy_thread_is_raised_after_every_chunk_ran(monkeypatch):
    ran: list[str] = []
    real_run = segments._run

    def failing_in_copy_threads(*chunk):
        real_run(*chunk)
        ran.append(threading.current_thread().name)
        if threading.current_thread().name.startswith("vllm_aio-copy"):
            raise OSError("copy thread failed")

    monkeypatch.setattr(segments, "_run", failing_in_copy_threads)
    size = 4 * MIN_BYTES_PER_THREAD
    src, dst = random_bytes(size), np.zeros(size, np.uint8)
    with pytest.raises(OSError, match="copy thread failed"):
        copy_all(one_copy(dst, src), threads=4)
    assert len(ran) == 4
    assert np.array_equal(dst, src)


def test_copy_threads_stop_on_shutdown_and_restart_on_next_copy(recorded_threads):
    size = 2 * MIN_BYTES_PER_THREAD
    src, dst = random_bytes(size), np.zeros(size, np.uint8)
    copy_all(one_copy(dst, src), threads=2)
    shutdown_copy_threads()
    assert not [t for t in threading.enumerate() if t.name.startswith("vllm_aio-copy")]
    dst[:] = 0
    copy_all(one_copy(dst, src), threads=2)
    assert np.array_equal(dst, src)
    assert sum(name.startswith("vllm_aio-copy") for name in recorded_threads) == 2


def test_copy_pool_is_shared_not_made_per_call():
    size = 4 * MIN_BYTES_PER_THREAD
    src, dst = random_bytes(size), np.zeros(size, np.uint8)
    for _ in range(20):
        copy_all(one_copy(dst, src), threads=4)
    assert len([t for t in threading.enumerate() if t.name.startswith("vllm_aio-copy")]) <= max(3, copy_threads() - 1)


def _copy_in_forked_child(result) -> None:
    size = 4 * MIN_BYTES_PER_THREAD
    src, dst = random_bytes(size), np.zeros(size, np.uint8)
    copy_all(one_copy(dst, src), threads=4)  # would hang on the parent's pool
    result.put(bool(np.array_equal(dst, src)))


def test_forked_child_copies_with_threads_of_its_own():
    size = 4 * MIN_BYTES_PER_THREAD
    src, dst = random_bytes(size), np.zeros(size, np.uint8)
    copy_all(one_copy(dst, src), threads=4)  # the parent's pool exists
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


# ---- how many threads ---------------------------------------------------------------


@pytest.mark.parametrize("cores, want", [(1, 1), (2, 1), (3, 3), (8, 8), (16, 8), (128, 8)])
def test_copy_threads_follow_the_cores_we_may_use(monkeypatch, cores, want):
    monkeypatch.delenv(segments.THREADS_ENV, raising=False)
    monkeypatch.setattr(segments.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert copy_threads() == want


def test_copy_threads_env_overrides_the_core_count(monkeypatch):
    monkeypatch.setattr(segments.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv(segments.THREADS_ENV, "3")
    assert copy_threads() == 3
    monkeypatch.setenv(segments.THREADS_ENV, "0")
    assert copy_threads() == 1
