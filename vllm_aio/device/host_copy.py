"""Batched host memory copies: compiled loops over raw addresses, shared out over a few threads.

``copy_many`` copies a batch of (dst, src, size) triples, ``copy_rows`` a
gather/scatter of equal rows between two strided regions (pool slots <-> a KV
cache plane). Each runs in loops compiled by numba (``nogil``: the threads
really copy at once) that call libc's ``memcpy`` per copy. One
``ctypes.memmove`` per copy from Python costs a sizeable part of a small
copy's time; in the compiled loop small copies come close to one memcpy of
the same bytes. A loop copying through ``numba.carray`` slices is far slower:
it does not use libc's vectorised copy. Merging copies adjacent on both sides
gained nothing measurable, so none is merged (figures: docs/benchmarks.md,
"Figures behind the code's choices").

The loops are compiled on their first call and cached on disk next to this
file (``__pycache__``), or in the user's cache directory (``~/.cache/numba``)
where that is read-only; with neither writable, each process compiles them.
The first copy in a process pays for numba's compiler setup even from the
cache; later calls cost microseconds.

The threads belong to one process-wide pool, created on first use and shared
by every caller (so none is leaked per instance); a forked child starts a
pool of its own. A batch gets at most ``copy_threads()`` threads, the caller
included, with at least ``MIN_BYTES_PER_THREAD`` each; they take pieces of
``PIECE_BYTES`` in turn, cut by bytes, not by copies: one huge copy is shared
as evenly as many small ones.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# More threads than this stop paying off: a few cores already saturate a
# socket's memory bandwidth, and with TP > 1 every worker process copies at once.
MAX_COPY_THREADS = 8
# Waking a copy thread and waiting for it costs tens of microseconds, so a
# thread is given at least this much: on scattered copies, two threads made
# batches of less than twice this slower than one, and larger ones faster.
MIN_BYTES_PER_THREAD = 2 << 20
# The threads take pieces of a batch in turn, so a thread whose core is busy
# elsewhere leaves its share to the others. Much smaller pieces lose to the GIL
# round trips between them, larger ones gained nothing. A multiple of 64: where
# the copies are cache-line aligned (pool slots, KV blocks), no line is written
# by two threads.
PIECE_BYTES = 1 << 20
THREADS_ENV = "VLLM_AIO_COPY_THREADS"


def copy_threads() -> int:
    """Threads a copy uses at most in this process: the cores it may run on, capped."""
    configured = os.environ.get(THREADS_ENV)
    if configured:
        return max(1, int(configured))
    try:
        cores = len(os.sched_getaffinity(0))  # the cores we may use, not the machine's
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    # Every core, even on 2: two threads beat one on a 2-core host with both cores
    # idle and lose little with one busy with another process (the threads take
    # pieces in turn, so the caller does what a late thread leaves).
    return min(cores, MAX_COPY_THREADS)


def copy_many(dst: np.ndarray, src: np.ndarray, size: np.ndarray, threads: int | None = None) -> None:
    """For each i copy size[i] bytes from address src[i] to address dst[i] (int64/uint64 arrays of raw addresses).

    Copies must not overlap. Returns when all are done.
    """
    dst, src, size = _addresses(dst), _addresses(src), _addresses(size)
    if not len(dst) == len(src) == len(size):
        raise ValueError(f"copy_many: {len(dst)} destinations, {len(src)} sources, {len(size)} sizes")
    if len(size) and size.min() < 0:
        raise ValueError("copy_many: negative size")
    ends = np.cumsum(size)
    _share(partial(_copy_span, dst, src, ends), int(ends[-1]) if len(ends) else 0, threads)


def copy_rows(
    dst_base: int,
    dst_stride: int,
    dst_rows: np.ndarray,
    src_base: int,
    src_stride: int,
    src_rows: np.ndarray,
    size: int,
    threads: int | None = None,
) -> None:
    """For each i copy ``size`` bytes from src_base + src_rows[i]*src_stride to dst_base + dst_rows[i]*dst_stride.

    ``*_rows`` are int64 row arrays: a gather/scatter of fixed-size rows between
    two strided regions (pool slots <-> a KV cache plane) in one call. Rows
    are not bounds-checked; destination rows must not overlap a source row or
    one another.
    """
    dst_rows, src_rows = _addresses(dst_rows), _addresses(src_rows)
    if len(dst_rows) != len(src_rows):
        raise ValueError(f"copy_rows: {len(dst_rows)} destination rows, {len(src_rows)} source rows")
    if size < 0:
        raise ValueError("copy_rows: negative size")
    kernel = partial(_copy_row_span, dst_base, dst_stride, dst_rows, src_base, src_stride, src_rows, size)
    _share(kernel, len(dst_rows) * size, threads)


def warm_up() -> None:
    """Both loops compiled (or loaded from numba's cache) now: at start, not in the first request's step."""
    src, dst = np.ones(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    one = np.zeros(1, dtype=np.int64)
    copy_many(np.array([dst.ctypes.data]), np.array([src.ctypes.data]), np.array([32]))
    copy_rows(dst.ctypes.data + 32, 32, one, src.ctypes.data, 32, one, 32)


def _addresses(a: np.ndarray) -> np.ndarray:
    """``a`` as a contiguous 1-D int64 array (uint64 addresses reinterpreted, not copied)."""
    a = np.asarray(a)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ValueError(f"expected a 1-D integer array, got {a.dtype} of shape {a.shape}")
    return np.ascontiguousarray(a.view(np.int64) if a.dtype == np.uint64 else a, dtype=np.int64)


def _share(kernel: Callable[[int, int], None], nbytes: int, threads: int | None) -> None:
    """Run ``kernel(lo, hi)`` over bytes [0, nbytes) of a batch, in pieces the caller and copy threads take in turn."""
    if not nbytes:
        return
    workers = max(1, min(threads or copy_threads(), nbytes // MIN_BYTES_PER_THREAD))
    if workers == 1:
        kernel(0, nbytes)
        return
    next_piece = itertools.count(0, PIECE_BYTES).__next__  # one call is atomic under the GIL

    def work() -> None:
        while (lo := next_piece()) < nbytes:
            kernel(lo, min(lo + PIECE_BYTES, nbytes))

    _run_shared(work, workers - 1)


def _run_shared(work: Callable[[], None], helpers: int) -> None:
    """Run ``work`` on the calling thread and on up to ``helpers`` copy threads at once.

    ``work`` takes pieces until none is left, so any thread may do all of it:
    a helper that has not started when the caller runs out (its core busy
    with other work, or the batch small) is cancelled, not waited for.
    Returns once every helper that started has finished, even if one failed
    (none may still be writing into the caller's buffers), then re-raises the
    first failure.
    """
    futures: list[Future[None]] = []
    try:
        executor = _executor(helpers)
        for _ in range(helpers):
            futures.append(executor.submit(work))
    except RuntimeError:  # the pool is shut down (interpreter exit): the caller does it all
        pass
    try:
        work()
    finally:
        for future in futures:
            future.cancel()
        wait(futures)
    for future in futures:
        if not future.cancelled():
            future.result()


# ---- the compiled loops ------------------------------------------------------------
def _compiled(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` compiled without the GIL, cached on disk where numba finds a writable directory."""
    try:
        return njit(nogil=True, cache=True)(fn)
    except RuntimeError:  # "no locator available": read-only install and home; compile in each process
        return njit(nogil=True)(fn)


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):  # noqa: ARG001 (numba's intrinsic signature)
    """libc memcpy(dst, src, nbytes) on int64 addresses (LLVM's memcpy: a call to libc's for unknown sizes)."""

    def codegen(context, builder, signature, args):  # noqa: ARG001
        to, source, count = args  # LLVM values of the three int64 arguments
        pointer = cgutils.voidptr_t
        cgutils.raw_memcpy(builder, builder.inttoptr(to, pointer), builder.inttoptr(source, pointer), count, 1)

    return types.void(types.int64, types.int64, types.int64), codegen


@_compiled
def _copy_span(dst: np.ndarray, src: np.ndarray, ends: np.ndarray, lo: int, hi: int) -> None:
    """The bytes [lo, hi) of the batch, the copies' bytes counted back to back in order (copy i ends at ends[i])."""
    i = np.searchsorted(ends, lo, side="right")  # the first copy ending after lo
    while i < ends.shape[0]:
        start = ends[i - 1] if i else 0
        a, b = max(start, lo), min(ends[i], hi)
        _memcpy(dst[i] + a - start, src[i] + a - start, b - a)
        if ends[i] >= hi:
            return
        i += 1


@_compiled
def _copy_row_span(
    dst_base: int,
    dst_stride: int,
    dst_rows: np.ndarray,
    src_base: int,
    src_stride: int,
    src_rows: np.ndarray,
    size: int,
    lo: int,
    hi: int,
) -> None:
    """The bytes [lo, hi) of the rows, counted back to back in order."""
    row = lo // size
    offset = lo - row * size
    pos = lo
    while pos < hi:
        n = min(size - offset, hi - pos)
        _memcpy(dst_base + dst_rows[row] * dst_stride + offset, src_base + src_rows[row] * src_stride + offset, n)
        pos += n
        row += 1
        offset = 0


# ---- the process-wide copy threads ---------------------------------------------
_executor_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _executor(workers: int) -> ThreadPoolExecutor:
    """The shared pool, created on first use with at least ``workers`` threads.

    It is never resized: a caller may hold it between taking it and
    submitting, so replacing it could refuse that caller's parts; a request
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
    """Stop the shared copy threads; a later copy starts new ones.

    A copy running meanwhile still completes (parts already handed to the
    threads are waited for; the others run on the calling thread).
    """
    global _pool
    with _executor_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True)


def _forget_pool_in_child() -> None:
    # A forked child inherits the pool object but not its threads: parts
    # submitted to it would wait forever. The child starts a pool of its own.
    global _pool, _executor_lock
    _executor_lock = threading.Lock()  # it may have been held by a thread the child lacks
    _pool = None


os.register_at_fork(after_in_child=_forget_pool_in_child)
