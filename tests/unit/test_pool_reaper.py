"""``vllm_aio.pool.reaper``: a pool shared by name freed once its processes all ended without detaching."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from vllm_aio.backends.local import LocalBackend
from vllm_aio.pool import reaper
from vllm_aio.pool.host_pool import SharedHostPool
from vllm_aio.pool.shm_file import SHM_DIR, free_if_abandoned

SLOT = 4096


def _files(name: str) -> list[str]:
    """What of pool ``name`` is in /dev/shm: the pool and its lock."""
    return sorted(p.name for p in SHM_DIR.glob(f"vllm_aio*.{name}"))


@pytest.fixture
def name() -> Iterator[str]:
    made = f"test-{uuid.uuid4().hex[:16]}"
    yield made
    for path in SHM_DIR.glob(f"vllm_aio*.{made}"):
        path.unlink(missing_ok=True)


def _gone_within(name: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _files(name) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _files(name)


def _open_shared_and_hang(name: str, ready) -> None:
    backend = LocalBackend(name, 4 * SLOT, SLOT, seal=False, shared=True)  # noqa: F841 - mapped until killed
    ready.set()
    time.sleep(120)


def test_a_shared_pool_is_freed_once_its_processes_were_killed(name):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=_open_shared_and_hang, args=(name, ready))
    child.start()
    try:
        assert ready.wait(60), "the child did not open its pool"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)  # reaped: a zombie still answers kill(pid, 0)
    assert _gone_within(name, 30), _files(name)


def test_a_pool_with_a_live_process_is_left_alone_and_the_reaper_ends_with_it(name):
    pool = SharedHostPool(name, SLOT, 4)
    watcher = threading.Thread(target=reaper.reap, args=(name,))
    watcher.start()
    time.sleep(3 * reaper.POLL_S)
    assert f"vllm_aio.{name}" in _files(name) and watcher.is_alive()
    pool.close()  # the last process detaching unlinks the pool; the reaper then leaves too
    watcher.join(30)
    assert not watcher.is_alive() and _files(name) == []


def test_a_pool_detached_as_the_reaper_checks_it_leaves_no_lock_file(name):
    # The reaper saw the pool, then its last process detached (pool and lock file unlinked) before
    # the reaper took the lock: taking it made a new lock file, which must not outlive the check.
    assert free_if_abandoned(name) is None
    assert _files(name) == []


def test_one_reaper_watches_a_pool(name):
    pool = SharedHostPool(name, SLOT, 4)
    watcher = threading.Thread(target=reaper.reap, args=(name,))
    watcher.start()
    try:
        time.sleep(reaper.POLL_S)
        second = threading.Thread(target=reaper.reap, args=(name,))
        second.start()
        second.join(10)
        assert not second.is_alive(), "a second reaper of the same pool should leave at once"
    finally:
        pool.close()
        watcher.join(30)
