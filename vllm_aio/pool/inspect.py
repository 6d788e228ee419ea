"""``vllm-aio pool``: the embedded pools of this host, looked at without disturbing them.

Listing and stats read each pool through a read-only mapping (``snapshot``):
no lock, no entry in its pid table, no LRU refresh, so a running instance
never waits for them. Only pools shared by name (``local_pool_name``) stay in
/dev/shm while in use; a private pool's file is unlinked once its instance has
started (``backends/local.py``), so it shows only while the instance starts or
after its processes died before that.

Clearing attaches like an instance and evicts stored values a batch at a time
(``SharedHostPool.evict_values``): values being written or reserved by a
migration stay, and instances see the cleared values as evicted (the blocks
they counted but no longer find are recomputed). When clear detaches from a
pool no live process is attached to, the pool is removed, as the last instance
to detach would.
"""

from __future__ import annotations

import mmap
import os
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from vllm_aio.pool.entry import NAMESPACE_PREFIX_BYTES, namespace_of, namespace_prefix
from vllm_aio.pool.host_pool import SharedHostPool
from vllm_aio.pool.index_ops import READY, WRITING
from vllm_aio.pool.layout import H_FIELDS, H_NUM_SLOTS, H_SLOT_SIZE, Layout, PoolUsage, attach_problem, usage_of
from vllm_aio.pool.shm_file import names_on_host, open_private, pid_alive, pool_path

_NAMESPACE = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class PoolSnapshot:
    """A pool read without its lock: each field exact, together roughly one moment."""

    usage: PoolUsage
    file_bytes: int
    writing: int  # slots being written or reserved
    pids: tuple[int, ...]  # attached processes alive now
    dead_pids: int  # attached processes that died without detaching
    prefixes: np.ndarray  # (READY values, prefix bytes): the first bytes of each stored value


def snapshot(name: str, prefix_bytes: int = 0) -> PoolSnapshot:
    """Read pool ``name`` through a read-only mapping: no lock, no pid entry, no LRU refresh.

    Raises FileNotFoundError if there is no such pool, RuntimeError if the
    file is not a pool of this version or not private to this user.
    """
    path = pool_path(name)
    fd = open_private(path, os.O_RDONLY)
    try:
        raw = os.pread(fd, 8 * H_FIELDS, 0)
        head = np.frombuffer(raw[: len(raw) // 8 * 8], dtype=np.int64)
        problem = attach_problem(path, name, head, int(head[H_SLOT_SIZE]) if len(head) == H_FIELDS else 0)
        if problem:
            raise RuntimeError(problem)
        layout = Layout(int(head[H_SLOT_SIZE]), int(head[H_NUM_SLOTS]))
        if os.fstat(fd).st_size < layout.file_bytes:
            raise RuntimeError(f"{path} is shorter than its header says: not a whole pool")
        mm = mmap.mmap(fd, layout.file_bytes, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    offsets = layout.offsets()

    def view(region: str) -> np.ndarray:
        offset, count, dtype = offsets[region]
        return np.frombuffer(mm, dtype=dtype, count=count, offset=offset)

    try:
        header, state = view("header").copy(), view("state").copy()
        ready = np.flatnonzero(state == READY)
        prefixes = view("data").reshape(layout.num_slots, layout.slot_size)[ready, :prefix_bytes]  # a copy
    finally:
        mm.close()  # the views above are gone or copied
    pids = [int(p) for p in header[H_FIELDS:] if p]
    alive = tuple(p for p in pids if pid_alive(p))
    return PoolSnapshot(usage_of(header), layout.file_bytes, int(np.count_nonzero(state == WRITING)), alive,
                        len(pids) - len(alive), prefixes)


@dataclass(frozen=True)
class PoolInfo:
    name: str
    snapshot: PoolSnapshot | None
    problem: str | None = None  # why it could not be read: another user's file, an older version, half made

    @property
    def stale(self) -> bool:
        """No live process is attached: the next pool created on this host sweeps it."""
        return self.snapshot is not None and not self.snapshot.pids


@dataclass(frozen=True)
class Cleared:
    evicted: int
    removed: bool  # no live process was attached, so the pool went with our detach


def read_pool(name: str) -> PoolInfo:
    try:
        return PoolInfo(name, snapshot(name, NAMESPACE_PREFIX_BYTES))
    except FileNotFoundError:
        raise LookupError(f"no pool {name!r} on this host ({pool_path(name)})") from None
    except (OSError, RuntimeError) as exc:
        return PoolInfo(name, None, str(exc))


def list_pools() -> tuple[list[PoolInfo], list[str]]:
    """Every pool file on this host, and the names of lock files left without a pool (harmless)."""
    pools, locks = names_on_host()
    infos = []
    for name in sorted(pools):
        try:
            infos.append(read_pool(name))
        except LookupError:
            pass  # its last process detached since the directory was listed
    return infos, sorted(locks - pools)


def namespaces(snap: PoolSnapshot) -> Counter[str]:
    """Stored values per key namespace, read from their entry headers ("-": values with no header)."""
    return Counter(namespace_of(bytes(row)) or "-" for row in snap.prefixes)


def clear(name: str, namespace: str | None = None) -> Cleared:
    """Evict the stored values of pool ``name`` (of one key namespace only, if given)."""
    if namespace is not None and not _NAMESPACE.fullmatch(namespace):
        raise ValueError(f"namespace {namespace!r}: expected the 16 hex digits `vllm-aio pool stats` lists")
    info = read_pool(name)
    if info.snapshot is None:
        raise RuntimeError(info.problem)
    usage = info.snapshot.usage
    try:
        pool = SharedHostPool(name, usage.slot_size, usage.num_slots, create=False)
    except FileNotFoundError:
        raise LookupError(f"no pool {name!r} on this host ({pool_path(name)})") from None
    try:
        evicted = pool.evict_values(b"" if namespace is None else namespace_prefix(namespace))
    finally:
        pool.close()
    return Cleared(evicted, not pool_path(name).exists())
