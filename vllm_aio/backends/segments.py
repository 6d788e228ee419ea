"""Copies between a value's scattered segments and one contiguous buffer.

``gather`` and ``scatter`` copy one value on the calling thread. A backend
that copies a whole batch instead collects the batch's copies in a
``CopyBatch`` and runs them with ``copy_all``, which spreads them over a few
threads: ``ctypes.memmove`` releases the GIL while it copies, and one core's
memcpy reaches only a fraction of a host's memory bandwidth (H200 host, 16
cores: ~5-6 GB/s on one thread, 34 GB/s for a multi-threaded memcpy).

The threads belong to one process-wide pool, created on first use and shared
by every backend instance (so none is leaked per instance). Its size is
``copy_threads()``: the cores this process may run on, at most
``MAX_COPY_THREADS``, or ``VLLM_AIO_COPY_THREADS`` if set; 1 (no pool at all)
on a machine of 2 cores or fewer. A batch too small to pay for waking threads
(under ``MIN_BYTES_PER_THREAD`` per thread), or made of small copies (under
``MIN_COPY_PER_THREAD`` per thread on average: see there), is copied on fewer
threads, down to the calling one alone. Copies back to back on both sides are
merged as they are collected.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

from vllm_aio.backends.base import Segment

# More threads than this stop paying off: a few cores already saturate a
# socket's memory bandwidth, and with TP > 1 every worker process copies at once.
MAX_COPY_THREADS = 8
# Waking a thread and waiting for it costs tens of microseconds; 512 KiB takes
# ~100 us to copy on one core, so each thread is given at least that much.
MIN_BYTES_PER_THREAD = 512 << 10
# Every memmove call takes the GIL back when it returns, so threads copying
# small pieces queue for the GIL instead of copying. On the H200 host, 8
# threads made the pool's get of 256 scattered 64 KiB values slower than one
# thread (4.7 vs 6.3 GB/s), while 2 MiB values went from ~5.5 to 22-26 GB/s.
# A batch whose copies average N x 64 KiB gets at most N threads (64 KiB
# copies: 1, as before; 512 KiB and more: 8).
MIN_COPY_PER_THREAD = 64 << 10
THREADS_ENV = "VLLM_AIO_COPY_THREADS"


def total(segments: Sequence[Segment]) -> int:
    return sum(size for _, size in segments)


def gather(segments: Sequence[Segment], dst: int) -> None:
    """Copy the segments, in order, to the contiguous buffer at ``dst``."""
    for address, size in segments:
        ctypes.memmove(dst, address, size)
        dst += size


def scatter(src: int, segments: Sequence[Segment]) -> None:
    """Copy the contiguous buffer at ``src`` out to the segments, in order."""
    for address, size in segments:
        ctypes.memmove(address, src, size)
        src += size


class CopyBatch:
    """The copies of a batch, collected for ``copy_all``.

    Held as three lists of ints rather than a tuple per copy: a batch has
    thousands of segments, and every tuple is an object the cyclic garbage
    collector tracks (its full passes, tens of ms with torch loaded, then
    land in the middle of a copy). A copy that starts where the previous one
    ended, on both sides, extends it: a batch's values often lie back to back
    in staging and in the pool (slots allocated together), and one call then
    replaces many.
    """

    __slots__ = ("dst", "src", "size")

    def __init__(self, copies: Iterable[tuple[int, int, int]] = ()) -> None:
        self.dst: list[int] = []
        self.src: list[int] = []
        self.size: list[int] = []
        for dst, src, size in copies:
            self.add(dst, src, size)

    def add(self, dst: int, src: int, size: int) -> None:
        """Copy ``size`` bytes from address ``src`` to address ``dst``."""
        if not size:
            return
        sizes = self.size
        if sizes:
            last = sizes[-1]
            if self.dst[-1] + last == dst and self.src[-1] + last == src:
                sizes[-1] = last + size
                return
        self.dst.append(dst)
        self.src.append(src)
        sizes.append(size)

    def gather(self, segments: Sequence[Segment], dst: int) -> None:
        """Add the copies of ``gather(segments, dst)``."""
        # ``add`` inlined: this runs once per segment of every put.
        dsts, srcs, sizes = self.dst, self.src, self.size
        for address, size in segments:
            if sizes and dsts[-1] + sizes[-1] == dst and srcs[-1] + sizes[-1] == address:
                sizes[-1] += size
            elif size:
                dsts.append(dst)
                srcs.append(address)
                sizes.append(size)
            dst += size

    def scatter(self, src: int, segments: Sequence[Segment]) -> None:
        """Add the copies of ``scatter(src, segments)``."""
        # ``add`` inlined: this runs once per segment of every get.
        dsts, srcs, sizes = self.dst, self.src, self.size
        for address, size in segments:
            if sizes and dsts[-1] + sizes[-1] == address and srcs[-1] + sizes[-1] == src:
                sizes[-1] += size
            elif size:
                dsts.append(address)
                srcs.append(src)
                sizes.append(size)
            src += size

    def copies(self) -> list[tuple[int, int, int]]:
        """(dst, src, size) of each copy, merged ones as one (for tests and debugging)."""
        return list(zip(self.dst, self.src, self.size))

    def __len__(self) -> int:
        return len(self.size)


def copy_threads() -> int:
    """Threads ``copy_all`` uses at most in this process."""
    configured = os.environ.get(THREADS_ENV)
    if configured:
        return max(1, int(configured))
    try:
        cores = len(os.sched_getaffinity(0))  # the cores we may use, not the machine's
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    # On 2 cores a second copy thread only competes with the engine's own threads.
    return 1 if cores <= 2 else min(cores, MAX_COPY_THREADS)


def copy_all(batch: CopyBatch, threads: int | None = None) -> None:
    """Run every copy of ``batch``; several threads share a large batch of large copies.

    Returns once every byte is copied. The copies must not overlap one
    another (they run in no particular order). ``threads`` (default
    ``copy_threads()``) caps the threads used, the calling one included.
    """
    nbytes = sum(batch.size)
    if nbytes < 2 * MIN_BYTES_PER_THREAD:  # the common small batch: no thread, no syscall
        _run(batch.dst, batch.src, batch.size)
        return
    parts = min(
        threads or copy_threads(),
        nbytes // MIN_BYTES_PER_THREAD,
        nbytes // len(batch) // MIN_COPY_PER_THREAD,
    )
    if parts <= 1:
        _run(batch.dst, batch.src, batch.size)
        return
    run_parallel([partial(_run, *chunk) for chunk in _split(batch, parts, nbytes)], parts)


def run_parallel(tasks: Sequence[Callable[[], object]], threads: int) -> None:
    """Run ``tasks``: with ``threads`` > 1, the first on the calling thread, the rest on the copy threads.

    For work that releases the GIL (memmove, numpy copies). Returns once every
    task has finished, even if one failed (none may still be writing into the
    caller's buffers), then re-raises the first failure.
    """
    if threads <= 1 or len(tasks) <= 1:
        for task in tasks:
            task()
        return
    futures: list[Future[object]] = []
    try:
        executor = _executor(len(tasks) - 1)
        for task in tasks[1:]:
            futures.append(executor.submit(task))
    except RuntimeError:  # the pool is shut down (interpreter exit): run the rest here
        for task in tasks[1 + len(futures):]:
            task()
    try:
        tasks[0]()  # the caller works too rather than idling while it waits
    finally:
        for future in futures:
            future.exception()
    for future in futures:
        future.result()


def _run(dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int]) -> None:
    move = ctypes.memmove  # a CFUNCTYPE call: the GIL is released while it copies
    for dst, src, size in zip(dsts, srcs, sizes):
        move(dst, src, size)


_Chunk = tuple[list[int], list[int], list[int]]  # _run's arguments


def _split(batch: CopyBatch, parts: int, nbytes: int) -> list[_Chunk]:
    """The batch's copies cut into at most ``parts`` chunks of nearly equal bytes, in order.

    A copy is split across chunks where a boundary falls inside it, so one
    huge value (or a batch of few) is shared as evenly as many small ones.
    """
    share = -(-nbytes // parts)
    # A multiple of 64: where the copies are cache-line aligned (pool slots, KV
    # blocks), no line is written by two threads.
    share = -(-share // 64) * 64
    chunks: list[_Chunk] = []
    chunk: _Chunk = ([], [], [])
    room = share
    for dst, src, size in zip(batch.dst, batch.src, batch.size):
        while size > room:
            if room:
                chunk[0].append(dst)
                chunk[1].append(src)
                chunk[2].append(room)
                dst, src, size = dst + room, src + room, size - room
            chunks.append(chunk)
            chunk, room = ([], [], []), share
        if size:
            chunk[0].append(dst)
            chunk[1].append(src)
            chunk[2].append(size)
            room -= size
    if chunk[2]:
        chunks.append(chunk)
    return chunks


# ---- the process-wide copy threads ---------------------------------------------
_executor_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _executor(workers: int) -> ThreadPoolExecutor:
    """The shared pool, created on first use with at least ``workers`` threads.

    It is never resized: a caller may hold it between taking it and
    submitting, so replacing it could refuse that caller's chunks; a request
    for more threads than it has just queues (still correct, only slower).
    ThreadPoolExecutor starts threads on demand up to its size and joins them
    at interpreter exit, so an idle pool costs nothing and exit is clean.
    """
    global _pool
    with _executor_lock:
        if _pool is None:
            size = max(workers, copy_threads() - 1)
            _pool = ThreadPoolExecutor(size, thread_name_prefix="vllm_aio-copy")
        return _pool


def shutdown_copy_threads() -> None:
    """Stop the shared copy threads; a later ``copy_all`` starts new ones.

    A copy running meanwhile still completes (chunks already handed to the
    threads are waited for; the others run on the calling thread).
    """
    global _pool
    with _executor_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True)


def _forget_pool_in_child() -> None:
    # A forked child inherits the pool object but not its threads: chunks
    # submitted to it would wait forever. The child starts a pool of its own.
    global _pool, _executor_lock
    _executor_lock = threading.Lock()  # it may have been held by a thread the child lacks
    _pool = None


os.register_at_fork(after_in_child=_forget_pool_in_child)
