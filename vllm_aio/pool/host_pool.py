"""A bounded host-memory block store shared by the processes of one machine.

vLLM runs the scheduler in the engine-core process and, with TP > 1, each
worker in a process of its own; all of them must see one pool (the scheduler
asks "is it there?", the workers copy bytes in and out). The pool is therefore
one file in ``/dev/shm`` that every process maps:

    header | hash index (key -> slot) | per-slot metadata | block records | eviction log | slot data

* No service and no port: the first process to attach creates the file. A
  private pool is unlinked as soon as its last process (vLLM's scheduler,
  created after the workers) has attached, so the kernel frees it when they
  exit, even when killed. A pool shared by name is unlinked by the last
  process to detach; attached pids are listed in its header, so one whose
  processes all died is swept by the next pool created on this host.
* Every value has the same size (one rank's bytes of one KV block), so memory
  is an array of fixed slots: no fragmentation, O(1) allocation, and eviction
  is "least recently used READY slot of the lowest retention class": a value
  carries the class of the request that stored it (from its vLLM priority,
  ``priority_cutoffs``), raised when a request of a higher class stores it again.
* Block records answer the scheduler's question, "how many leading blocks
  have every part stored?", with one probe per block instead of one per part
  (shards x layers): a second open-addressed table keyed by the block's group
  (``pool/keys.py``) counts the group's READY values. ``commit`` adds one,
  eviction takes one away, so a record is exact at every moment the lock is
  free. Keys that are not block keys have no record.
* A lease puts values at the back of their class's eviction order until a
  deadline (``lease_ids``): the scheduler leases the blocks it promises to a
  load, so the saves between its lookup and the worker's read evict every other
  value of that class first. A lease never refuses a save and never outranks a
  retention class. Deadlines are ``CLOCK_MONOTONIC`` times, one clock for every
  process of the host.
* An eviction log tells any attached process which blocks lost a value, so
  an instance can report ``BlockRemoved`` for blocks evicted by another
  process (a worker's put, another instance sharing the pool): the k-th
  eviction writes its block record's id at entry ``k % num_slots``, and a
  reader keeps its own count of evictions read (``evicted_since``).
* Index and metadata change under one lock (``flock`` across processes plus a
  ``threading.Lock`` within one); copies run outside it. A reader never blocks
  a writer: it notes the slot's version, copies, and rechecks the version, so
  a slot evicted and rewritten mid-copy is reported CORRUPT (the caller
  recomputes) instead of being served torn.

Measured cost (2-core x86 host, this repository's ``benchmarks/pool_bandwidth.py``):
copies run at memcpy speed for 64 KiB pages and above. The loops over keys
under the lock (index, block records, eviction order) are compiled
(``pool/index_ops.py``): in a full pool of 16,384 slots, ``reserve_blocks`` +
``commit`` of 4,096 values (evicting as many) took ~2.5 ms, 0.6 us a value,
against ~10 us a value in Python before; string keys add their parsing and
hashing (~3 us a key). ``complete_blocks`` is one compiled probe per block
(``benchmarks/scale.py``).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import hashlib
import mmap
import os
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_aio.pool import index_ops
from vllm_aio.pool.index_ops import EMPTY, FREE, READY, WRITING
from vllm_aio.pool.keys import block_of_key, parse_block_key

SHM_DIR = Path("/dev/shm")
_PREFIX = "vllm_aio."
_LOCK_PREFIX = "vllm_aio_lock."
_MAGIC = 0x41494F504F4F4C35  # "AIOPOOL5": read leases added
# "AIOPOOL1": no block records; "AIOPOOL2": no classes; "AIOPOOL3": no eviction log; "AIOPOOL4": no leases
_OLD_MAGICS = (0x41494F504F4F4C31, 0x41494F504F4F4C32, 0x41494F504F4F4C33, 0x41494F504F4F4C34)
_MAX_PIDS = 256
_PAGE = 4096

# ``reserve_blocks``/``reserve_ids``, per key: instead of a slot, "stored already" or "no room".
SLOT_STORED, SLOT_NO_ROOM = -2, -1

# Header: fixed int64 fields, then the attached-pid table.
_H_MAGIC, _H_SLOT_SIZE, _H_NUM_SLOTS, _H_TABLE_SIZE, _H_CLOCK = range(5)
_H_NEXT_UNUSED, _H_EVICTIONS, _H_NUM_READY = range(5, 8)
# Values looked up by key (pin_ids) and those found: counted from zero in a pool made before.
_H_LOOKUPS, _H_HITS = 8, 9
_H_FIELDS = 16


_U64 = np.dtype("<u8")
# Lease deadlines: CLOCK_MONOTONIC, one clock for every process of the host.
_now_ns = time.monotonic_ns


# flock(2) called without releasing the GIL (a ``PyDLL`` call keeps it), for the
# lock's calls that never wait: taking it when free, and letting it go.
# ``fcntl.flock`` releases the GIL around every call, and getting it back waits
# while another thread of the process runs Python: beside one busy thread, a
# 64-block lookup (3 us of work under the lock) took 1-6 ms that way.
_flock_holding_gil = ctypes.PyDLL(None, use_errno=True).flock
_flock_holding_gil.argtypes = (ctypes.c_int, ctypes.c_int)
_flock_holding_gil.restype = ctypes.c_int


@dataclass(frozen=True)
class BlockGroups:
    """Record ids of blocks (``block_groups``): two int64 columns, ``hi`` never 0."""

    hi: np.ndarray
    lo: np.ndarray


@functools.lru_cache(maxsize=64)  # a pool sees a handful of namespaces; reserve asks per key
def _group_salt(namespace_digest: str, layered: bool) -> np.ndarray:
    digest = hashlib.blake2b(f"{namespace_digest}:{int(layered)}".encode(), digest_size=16).digest()
    return np.frombuffer(digest, dtype=_U64)


def _mixed_ids(salt: np.ndarray, hashes: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Two 64-bit ids per hash from its bytes and ``salt`` (``(2,)``), with no hash call.

    Every word of the hash goes through splitmix64's finaliser in turn
    (``index_ops.mixed_ids``; an xor fold would let hashes with structure
    collide: equal or swapped words), with the hash's length in the seed.
    Grouped by length, so an id never depends on the other hashes of the
    batch (vLLM's are all one size).
    """
    lengths = set(map(len, hashes))
    if len(lengths) == 1 and (size := lengths.pop()) % 8 == 0:
        # The common case, in plain Python and compiled code only: numpy's sort
        # (``np.unique``) releases the GIL, and getting it back can wait ~100 us.
        return _mixed_words(salt, size, b"".join(hashes), len(hashes))
    sizes = np.fromiter(map(len, hashes), dtype=np.int64, count=len(hashes))
    hi, lo = np.zeros(len(hashes), dtype=np.uint64), np.zeros(len(hashes), dtype=np.uint64)
    for size in np.unique(sizes).tolist():
        at = np.flatnonzero(sizes == size)
        width = -(-size // 8) * 8
        raw = b"".join(hashes[i].ljust(width, b"\0") for i in at.tolist())
        hi[at], lo[at] = _mixed_words(salt, size, raw, len(at))
    return hi, lo


def _mixed_words(salt: np.ndarray, size: int, raw: bytes, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``_mixed_ids`` of ``count`` hashes of ``size`` bytes, zero-padded to whole words in ``raw``."""
    words = np.frombuffer(raw, dtype=_U64).reshape(count, -1)
    return index_ops.mixed_ids(words, salt[0] ^ np.uint64(size), salt[1] ^ np.uint64(size << 32))


def block_groups(salt: np.ndarray, hashes: Sequence[bytes]) -> BlockGroups:
    """The record ids of blocks: their hashes mixed with their groups' salt (``_mixed_ids``).

    A 128k-token prompt's 8,192 blocks take well under a millisecond.
    """
    hi, lo = _mixed_ids(salt, hashes)
    return BlockGroups((hi | np.uint64(1)).view(np.int64), lo.view(np.int64))


def namespace_groups(namespace_digest: str, layered: bool, hashes: Sequence[bytes]) -> BlockGroups:
    """The record ids of one namespace's blocks (what the scheduler asks about)."""
    return block_groups(_group_salt(namespace_digest, layered), hashes)


def _groups_of_keys(keys: Sequence[str]) -> BlockGroups:
    """Per key, the record id of its block; hi 0 for a key that is not a block key."""
    hashes: list[bytes] = []
    positions: dict[tuple[str, bool], list[int]] = {}  # (digest, layered) -> indices into hashes
    where: list[int] = []  # the key of each hash
    for i, key in enumerate(keys):
        block = block_of_key(key)
        if block is not None:
            positions.setdefault(block[:2], []).append(len(hashes))
            hashes.append(block[2])
            where.append(i)
    hi, lo = np.zeros(len(keys), dtype=np.int64), np.zeros(len(keys), dtype=np.int64)
    at = np.asarray(where, dtype=np.int64)
    for (digest, layered), idx in positions.items():  # one namespace per batch, in practice
        ids = namespace_groups(digest, layered, [hashes[i] for i in idx])
        hi[at[idx]], lo[at[idx]] = ids.hi, ids.lo
    return BlockGroups(hi, lo)


@functools.lru_cache(maxsize=4096)  # (namespace, shard, unit): a few hundred per deployment
def _value_salt(namespace_digest: str, shard: str, tag: int | None) -> np.ndarray:
    text = f"value:{namespace_digest}:{shard}:{'' if tag is None else tag}"
    return np.frombuffer(hashlib.blake2b(text.encode(), digest_size=16).digest(), dtype=_U64)


def value_ids(namespace_digest: str, shard: str, tag: int | None, hashes: Sequence[bytes]) -> BlockGroups:
    """The index ids of the block keys ``block_key(namespace_digest, shard, hash, tag)``, computed
    from the hashes' bytes in numpy (no string and no hash call per key): what the direct path pins."""
    hi, lo = _mixed_ids(_value_salt(namespace_digest, shard, tag), hashes)
    return BlockGroups(hi.view(np.int64), lo.view(np.int64))


def _key_ids(keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Every key's index id as two int64 arrays (hi, lo).

    A block key's id is ``value_ids`` of its fields, so a reader holding the
    block hashes finds it without building the string; any other key is
    hashed whole (blake2b).
    """
    hi, lo = np.zeros(len(keys), dtype=np.int64), np.zeros(len(keys), dtype=np.int64)
    groups: dict[tuple[str, str, int | None], tuple[list[int], list[bytes]]] = {}
    others: list[int] = []
    for i, key in enumerate(keys):
        fields = parse_block_key(key)
        if fields is None:
            others.append(i)
        else:
            at, hashes = groups.setdefault(fields[:3], ([], []))
            at.append(i)
            hashes.append(fields[3])
    for (digest, shard, tag), (at, hashes) in groups.items():
        ids = value_ids(digest, shard, tag, hashes)
        hi[at], lo[at] = ids.hi, ids.lo
    if others:
        raw = b"".join([hashlib.blake2b(keys[i].encode(), digest_size=16).digest() for i in others])
        words = (np.frombuffer(raw, dtype=_U64).reshape(-1, 2) >> np.uint64(1)).astype(np.int64)
        hi[others], lo[others] = words[:, 0], words[:, 1]
    return hi, lo


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class PoolUsage:
    num_slots: int
    num_ready: int
    slot_size: int
    evictions: int
    lookups: int  # values looked up by key, found or not
    hits: int

    @property
    def bytes_used(self) -> int:
        return self.num_ready * self.slot_size


def _usage(header: np.ndarray) -> PoolUsage:
    return PoolUsage(int(header[_H_NUM_SLOTS]), int(header[_H_NUM_READY]), int(header[_H_SLOT_SIZE]),
                     int(header[_H_EVICTIONS]), int(header[_H_LOOKUPS]), int(header[_H_HITS]))


@dataclass(frozen=True)
class PoolSnapshot:
    """A pool read without its lock (``vllm-aio pool``): each field exact, together roughly one moment."""

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
    fd = _open_private(pool_path(name), os.O_RDONLY)
    try:
        raw = os.pread(fd, 8 * _H_FIELDS, 0)
        head = np.frombuffer(raw[: len(raw) // 8 * 8], dtype=np.int64)
        problem = _attach_problem(name, head, int(head[_H_SLOT_SIZE]) if len(head) == _H_FIELDS else 0)
        if problem:
            raise RuntimeError(problem)
        layout = _Layout(int(head[_H_SLOT_SIZE]), int(head[_H_NUM_SLOTS]))
        if os.fstat(fd).st_size < layout.file_bytes:
            raise RuntimeError(f"{pool_path(name)} is shorter than its header says: not a whole pool")
        mm = mmap.mmap(fd, layout.file_bytes, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    offsets = layout.offsets()

    def view(name: str) -> np.ndarray:
        offset, count, dtype = offsets[name]
        return np.frombuffer(mm, dtype=dtype, count=count, offset=offset)

    try:
        header, state = view("header").copy(), view("state").copy()
        ready = np.flatnonzero(state == READY)
        prefixes = view("data").reshape(layout.num_slots, layout.slot_size)[ready, :prefix_bytes]  # a copy
    finally:
        mm.close()  # the views above are gone or copied
    pids = [int(p) for p in header[_H_FIELDS:] if p]
    alive = tuple(p for p in pids if _pid_alive(p))
    return PoolSnapshot(_usage(header), layout.file_bytes, int(np.count_nonzero(state == WRITING)), alive,
                        len(pids) - len(alive), prefixes)


@dataclass
class _Layout:
    """Byte offsets of the regions inside the pool file."""

    slot_size: int
    num_slots: int

    @property
    def table_size(self) -> int:
        return 1 << max(4, (2 * self.num_slots - 1).bit_length())  # load <= 50%

    @property
    def header_bytes(self) -> int:
        return 8 * (_H_FIELDS + _MAX_PIDS)

    def offsets(self) -> dict[str, tuple[int, int, type]]:
        """name -> (offset, count, numpy dtype) of each metadata array."""
        specs = [
            ("header", _H_FIELDS + _MAX_PIDS, np.int64),
            ("table", self.table_size, np.int64),
            ("key_hi", self.num_slots, np.int64),
            ("key_lo", self.num_slots, np.int64),
            ("version", self.num_slots, np.int64),
            ("last_used", self.num_slots, np.int64),
            ("retention", self.num_slots, np.int64),  # evicted lowest class first
            ("lease_until", self.num_slots, np.int64),  # CLOCK_MONOTONIC ns; not evicted before
            ("state", self.num_slots, np.int64),
            ("slot_group_hi", self.num_slots, np.int64),  # 0: the slot's key has no block record
            ("slot_group_lo", self.num_slots, np.int64),
            # Block records, open-addressed like the index; parts 0: empty bucket.
            ("group_hi", self.table_size, np.int64),
            ("group_lo", self.table_size, np.int64),
            ("group_parts", self.table_size, np.int64),
            # Eviction log: the block record id of the k-th evicted value at k % num_slots (hi 0: no record).
            ("evicted_hi", self.num_slots, np.int64),
            ("evicted_lo", self.num_slots, np.int64),
        ]
        out, pos = {}, 0
        for name, count, dtype in specs:
            out[name] = (pos, count, dtype)
            pos += count * 8
        out["data"] = (_round_up(pos, _PAGE), self.num_slots * self.slot_size, np.uint8)
        return out

    @property
    def file_bytes(self) -> int:
        offset, size, _ = self.offsets()["data"]
        return offset + size


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def pool_path(name: str) -> Path:
    return SHM_DIR / f"{_PREFIX}{name}"


def names_on_host() -> tuple[set[str], set[str]]:
    """(pool names, lock file names) in SHM_DIR, whoever made them."""
    pools = {p.name[len(_PREFIX):] for p in SHM_DIR.glob(f"{_PREFIX}*")}
    locks = {p.name[len(_LOCK_PREFIX):] for p in SHM_DIR.glob(f"{_LOCK_PREFIX}*")}
    return pools, locks


def slots_for(pool_bytes: int, slot_size: int) -> int:
    return max(1, pool_bytes // slot_size)


def lock_path(name: str) -> Path:
    # A prefix of its own, so no pool name can collide with a lock file.
    return SHM_DIR / f"{_LOCK_PREFIX}{name}"


class SharedHostPool:
    """Attach to (or create) the pool ``name``; values are ``slot_size`` bytes."""

    def __init__(self, name: str, slot_size: int, num_slots: int, create: bool = True) -> None:
        """``create=False``: attach only, FileNotFoundError if no pool of that name exists."""
        self.name = name
        self.path = pool_path(name)
        self._tlock = threading.Lock()
        self._lock_fd = self._open_current_lock()
        try:
            with self._locked():
                created = self._map(slot_size, num_slots, create)
                self._add_pid(os.getpid())
                if created:  # last: a sweeper only trusts pools that show a magic
                    self._header[_H_MAGIC] = _MAGIC
        except BaseException:
            self._drop_orphaned_lock()
            os.close(self._lock_fd)
            raise
        self._closed = False

    # ---- lifecycle -------------------------------------------------------
    def _open_current_lock(self) -> int:
        """A locked-then-released fd of the lock file that is at the path now.

        The last process to close a shared pool unlinks its lock file; one that
        opened the old file just before would otherwise lock a file nobody
        else sees. Retrying until the locked inode is the one at the path keeps
        every attacher on the same lock.
        """
        path = lock_path(self.name)
        while True:
            fd = _open_private(path, os.O_RDWR | os.O_CREAT)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            fcntl.flock(fd, fcntl.LOCK_UN)
            if current:
                return fd
            os.close(fd)

    def _drop_orphaned_lock(self) -> None:
        """After a failed attach: no pool, so no lock file either."""
        with self._locked():
            if not self.path.exists():
                lock_path(self.name).unlink(missing_ok=True)

    def _map(self, slot_size: int, num_slots: int, create: bool) -> bool:
        """Map the pool, creating it if absent and ``create``; True if created."""
        created = not os.path.lexists(self.path)  # a planted symlink is "there", and refused below
        if created and not create:
            raise FileNotFoundError(f"no pool {self.name!r} ({self.path})")
        if created:
            _sweep_dead_pools(exclude=self.path)
            layout = _Layout(slot_size, num_slots)
            _check_shm_space(layout.file_bytes)
            fd = _open_private(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            _allocate_file(self.path, fd, layout.file_bytes)
        else:
            fd = _open_private(self.path, os.O_RDWR)
            head = np.frombuffer(os.pread(fd, 8 * _H_FIELDS, 0), dtype=np.int64)
            problem = _attach_problem(self.name, head, slot_size)
            if problem:
                os.close(fd)
                raise RuntimeError(problem)
            layout = _Layout(slot_size, int(head[_H_NUM_SLOTS]))
        self._mm = mmap.mmap(fd, layout.file_bytes)
        os.close(fd)
        self.layout = layout
        self._map_arrays(layout.offsets())
        self._data_addr = self._data.ctypes.data
        if created:
            self._table[:] = EMPTY
            self._header[_H_SLOT_SIZE] = slot_size
            self._header[_H_NUM_SLOTS] = num_slots
            self._header[_H_TABLE_SIZE] = layout.table_size
        return created

    def _map_arrays(self, offsets: dict[str, tuple[int, int, type]] | None) -> None:
        """The metadata arrays and the slots as numpy views of the mapping (None: drop them)."""

        def view(name: str) -> np.ndarray | None:
            if offsets is None:
                return None
            offset, count, dtype = offsets[name]
            return np.frombuffer(self._mm, dtype=dtype, count=count, offset=offset)

        self._header = view("header")
        self._table = view("table")
        self._key_hi = view("key_hi")
        self._key_lo = view("key_lo")
        self._version = view("version")
        self._last_used = view("last_used")
        self._retention = view("retention")
        self._lease_until = view("lease_until")
        self._state = view("state")
        self._slot_group_hi = view("slot_group_hi")
        self._slot_group_lo = view("slot_group_lo")
        self._group_hi = view("group_hi")
        self._group_lo = view("group_lo")
        self._group_parts = view("group_parts")
        self._evicted_hi = view("evicted_hi")
        self._evicted_lo = view("evicted_lo")
        self._data = view("data")
        # The groups of arrays ``index_ops`` works on.
        self._index = (self._table, self._key_hi, self._key_lo)
        self._records = (self._group_hi, self._group_lo, self._group_parts)
        self._slot_groups = (self._slot_group_hi, self._slot_group_lo)

    def seal(self) -> None:
        """Unlink the pool's name now; attached processes keep their mappings.

        For a pool no other process will attach to: its memory then returns to
        the system when the last attached process exits, however it exits
        (vLLM's default shutdown kills workers without running our close).
        """
        with self._locked():
            self.path.unlink(missing_ok=True)
            lock_path(self.name).unlink(missing_ok=True)

    def close(self) -> None:
        """Detach; the last process attached unlinks the pool."""
        if self._closed:
            return
        self._closed = True
        with self._locked():
            self._remove_pid(os.getpid())
            last = not self._live_pids()
            if last:
                self.path.unlink(missing_ok=True)
                lock_path(self.name).unlink(missing_ok=True)
        self._map_arrays(None)  # numpy views of the mapping would keep it open
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the process
        os.close(self._lock_fd)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._tlock:
            if _flock_holding_gil(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB) != 0:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX)  # held elsewhere: wait without the GIL
            try:
                yield
            finally:
                _flock_holding_gil(self._lock_fd, fcntl.LOCK_UN)

    def _pids(self) -> np.ndarray:
        return self._header[_H_FIELDS:]

    def _live_pids(self) -> list[int]:
        pids = self._pids()
        for i, pid in enumerate(pids):
            if pid and not _pid_alive(int(pid)):
                pids[i] = 0
        return [int(p) for p in pids if p]

    def _add_pid(self, pid: int) -> None:
        self._live_pids()
        free = np.flatnonzero(self._pids() == 0)
        if not len(free):
            raise RuntimeError(f"pool {self.name!r}: more than {_MAX_PIDS} attached processes")
        self._pids()[free[0]] = pid

    def _remove_pid(self, pid: int) -> None:
        # One entry per attachment: scheduler and worker may share a process.
        pids = self._pids()
        mine = np.flatnonzero(pids == pid)
        if len(mine):
            pids[mine[0]] = 0

    # ---- allocation ------------------------------------------------------
    def _allocate(self, count: int) -> np.ndarray:
        """Up to ``count`` slots in WRITING state: unused, then free, then LRU."""
        header, state = self._header, self._state
        start = int(header[_H_NEXT_UNUSED])
        stop = min(start + count, self.layout.num_slots)
        header[_H_NEXT_UNUSED] = stop
        slots = np.arange(start, stop)
        if len(slots) < count:
            slots = np.concatenate((slots, np.flatnonzero(state[:start] == FREE)[: count - len(slots)]))
        if len(slots) < count:
            slots = np.concatenate((slots, self._evict(count - len(slots))))
        state[slots] = WRITING
        self._version[slots] += 1
        return slots

    def _evict(self, count: int) -> np.ndarray:
        # Lowest class first, then values leased to a load that has not read them
        # yet (``lease_ids``) last, then LRU (``index_ops.eviction_order``). In slot
        # order: a batch's values then lie back to back where they can, so a direct
        # load finds them in runs it moves by DMA (``connector/mapped_slots.py``).
        ready, order = index_ops.eviction_order(self._state, self._retention, self._lease_until, self._last_used,
                                                _now_ns())
        if not len(ready):
            return ready
        # numpy's partition: numba's took seconds more to compile than all the rest.
        victims = np.sort(ready[np.argpartition(order, min(count, len(ready)) - 1)[:count]])
        self._drop_ready(victims)
        return victims

    def _drop_ready(self, slots: np.ndarray) -> None:
        """Take READY values out of the index and the block records; the caller decides the slots' state."""
        index_ops.drop(self._index, self._records, self._slot_groups, slots)
        # Logged for readers of this pool's evictions (KV events' BlockRemoved, ``backends/local.py``).
        log = (int(self._header[_H_EVICTIONS]) + np.arange(len(slots))) % self.layout.num_slots
        self._evicted_hi[log], self._evicted_lo[log] = self._slot_group_hi[slots], self._slot_group_lo[slots]
        # Counted as evictions: the eviction counter is the presence epoch (backends/local.py),
        # which tells schedulers that values they counted may be gone.
        self._header[_H_EVICTIONS] += len(slots)
        self._header[_H_NUM_READY] -= len(slots)

    # ---- public API --------------------------------------------------------
    @property
    def slot_size(self) -> int:
        return self.layout.slot_size

    def usage(self) -> PoolUsage:
        return _usage(self._header)

    def evict_values(self, prefix: bytes = b"", batch: int = 4096) -> int:
        """Evict every READY value whose bytes start with ``prefix`` (all of them for ``b""``); how many went.

        For ``vllm-aio pool clear`` on a pool in use: slots being written or
        reserved are left alone, and a reader that pinned an evicted value sees
        its slot changed, as after an LRU eviction. The lock is held for one
        ``batch`` at a time, so running instances wait for a batch at most.
        """
        size, evicted, start = self.layout.slot_size, 0, 0
        rows = self._data.reshape(self.layout.num_slots, size)
        wanted = np.frombuffer(prefix, dtype=np.uint8)
        while start < self.layout.num_slots:
            stop = start + batch
            with self._locked():
                ready = start + np.flatnonzero(self._state[start:stop] == READY)
                if len(wanted):
                    ready = ready[(rows[ready, : len(wanted)] == wanted).all(axis=1)]
                self._drop_ready(ready)
                self._state[ready] = FREE
            evicted += len(ready)
            start = stop
        return evicted

    def writing_slots(self) -> int:
        """Slots being written or reserved (a migration's slots until commit or watchdog)."""
        return int(np.count_nonzero(self._state == WRITING))

    def read_headers(self, slots: Sequence[int], length: int) -> list[bytes]:
        """The first ``length`` bytes of each slot (the value headers a migration's commit checks)."""
        size = self.layout.slot_size
        return [bytes(self._data[slot * size : slot * size + length]) for slot in slots]

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key; a hit refreshes its LRU position."""
        return [pin is not None for pin in self.pin_for_read(keys)]

    def reserve(self, keys: Sequence[str], retention: int = 0) -> list[int | None]:
        """Per key: a WRITING slot to fill, or None if already stored; -1 if no room.

        The slot records its key's id, so ``commit`` needs only the slot: a key
        is hashed once per put. ``retention``: the storing request's class; a
        stored key keeps the higher of its class and this one.
        """
        slots = self.reserve_array(keys, retention)
        return [None if slot == SLOT_STORED else slot for slot in slots.tolist()]

    def reserve_array(self, keys: Sequence[str], retention: int = 0) -> np.ndarray:
        """``reserve`` answered as ``reserve_blocks`` is: an array, ``SLOT_STORED`` for None."""
        return self.reserve_ids(*_key_ids(keys), _groups_of_keys(keys), retention)

    def reserve_blocks(
        self, namespace_digest: str, shard: str, tag: int | None, hashes: Sequence[bytes], retention: int = 0
    ) -> np.ndarray:
        """``reserve`` of the block keys of ``hashes``, without building them (as ``pin_blocks``):
        per hash a slot, ``SLOT_STORED`` if stored already, ``SLOT_NO_ROOM`` if there is no room."""
        ids = value_ids(namespace_digest, shard, tag, hashes)
        return self.reserve_ids(ids.hi, ids.lo, namespace_groups(namespace_digest, tag is not None, hashes), retention)

    def reserve_ids(self, hi: np.ndarray, lo: np.ndarray, groups: BlockGroups, retention: int = 0) -> np.ndarray:
        """``reserve_blocks`` of the keys with these ids, whose blocks have these record ids (hi 0: none)."""
        with self._locked():
            found = self._find_many(hi, lo)
            stored = found >= 0
            hits = found[stored]
            clock = int(self._header[_H_CLOCK])
            self._last_used[hits] = clock + 1 + np.arange(len(hits))  # one tick per stored key, in order
            self._header[_H_CLOCK] = clock + len(hits)
            self._retention[hits] = np.maximum(self._retention[hits], retention)
            missing = np.flatnonzero(~stored)
            slots = self._allocate(len(missing))
            self._retention[slots] = retention
            filled = missing[: len(slots)]
            self._key_hi[slots], self._key_lo[slots] = hi[filled], lo[filled]
            self._slot_group_hi[slots], self._slot_group_lo[slots] = groups.hi[filled], groups.lo[filled]
        result = np.full(len(lo), SLOT_NO_ROOM, dtype=np.int64)
        result[stored] = SLOT_STORED
        result[filled] = slots
        return result

    def commit(self, slots: Sequence[int] | np.ndarray) -> list[bool]:
        """Publish filled slots; False where the key was stored first (by another writer or an
        earlier slot of this batch): that slot is freed.

        Each slot's key is the one ``reserve`` recorded in it: a WRITING slot
        is owned by its writer (no allocation or eviction touches it), so
        its key id cannot have changed since.
        """
        slots = np.asarray(slots, dtype=np.int64)
        with self._locked():
            stored, clock = index_ops.publish(self._index, self._records, self._slot_groups, self._state,
                                              self._last_used, slots, int(self._header[_H_CLOCK]))
            self._header[_H_CLOCK] = clock
            self._header[_H_NUM_READY] += int(np.count_nonzero(stored))
        return stored.tolist()

    def abandon(self, slots: Sequence[int] | np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        with self._locked():
            self._state[slots] = FREE

    def pin_for_read(self, keys: Sequence[str]) -> list[tuple[int, int] | None]:
        """Per key: (slot, version) to copy from and recheck, or None if absent.

        One compiled probe loop (``_find_many``): a layerwise load pins every
        block of a step once per layer, and a per-key probe in Python cost the
        H200 host ~4 us a key, more than copying a 64 KiB value takes.
        """
        if not keys:
            return []
        slots, versions = self.pin_ids(*_key_ids(keys))
        return [None if slot < 0 else (slot, version) for slot, version in zip(slots.tolist(), versions.tolist())]

    def pin_blocks(
        self, namespace_digest: str, shard: str, tag: int | None, hashes: Sequence[bytes]
    ) -> tuple[np.ndarray, np.ndarray]:
        """``pin_for_read`` of the block keys of ``hashes``, without building them: (slots, versions), slot -1 if absent."""
        ids = value_ids(namespace_digest, shard, tag, hashes)
        return self.pin_ids(ids.hi, ids.lo)

    def pin_ids(self, hi: np.ndarray, lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slots, versions) of the keys with these ids (slot -1: absent); the hits' LRU refreshed in order."""
        with self._locked():
            slots = self._find_many(hi, lo)
            hit = slots >= 0
            hits = slots[hit]
            clock = int(self._header[_H_CLOCK])
            self._last_used[hits] = clock + 1 + np.arange(len(hits))  # one tick per hit, in order
            self._header[_H_CLOCK] = clock + len(hits)
            versions = np.where(hit, self._version[np.where(hit, slots, 0)], -1)
            self._header[_H_LOOKUPS] += len(slots)
            self._header[_H_HITS] += len(hits)
        return slots, versions

    def lease_ids(self, hi: np.ndarray, lo: np.ndarray, seconds: float) -> int:
        """Evict the values with these ids last in their class for ``seconds`` (absent ids are skipped); how many are held.

        A lease only ever grows (another holder may need it longer) and ends by
        time alone: its holder, a scheduler that promised the values to a load,
        may die without a word, and a count would then hold them forever.
        """
        until = _now_ns() + int(seconds * 1e9)
        with self._locked():
            slots = self._find_many(hi, lo)
            held = slots[slots >= 0]
            self._lease_until[held] = np.maximum(self._lease_until[held], until)
        return len(held)

    def unchanged(self, slots: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """``still_valid`` of many pins at once (a bool array)."""
        return (self._version[slots] == versions) & (self._state[slots] == READY)

    def _find_many(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """The slot of every key id (-1: absent)."""
        return index_ops.find_slots(self._index, hi, lo)

    def complete_blocks(self, groups: BlockGroups, parts: int) -> int:
        """How many leading blocks have at least ``parts`` READY values (every part of them).

        One probe per block, in one compiled loop (``index_ops.record_parts``;
        a table at most half full keeps the probes short). The answer holds
        while no eviction happens; the eviction counter (``usage().evictions``)
        says when that changed.
        """
        complete = self.block_parts(groups) >= parts
        return len(complete) if complete.all() else int(np.argmin(complete))

    def block_parts(self, groups: BlockGroups) -> np.ndarray:
        """How many READY values each block has (its record's count; 0 without a record)."""
        with self._locked():
            return index_ops.record_parts(self._records, groups.hi, groups.lo)

    def evicted_since(self, seen: int) -> tuple[int, BlockGroups | None]:
        """(evictions so far, the block record ids of the values evicted after the first ``seen``).

        None instead of the ids when more than the log holds were evicted
        since (the whole pool turned over): the caller rechecks its blocks.
        Ids repeat (one per value) and include 0s for values without a record.
        """
        if int(self._header[_H_EVICTIONS]) == seen:  # the usual step: no lock, nothing to copy
            return seen, BlockGroups(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        with self._locked():
            now = int(self._header[_H_EVICTIONS])
            if now - seen > self.layout.num_slots:
                return now, None
            log = np.arange(seen, now) % self.layout.num_slots
            return now, BlockGroups(self._evicted_hi[log], self._evicted_lo[log])

    def still_valid(self, slot: int, version: int) -> bool:
        """Whether a slot read since ``pin_for_read`` was not reused meanwhile."""
        return int(self._version[slot]) == version and int(self._state[slot]) == READY

    def region(self) -> tuple[int, int]:
        """(address, bytes) of the slot data in this process's mapping."""
        return self._data_addr, self.layout.num_slots * self.layout.slot_size

    def slot_address(self, slot: int | np.ndarray) -> int | np.ndarray:
        """The address of a slot (or of each slot of an array) in this process's mapping."""
        return self._data_addr + slot * self.layout.slot_size


def _open_private(path: Path, flags: int) -> int:
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


def _attach_problem(name: str, head: np.ndarray, slot_size: int) -> str | None:
    if len(head) >= _H_FIELDS and head[_H_MAGIC] in _OLD_MAGICS:
        return (f"{pool_path(name)} was left by an older vllm_aio version (another pool layout): "
                "stop the instances using it, or remove the file")
    if len(head) < _H_FIELDS or head[_H_MAGIC] != _MAGIC:
        return f"{pool_path(name)} is not a vllm_aio pool (or is still being created)"
    if head[_H_SLOT_SIZE] != slot_size:
        return (
            f"pool {name!r} holds {int(head[_H_SLOT_SIZE])}-byte blocks but this instance needs "
            f"{slot_size}-byte blocks: give instances with different models or parallelism "
            "different local_pool_name values"
        )
    return None


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
        if path == exclude:
            continue
        try:
            fd = _open_private(path, os.O_RDONLY)  # only our own pools: never another user's files
        except (OSError, RuntimeError):
            continue
        try:
            head = np.frombuffer(os.pread(fd, 8 * (_H_FIELDS + _MAX_PIDS), 0), dtype=np.int64)
        finally:
            os.close(fd)
        if len(head) < _H_FIELDS + _MAX_PIDS or head[_H_MAGIC] != _MAGIC:
            continue
        if not any(_pid_alive(int(p)) for p in head[_H_FIELDS:] if p):
            path.unlink(missing_ok=True)
            lock_path(path.name[len(_PREFIX):]).unlink(missing_ok=True)
