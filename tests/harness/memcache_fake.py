"""A stand-in for ``memcache_hybrid.DistributedObjectStore`` (1.3.0) that runs without an NPU.

The real memory-owning client cannot start here (its ``init`` fails the Ascend
driver check), so the backend's data paths are tested against this fake. It
copies the real class's method signatures (``test_memcache_backend`` checks
them against the installed library) and its return codes. Where each code
comes from:

- "seen": returned by memcache-hybrid 1.3.0 here, by a lookup-only client
  (``init(0, init_bm=False)``) against a real meta service with no memory in
  the pool. ``test_fake_matches_real_library`` replays these calls on both.
- "source": Ascend/memcache sources (``MmcErrorCode`` in mmc_types.h;
  ``MmcacheStore::ReturnWrapper``, ``BatchPutFrom`` / ``BatchGetInto`` in
  mmcache_store.cpp; ``MmcClientDefault::BatchGet`` in mmc_client_default.cpp).

``FakeMetaPort`` and ``write_local_conf`` give the backend what it checks
before it calls the client: a meta-service port that accepts TCP, a config file.
"""

from __future__ import annotations

import ctypes
import socket
import threading
from collections.abc import Sequence
from pathlib import Path

# MmcErrorCode (source: mmc_types.h)
OK, ERROR, INVALID_PARAM, TIMEOUT = 0, -1, -3000, -3004
DUPLICATED_OBJECT, OBJECT_NOT_EXISTS, LINK_NOT_FOUND, CLIENT_NOT_INIT = -3006, -3007, -3014, -3019
# BmCopyType (seen: memfabric_hybrid.bm.BmCopyType) and the directs each call accepts (seen).
L2G, G2L, G2H, H2G, AUTO = 0, 1, 2, 3, 9
PUT_DIRECTS, GET_DIRECTS = (L2G, H2G), (G2L, G2H)
PUT_LAYER_DIRECTS, GET_LAYER_DIRECTS = (L2G, H2G, AUTO), (G2L, G2H, AUTO)
MAX_KEY_LEN = 256  # seen: 256 characters accepted, 257 answer -3000


class NativeCrash(AssertionError):
    """A call the real library answers with a segfault (or that we never must make)."""


class FakeMetaService:
    """What the meta service and the contributed memory hold, shared by the clients that use it."""

    def __init__(self, capacity: int = 64 << 20, npu: bool = True) -> None:
        self.capacity = capacity  # bytes the memory-owning clients contribute
        self.npu = npu  # False: like this host, init(init_bm=True) fails the driver check
        self.values: dict[str, bytes] = {}
        self.down = False  # the meta service is gone
        self.hang_s = 60.0  # seen: the first call after it died blocks this long (or until release())
        self.lock = threading.Lock()
        self._released = threading.Event()
        self._stuck_cond = threading.Condition()
        self._stuck = 0  # calls blocked on the dead meta service now

    def used(self) -> int:
        return sum(len(v) for v in self.values.values())

    def hang(self) -> None:
        """Block like the first call after the meta service died: ``hang_s``, or until ``release``."""
        with self._stuck_cond:
            self._stuck += 1
            self._stuck_cond.notify_all()
        try:
            self._released.wait(self.hang_s)
        finally:
            with self._stuck_cond:
                self._stuck -= 1
                self._stuck_cond.notify_all()

    def release(self) -> None:
        """Let the blocked calls (and later ones that would block) return at once."""
        self._released.set()

    def wait_stuck(self, count: int, timeout: float = 30.0) -> bool:
        """Wait until ``count`` calls are blocked in ``hang``; False after ``timeout``."""
        with self._stuck_cond:
            return self._stuck_cond.wait_for(lambda: self._stuck == count, timeout=timeout)


class FakeKeyInfo:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:  # seen: 0 for a missing key
        return self._size


class FakeDistributedObjectStore:
    """The methods the backend uses, with the real parameter names and defaults."""

    def __init__(self, meta: FakeMetaService) -> None:
        self.meta = meta
        self.inited = False
        self.init_bm = True
        self.closed = False
        self.link_lost = False  # after a call timed out against a dead meta service
        self.registered: list[tuple[int, int]] = []
        self.calls: list[tuple[str, tuple, dict]] = []  # every call, to check against the real signatures
        self.script: dict[str, list[list[int]]] = {}  # method -> answers to give next, in order

    # -- plumbing ------------------------------------------------------------

    def _enter(self, name: str, args: tuple, kwargs: dict) -> list[int] | None:
        self.calls.append((name, args, kwargs))
        if self.closed:
            raise NativeCrash(f"{name} after close")
        if self.script.get(name):
            return self.script[name].pop(0)
        return None

    def _dead(self, n: int, first: int, later: int) -> list[int] | None:
        """Seen: with the meta service gone the first call blocks ``hang_s``, later ones fail at once."""
        if not self.meta.down:
            return None
        if not self.link_lost:
            self.meta.hang()
            self.link_lost = True
            return [first] * n
        return [later] * n

    @staticmethod
    def _bad_keys(keys: Sequence[str]) -> bool:
        return any(not k or len(k) > MAX_KEY_LEN for k in keys)

    # -- the real API ----------------------------------------------------------

    def init(self, device_id: int, init_bm: bool = True) -> int:
        self.calls.append(("init", (device_id,), {"init_bm": init_bm}))
        if self.meta.down:
            return ERROR  # seen: -1 after ~5 s against a dead port
        if init_bm and not self.meta.npu:
            return ERROR  # seen: "Failed to init smem bm" (driver check)
        self.inited, self.init_bm = True, init_bm
        return OK

    def close(self) -> int:
        self.calls.append(("close", (), {}))
        self.closed = True
        return OK  # seen

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        if (answer := self._enter("register_buffer", (buffer_ptr, size), {})) is not None:
            return answer[0]
        if not self.inited or not self.init_bm:
            raise NativeCrash("register_buffer on a lookup-only client segfaults (seen)")
        self.registered.append((buffer_ptr, size))
        return OK

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        if (answer := self._enter("batch_is_exist", (keys,), {})) is not None:
            return answer
        n = len(keys)
        if n == 0:
            return []  # seen
        if not self.inited:
            return [CLIENT_NOT_INIT] * n  # seen
        if (dead := self._dead(n, TIMEOUT, LINK_NOT_FOUND)) is not None:
            return dead  # seen: -3004 after 60 s, then -3014
        if self._bad_keys(keys):
            return [INVALID_PARAM] * n  # seen
        return [1 if k in self.meta.values else 0 for k in keys]  # seen: 1 / 0, "align with mooncake"

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                       direct: int = H2G, replicateConfig: object = None) -> list[int]:
        if (answer := self._enter("batch_put_from", (keys, buffer_ptrs, sizes, direct), {})) is not None:
            return answer
        if direct not in PUT_DIRECTS or len(buffer_ptrs) != len(keys) or len(sizes) != len(keys):
            return [INVALID_PARAM] * len(keys)  # seen (bad direct, length mismatch)
        return self._put(keys, [[p] for p in buffer_ptrs], [[s] for s in sizes])

    def batch_put_from_layers(self, keys: Sequence[str], buffer_ptrs: Sequence[Sequence[int]],
                              sizes: Sequence[Sequence[int]], direct: int = H2G,
                              replicateConfig: object = None) -> list[int]:
        if (answer := self._enter("batch_put_from_layers", (keys, buffer_ptrs, sizes, direct), {})) is not None:
            return answer
        if direct not in PUT_LAYER_DIRECTS or not _layers_ok(keys, buffer_ptrs, sizes):
            return [INVALID_PARAM] * len(keys)  # seen (bad direct, a key with no segment)
        return self._put(keys, buffer_ptrs, sizes)

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
                       direct: int = G2H) -> list[int]:
        if (answer := self._enter("batch_get_into", (keys, buffer_ptrs, sizes, direct), {})) is not None:
            return answer
        if direct not in GET_DIRECTS or len(buffer_ptrs) != len(keys) or len(sizes) != len(keys):
            return [INVALID_PARAM] * len(keys)  # seen
        return self._get(keys, [[p] for p in buffer_ptrs], [[s] for s in sizes])

    def batch_get_into_layers(self, keys: Sequence[str], buffer_ptrs: Sequence[Sequence[int]],
                              sizes: Sequence[Sequence[int]], direct: int = G2H) -> list[int]:
        if (answer := self._enter("batch_get_into_layers", (keys, buffer_ptrs, sizes, direct), {})) is not None:
            return answer
        if direct not in GET_LAYER_DIRECTS or not _layers_ok(keys, buffer_ptrs, sizes):
            return [INVALID_PARAM] * len(keys)  # seen
        return self._get(keys, buffer_ptrs, sizes)

    def batch_get_key_info(self, keys: Sequence[str], flag: int = 1) -> list[FakeKeyInfo]:
        if (answer := self._enter("batch_get_key_info", (keys,), {})) is not None:
            return answer
        if not keys or self.meta.down:
            return []  # source: an empty list when the query fails
        return [FakeKeyInfo(len(self.meta.values.get(k, b""))) for k in keys]  # seen: size 0 when missing

    # -- behaviour -------------------------------------------------------------

    def _put(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        n = len(keys)
        if n == 0:
            return []  # seen
        if not self.inited:
            return [CLIENT_NOT_INIT] * n
        if (dead := self._dead(n, INVALID_PARAM, INVALID_PARAM)) is not None:
            return dead  # seen: -3000 after 60 s, then at once
        if self._bad_keys(keys):
            return [INVALID_PARAM] * n  # seen
        codes = []
        with self.meta.lock:
            for key, key_ptrs, key_sizes in zip(keys, ptrs, sizes):
                if any(s <= 0 for s in key_sizes):
                    codes.append(INVALID_PARAM)  # seen: size 0
                elif key in self.meta.values:
                    codes.append(OK)  # source: ReturnWrapper reports DUPLICATED_OBJECT as 0, old value kept
                elif self.meta.used() + sum(key_sizes) > self.meta.capacity:
                    codes.append(ERROR)  # seen: "Alloc allocators_ is empty" -> -1; source: full ranks -> -1
                else:
                    self.meta.values[key] = b"".join(ctypes.string_at(p, s) for p, s in zip(key_ptrs, key_sizes))
                    codes.append(OK)
        return codes

    def _get(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        n = len(keys)
        if n == 0:
            return []  # seen
        if not self.inited:
            return [INVALID_PARAM] * n  # seen (after a failed init)
        if (dead := self._dead(n, INVALID_PARAM, INVALID_PARAM)) is not None:
            return dead  # seen
        if self._bad_keys(keys):
            return [INVALID_PARAM] * n  # seen
        codes = []
        with self.meta.lock:
            for key, key_ptrs, key_sizes in zip(keys, ptrs, sizes):
                value = self.meta.values.get(key)
                if value is None:
                    codes.append(OBJECT_NOT_EXISTS)  # seen
                elif len(value) != sum(key_sizes):
                    codes.append(ERROR)  # source: BatchGet skips the key, its result stays MMC_ERROR
                else:
                    offset = 0
                    for p, s in zip(key_ptrs, key_sizes):
                        ctypes.memmove(p, value[offset:offset + s], s)
                        offset += s
                    codes.append(OK)
        return codes


def _layers_ok(keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> bool:
    """Source: MmcacheStore::CheckInput; seen: a key with no segment -> -3000."""
    if len(ptrs) != len(keys) or len(sizes) != len(keys):
        return False
    return all(0 < len(p) == len(s) for p, s in zip(ptrs, sizes))


class FakeMetaPort:
    """A listening socket, so the backend's TCP probe sees a meta service."""

    def __init__(self) -> None:
        self.port = free_port()
        self.sock: socket.socket | None = None
        self.up()

    def up(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(64)

    def down(self) -> None:
        self.sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_local_conf(path: Path, meta_port: int, store_port: int, protocol: str = "host_tcp") -> Path:
    """A client config file (``MMC_LOCAL_CONFIG_PATH``) naming these ports."""
    path.write_text(
        f"ock.mmc.meta_service_url = tcp://127.0.0.1:{meta_port}\n"
        f"ock.mmc.local_service.config_store_url = tcp://127.0.0.1:{store_port}\n"
        f"# a comment line\nock.mmc.local_service.protocol = {protocol}\n"
        "ock.mmc.local_service.dram.size = 64MB\nock.mmc.local_service.hbm.size = 0\nock.mmc.log_level = error\n"
    )
    return path
