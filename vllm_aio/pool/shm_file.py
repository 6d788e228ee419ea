"""An embedded pool's file in ``/dev/shm``: its creation, attachment, lock, pid table and end.

* No service and no port: the first process to attach creates the file. A
  private pool is unlinked (``seal``) as soon as its last process has
  attached, so the kernel frees it when they exit, even when killed. A pool
  shared by name is unlinked by the last process to detach; attached pids
  are listed in its header, so one whose processes all ended without
  detaching is freed by its reaper (``reaper.py``) or swept by the next pool
  created on this host.
* A new file gets all its memory at once (``posix_fallocate``): a page first
  touched once ``/dev/shm`` is full would kill the writer with SIGBUS.
* The name is shared by every local user: a file is opened without following
  symlinks and accepted only if it is a regular file of this user that no one
  else may read (``open_private``): KV reveals prompts.
* One lock per pool, a file of its own: ``flock`` across processes plus a
  ``threading.Lock`` within one.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from vllm_aio.pool.index_ops import EMPTY
from vllm_aio.pool.layout import (H_FIELDS, H_MAGIC, H_NUM_SLOTS, H_SLOT_SIZE, H_TABLE_SIZE, MAGIC, MAX_PIDS, Layout,
                                  attach_problem)

SHM_DIR = Path("/dev/shm")
_PREFIX = "vllm_aio."
_LOCK_PREFIX = "vllm_aio_lock."

# flock(2) called without releasing the GIL (a ``PyDLL`` call keeps it), for the
# lock's calls that never wait: taking it when free, and letting it go.
# ``fcntl.flock`` releases the GIL around every call, and getting it back waits
# while another thread of the process runs Python: beside one busy thread, a
# short lookup under the lock took a thousand times its work that way.
_flock_holding_gil = ctypes.PyDLL(None, use_errno=True).flock
_flock_holding_gil.argtypes = (ctypes.c_int, ctypes.c_int)
_flock_holding_gil.restype = ctypes.c_int


def pool_path(name: str) -> Path:
    return SHM_DIR / f"{_PREFIX}{name}"


def lock_path(name: str) -> Path:
    # A prefix of its own, so no pool name can collide with a lock file.
    return SHM_DIR / f"{_LOCK_PREFIX}{name}"


def names_on_host() -> tuple[set[str], set[str]]:
    """(pool names, lock file names) in SHM_DIR, whoever made them."""
    pools = {p.name[len(_PREFIX):] for p in SHM_DIR.glob(f"{_PREFIX}*")}
    locks = {p.name[len(_LOCK_PREFIX):] for p in SHM_DIR.glob(f"{_LOCK_PREFIX}*")}
    return pools, locks


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_private(path: Path, flags: int) -> int:
    """Open a pool or lock file that only this user can have made or read.

    A name in /dev/shm is shared by every local user: another user could plant
    a pool file of our name (mode 0666, valid-looking), read every block an
    instance stores there (KV reveals prompts) and write blocks with valid
    headers (wrong tokens served). So: no symlink is followed (``O_NOFOLLOW``),
    and the open descriptor must be a regular file of this effective uid with
    no group or other permission bits, checked with ``fstat`` on the
    descriptor itself, not on the path, which could be swapped in between.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RuntimeError(f"{path} is a symbolic link: refusing to follow it (another user may have planted "
                               "it); remove it or choose another local_pool_name") from None
        raise
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not by this instance's uid {os.geteuid()}"
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}: group or other users could read or write it"
    if problem:
        os.close(fd)
        raise RuntimeError(f"{path} {problem}; refusing it (another user may have planted it): remove it, "
                           "or choose another local_pool_name")
    return fd


def _check_shm_space(needed: int) -> None:
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if needed > free:
        raise RuntimeError(
            f"local_pool_size: the pool needs {needed / 2**30:.2f} GiB in {SHM_DIR} but only "
            f"{free / 2**30:.2f} GiB is free; lower local_pool_size or enlarge {SHM_DIR}"
        )


def _allocate_file(path: Path, fd: int, size: int) -> None:
    """Give the new pool file all its memory now.

    A file only truncated to its size gets its pages when first written: with
    ``/dev/shm`` filled meanwhile (by anyone), the write that needs a page
    kills the writing process with SIGBUS, mid-step. Allocated up front, a
    full ``/dev/shm`` is an error at start instead.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise RuntimeError(
            f"local_pool_size: could not allocate the pool's {size / 2**30:.2f} GiB in {SHM_DIR} "
            f"({os.strerror(exc.errno) if exc.errno else exc}); lower local_pool_size or free {SHM_DIR}"
        ) from None


def _sweep_dead_pools(exclude: Path) -> None:
    """Unlink pools left behind by processes that all died (crash, kill -9)."""
    for path in SHM_DIR.glob(f"{_PREFIX}*"):
        pids = None if path == exclude else _listed_pids(path)
        if pids is not None and not any(map(pid_alive, pids)):
            _unlink(path.name[len(_PREFIX):])


def _listed_pids(path: Path) -> list[int] | None:
    """The pids in the pid table of the pool at ``path``; None where it is not one of ours (or gone)."""
    try:
        fd = open_private(path, os.O_RDONLY)  # only our own pools: never another user's files
    except (OSError, RuntimeError):
        return None
    try:
        head = np.frombuffer(os.pread(fd, 8 * (H_FIELDS + MAX_PIDS), 0), dtype=np.int64)
    finally:
        os.close(fd)
    if len(head) < H_FIELDS + MAX_PIDS or head[H_MAGIC] != MAGIC:
        return None
    return [int(p) for p in head[H_FIELDS:] if p]


def free_if_abandoned(name: str) -> list[int] | None:
    """Unlink pool ``name`` and its lock if no process of its pid table is alive, under its lock (an
    attaching process adds its pid under it): the pids it listed, or None where it was left alone."""
    fd = _open_current_lock(name)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not pool_path(name).exists():  # detached meanwhile: the lock file this call may have made goes too
            lock_path(name).unlink(missing_ok=True)
            return None
        pids = _listed_pids(pool_path(name))
        if pids is None or any(map(pid_alive, pids)):
            return None
        _unlink(name)
        return pids
    finally:
        os.close(fd)  # and its flock with it


def _unlink(name: str) -> None:
    """Pool ``name``'s file and its lock file gone from ``/dev/shm`` (attached mappings stay valid)."""
    pool_path(name).unlink(missing_ok=True)
    lock_path(name).unlink(missing_ok=True)


def _open_current_lock(name: str) -> int:
    """A locked-then-released fd of the lock file that is at the path now.

    The last process to close a shared pool unlinks its lock file; one that
    opened the old file just before would otherwise lock a file nobody
    else sees. Retrying until the locked inode is the one at the path keeps
    every attacher on the same lock.
    """
    path = lock_path(name)
    while True:
        fd = open_private(path, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        fcntl.flock(fd, fcntl.LOCK_UN)
        if current:
            return fd
        os.close(fd)


class PoolFile:
    """The mapping of pool ``name`` in this process, attached (created if absent and ``create``)."""

    def __init__(self, name: str, slot_size: int, num_slots: int, create: bool = True) -> None:
        """``create=False``: attach only, FileNotFoundError if no pool of that name exists."""
        self.name = name
        self.path = pool_path(name)
        self._tlock = threading.Lock()
        self._lock_fd = _open_current_lock(name)
        try:
            with self.locked():
                created = self._map(slot_size, num_slots, create)
                self._add_pid(os.getpid())
                if created:  # last: a sweeper only trusts pools that show a magic
                    self.view("header")[H_MAGIC] = MAGIC
        except BaseException:
            self._drop_orphaned_lock()
            os.close(self._lock_fd)
            raise

    def view(self, region: str) -> np.ndarray:
        """A numpy view of one region of the mapping (``Layout.offsets``)."""
        offset, count, dtype = self._offsets[region]
        return np.frombuffer(self._mm, dtype=dtype, count=count, offset=offset)

    @contextmanager
    def locked(self) -> Iterator[None]:
        """The pool's lock, held against every process and thread attached to it."""
        with self._tlock:
            if _flock_holding_gil(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB) != 0:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # held elsewhere: wait without the GIL
            try:
                yield
            finally:
                _flock_holding_gil(self._lock_fd, fcntl.LOCK_UN)

    def seal(self) -> None:
        """Unlink the pool's name now; attached processes keep their mappings.

        For a pool no other process will attach to: its memory then returns to
        the system when the last attached process exits, however it exits
        (vLLM's default shutdown kills workers without running our close).
        """
        with self.locked():
            _unlink(self.name)

    def detach(self) -> None:
        """Leave the pid table; the last process attached unlinks the pool. Views stay valid until ``unmap``."""
        with self.locked():
            self._remove_pid(os.getpid())
            if not self._live_pids():
                _unlink(self.name)

    def unmap(self) -> None:
        """Close the mapping (once no view of it is held) and the lock."""
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the process
        os.close(self._lock_fd)

    def _drop_orphaned_lock(self) -> None:
        """After a failed attach: no pool, so no lock file either."""
        with self.locked():
            if not self.path.exists():
                lock_path(self.name).unlink(missing_ok=True)

    def _map(self, slot_size: int, num_slots: int, create: bool) -> bool:
        """Map the pool, creating it if absent and ``create``; True if created."""
        created = not os.path.lexists(self.path)  # a planted symlink is "there", and refused below
        if created and not create:
            raise FileNotFoundError(f"no pool {self.name!r} ({self.path})")
        if created:
            _sweep_dead_pools(exclude=self.path)
            layout = Layout(slot_size, num_slots)
            _check_shm_space(layout.file_bytes)
            fd = open_private(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            _allocate_file(self.path, fd, layout.file_bytes)
        else:
            fd = open_private(self.path, os.O_RDWR)
            head = np.frombuffer(os.pread(fd, 8 * H_FIELDS, 0), dtype=np.int64)
            problem = attach_problem(self.path, self.name, head, slot_size)
            if problem:
                os.close(fd)
                raise RuntimeError(problem)
            layout = Layout(slot_size, int(head[H_NUM_SLOTS]))
        self._mm = mmap.mmap(fd, layout.file_bytes)
        os.close(fd)
        self.layout = layout
        self._offsets = layout.offsets()
        if created:
            self.view("table")[:] = EMPTY
            header = self.view("header")
            header[H_SLOT_SIZE], header[H_NUM_SLOTS], header[H_TABLE_SIZE] = slot_size, num_slots, layout.table_size
        return created

    def _pids(self) -> np.ndarray:
        return self.view("header")[H_FIELDS:]

    def _live_pids(self) -> list[int]:
        pids = self._pids()
        for i, pid in enumerate(pids):
            if pid and not pid_alive(int(pid)):
                pids[i] = 0
        return [int(p) for p in pids if p]

    def _add_pid(self, pid: int) -> None:
        self._live_pids()
        pids = self._pids()
        free = np.flatnonzero(pids == 0)
        if not len(free):
            raise RuntimeError(f"pool {self.name!r}: more than {MAX_PIDS} attached processes")
        pids[free[0]] = pid

    def _remove_pid(self, pid: int) -> None:
        # One entry per attachment: scheduler and worker may share a process.
        pids = self._pids()
        mine = np.flatnonzero(pids == pid)
        if len(mine):
            pids[mine[0]] = 0
