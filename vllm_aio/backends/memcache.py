"""The Memcache store (``memcache_hybrid``, Ascend's pooled KV store) as a pooled backend.

Its meta service places values in memory that clients contribute (DRAM or NPU
HBM); a batch moves in one call (``batch_put_from`` / ``batch_get_into``, or the
``*_layers`` variants for several segments per key). Learned from 1.3.0 ("seen"):

- Settings: the library's own file, ``$MMC_LOCAL_CONFIG_PATH`` (``ock.mmc.*`` keys),
  read by the library once, at import (seen). ``setup(LocalConfig)`` would replace
  it, not merge, so we copy none of its ~40 keys: we read its URLs (probed before
  ``init``) and add what it lacks: device_id, memory.
- A memory-owning client needs an Ascend NPU: ``init`` checks the driver before
  any protocol, host_tcp / host_shm included (seen); we name that cause. The
  scheduler's lookup-only client (``init_bm=False``) needs none.
- Codes (``MmcErrorCode``, mmc_types.h): a put of an existing key returns 0 and
  keeps the old value, so OK; a pool without room answers -1 (seen); -1 / -3000
  on a get may hide a length mismatch, which a lookup settles.
- Bounded failure: with the meta service gone the next call blocks 60 s (seen),
  later ones fail at once. Calls run on daemon threads with a deadline; after a
  timeout or link error, calls answer ERROR at once until a TCP probe (one per
  0.5 s) sees it again. A timed-out get may still write its (same) bytes later.
- One client per process, shared by its backends; the last ``close`` frees it and
  no call follows; a lookup-only one never gets ``register_buffer`` (segfault, seen).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any

from vllm_aio.backends.base import Backend, Segment, Status, distinct_only
from vllm_aio.backends.mooncake import _MasterLink, tcp_reachable  # shared TCP probe
from vllm_aio.config import ConfigError

# MmcErrorCode (mmc_types.h, Ascend/memcache) values this backend distinguishes.
MMC_ERROR = -1  # put: no room (seen); get: missing or length mismatch (source)
INVALID_PARAM = -3000  # bad arguments (seen); get/put after the meta service died (seen)
TIMEOUT = -3004  # the meta service did not answer within 60 s (seen)
DUPLICATED_OBJECT = -3006  # put of an existing key; the binding reports 0 instead
OBJECT_NOT_EXISTS = -3007  # get of a missing key (seen)
LINK_NOT_FOUND = -3014  # calls after a meta-service timeout (seen)
EXCEED_CAPACITY, NOT_ENOUGH_MEMORY, NOT_CONNECT_META = -3013, -3016, -3017
CLIENT_NOT_INIT = -3019  # calls on a client whose init failed (seen)
UNMATCHED_STATE = -3101  # the value is still being written
UNMATCHED_KEY = -3102  # absent (remove / exist, seen)
LEASE_EXPIRED = -3106  # the value may have been evicted while being read
UNAVAILABLE = -(1 << 30)  # ours: the call timed out or the link is down

# memfabric_hybrid.bm.BmCopyType: which side of the copy is HBM / DRAM.
L2G, G2L, G2H, H2G = 0, 1, 2, 3
DIRECTS = {"host": (H2G, G2H), "device": (L2G, G2L)}  # memory -> (put, get)

_NO_SPACE = frozenset({MMC_ERROR, NOT_ENOUGH_MEMORY, EXCEED_CAPACITY})
_MISSING = frozenset({OBJECT_NOT_EXISTS, UNMATCHED_KEY, UNMATCHED_STATE})
_AMBIGUOUS_GET = frozenset({MMC_ERROR, INVALID_PARAM})
_LINK_DOWN = frozenset({UNAVAILABLE, TIMEOUT, LINK_NOT_FOUND, NOT_CONNECT_META, CLIENT_NOT_INIT})
CHUNK = 512  # keys per native call: the smallest batch limit any binding version had

INSTALL_HINT = "pip install 'vllm_aio[memcache]'"
ENV_CONFIG_PATH = "MMC_LOCAL_CONFIG_PATH"
DRIVER_FILES = ("/etc/ascend_install.info", "/usr/local/Ascend/driver/version.info")
# Methods of DistributedObjectStore this module calls (the tests check them against the library).
STORE_METHODS = ("init", "close", "register_buffer", "batch_is_exist", "batch_put_from", "batch_get_into",
                 "batch_put_from_layers", "batch_get_into_layers", "batch_get_key_info")


# One client per process (seen: closing one DistributedObjectStore un-initializes all of the
# process's), and vLLM runs the scheduler and a TP=1 worker in one process: backends share it.
_CLIENTS: dict[Any, list] = {}  # store factory -> [store, lookup_only, users]
_CLIENTS_LOCK = threading.Lock()


class MemcacheUnavailableError(RuntimeError):
    """The Memcache client cannot be imported, reach its meta service, or start."""


@dataclass(frozen=True)
class MemcacheSettings:
    config_path: str  # the library's config file (ock.mmc.* keys): $MMC_LOCAL_CONFIG_PATH
    # Read from the file: the meta service ("tcp://host:port"), its config store (which a
    # memory-owning client joins) and the transfer protocol (for messages).
    meta_service_url: str
    config_store_url: str = ""
    protocol: str = "host_rdma"
    device_id: int | None = None  # NPU of this process; None: torch.npu's current one, else 0
    memory: str | None = None  # segments in "host" DRAM or "device" HBM; None: device if torch_npu is loaded
    lookup_only: bool = False  # the scheduler's client: looks keys up, contributes no memory, needs no NPU

    def __post_init__(self) -> None:
        if self.memory is not None and self.memory not in DIRECTS:
            raise ConfigError(f"memory: expected one of {', '.join(DIRECTS)}, got {self.memory!r}")
        if self.device_id is not None and (isinstance(self.device_id, bool) or not isinstance(self.device_id, int)):
            raise ConfigError(f"device_id: expected an integer, got {self.device_id!r}")
        _tcp_address("ock.mmc.meta_service_url", self.meta_service_url)

    @classmethod
    def load(cls, inline: Mapping[str, Any] | None = None,
             environ: Mapping[str, str] | None = None) -> MemcacheSettings:
        """Settings from ``$MMC_LOCAL_CONFIG_PATH`` (no inline path: the library reads that) and ``inline``."""
        environ = os.environ if environ is None else environ
        inline = dict(inline or {})
        if unknown := sorted(set(inline) - {"device_id", "memory"}):
            raise ConfigError(f"unknown Memcache setting(s) {', '.join(unknown)}; accepted: device_id, memory")
        if not (path := environ.get(ENV_CONFIG_PATH)):
            raise ConfigError(f"{ENV_CONFIG_PATH}: not set; point it to Memcache's local config file "
                              "(a sample ships in memcache_hybrid/config/mmc-local.conf)")
        if not (url := (conf := read_conf(path)).get("ock.mmc.meta_service_url")):
            raise ConfigError(f"ock.mmc.meta_service_url: missing in {path}")
        return cls(config_path=path, meta_service_url=url,
                   config_store_url=conf.get("ock.mmc.local_service.config_store_url", ""),
                   protocol=conf.get("ock.mmc.local_service.protocol", "host_rdma"), **inline)


def read_conf(path: str) -> dict[str, str]:
    """The ``key = value`` lines of a Memcache config file, read as the library does
    (seen: ``#`` starts a comment line only; after a value it is part of the value)."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as e:
        raise ConfigError(f"{ENV_CONFIG_PATH}: cannot read Memcache config {path}: {e}") from e
    pairs = (line.partition("=") for line in lines if not line.lstrip().startswith("#"))
    return {k.strip(): v.strip() for k, sep, v in pairs if sep and k.strip()}


def _tcp_address(key: str, url: str) -> str:
    """``host:port`` of a ``tcp://host:port`` URL."""
    scheme, sep, rest = str(url).partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not colon or not host or not port.isdigit():
        raise ConfigError(f"{key}: expected 'tcp://host:port', got {url!r}")
    return f"{host}:{port}"


def import_store() -> type:
    try:
        from memcache_hybrid import DistributedObjectStore
    except (ImportError, OSError) as e:
        raise MemcacheUnavailableError(f"the Memcache backend needs memcache_hybrid ({e}): {INSTALL_HINT}") from e
    return DistributedObjectStore


def put_status(code: int) -> Status:
    """The status of one key after a put returned ``code``."""
    return (Status.OK if code == 0 else Status.EXISTS if code == DUPLICATED_OBJECT
            else Status.NO_SPACE if code in _NO_SPACE else Status.ERROR)


def get_status(code: int) -> Status:
    """The status of one key after a get returned ``code`` (-1 / -3000: see ``_diagnose``)."""
    return (Status.OK if code == 0 else Status.MISSING if code in _MISSING
            else Status.CORRUPT if code == LEASE_EXPIRED else Status.ERROR)


class _Runner:
    """Daemon threads for native calls: a call stuck in the client (60 s with the
    meta service gone) blocks neither its caller past a deadline nor the exit."""

    def __init__(self, threads: int = 4) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._busy = 0
        self._threads = threads
        for i in range(threads):
            threading.Thread(target=self._work, name=f"memcache-{i}", daemon=True).start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            with self._cond:
                self._busy += 1
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def run(self, fn: Callable[[], Any], timeout: float) -> Any:
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut.result(timeout=timeout)

    def drain(self, timeout: float) -> bool:  # False: a call still runs after ``timeout``
        with self._cond:
            return self._cond.wait_for(lambda: self._busy == 0, timeout=timeout)

    def stop(self) -> None:  # the threads end after the calls already queued
        for _ in range(self._threads):
            self._jobs.put(None)


class MemcacheBackend(Backend):
    """``Backend`` over ``memcache_hybrid.DistributedObjectStore`` (see the module docstring)."""

    def __init__(self, settings: MemcacheSettings, *, connect_timeout: float = 3.0, call_timeout: float = 5.0,
                 init_timeout: float = 30.0, close_timeout: float = 5.0,
                 store_factory: Callable[[], Any] | None = None) -> None:
        self.settings = settings = _resolve(settings)
        self._call_timeout, self._close_timeout = call_timeout, close_timeout
        self._closed = False
        self._link = _MasterLink(_tcp_address("ock.mmc.meta_service_url", settings.meta_service_url))
        self._registered: list[tuple[int, int]] = []
        self._reg_lock = threading.Lock()
        self._factory = factory = store_factory or import_store()
        needs = {"ock.mmc.meta_service_url": settings.meta_service_url}
        if settings.config_store_url and not settings.lookup_only:  # init waits for it (seen: > 30 s)
            needs["ock.mmc.local_service.config_store_url"] = settings.config_store_url
        for key, url in needs.items():
            if not tcp_reachable(_tcp_address(key, url), connect_timeout):
                raise MemcacheUnavailableError(
                    f"Memcache: {key} {url} is unreachable (no TCP connection within {connect_timeout:.1f} s); start "
                    f"the meta service (config in $MMC_META_CONFIG_PATH) or fix {key} in {settings.config_path}")
        self._runner = _Runner()
        with _CLIENTS_LOCK:
            if (shared := _CLIENTS.get(factory)) is None:
                self._store = factory()
                try:
                    rc, native = self._runner.run(self._init, init_timeout)
                except FutureTimeout:
                    rc, native = None, f"Memcache init took over {init_timeout:.0f} s"
                if rc != 0:
                    self._runner.stop()
                    raise MemcacheUnavailableError(self._init_failure(rc, native) if rc is not None else native)
                shared = _CLIENTS[factory] = [self._store, settings.lookup_only, 0]
            elif shared[1] and not settings.lookup_only:
                self._runner.stop()
                raise MemcacheUnavailableError(
                    "this process already has a lookup-only Memcache client and the library allows one client "
                    "per process: create the memory-owning backend (the worker's) before the scheduler's")
            self._store, shared[2] = shared[0], shared[2] + 1

    def _init(self) -> tuple[int, str]:
        """The init code and, on failure, memfabric's last error (kept per thread: read it here)."""
        rc = self._store.init(self.settings.device_id, init_bm=not self.settings.lookup_only)
        try:
            from memfabric_hybrid import get_and_clear_last_err_msg

            return rc, (get_and_clear_last_err_msg() if rc != 0 else "")
        except Exception:  # noqa: BLE001 - the message only decorates the failure
            return rc, ""

    def _init_failure(self, rc: int, native: str) -> str:
        s = self.settings
        msg = (f"Memcache init (device {s.device_id}, protocol {s.protocol!r}, config {s.config_path}) failed "
               f"with code {rc}" + (f" ({native})" if native else ""))
        if rc == INVALID_PARAM:
            msg += (f"; the library refused its config file (its log names the key), or found no {ENV_CONFIG_PATH}:"
                    " it reads the variable once, when memcache_hybrid is imported")
        if not s.lookup_only and not any(os.path.exists(p) for p in DRIVER_FILES):
            msg += ("; cause: the Ascend driver check. memfabric checks the driver's version (in "
                    f"{' or '.join(DRIVER_FILES)}, none here) before any protocol, host_tcp and host_shm "
                    "included: a memory-owning Memcache client needs an Ascend NPU host with driver and CANN")
        return msg

    # -- Backend -----------------------------------------------------------

    def register_memory(self, address: int, size: int) -> None:
        """Register a region once (a region inside a registered one needs nothing)."""
        self._open()
        if self.settings.lookup_only:
            return  # register_buffer segfaults on a lookup-only client (seen)

        def register() -> None:
            self._open()
            if not any(a <= address and address + size <= a + n for a, n in self._registered):
                if (rc := self._store.register_buffer(address, size)) != 0:
                    raise RuntimeError(f"Memcache register_buffer({address:#x}, {size}) failed with code {rc}")
                self._registered.append((address, size))

        with self._reg_lock:
            try:
                self._runner.run(register, self._call_timeout)
            except FutureTimeout:
                raise RuntimeError(f"Memcache register_buffer took over {self._call_timeout:.0f} s") from None

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        keys = list(keys)
        codes = self._call(len(keys), lambda idx: self._store.batch_is_exist([keys[i] for i in idx]))
        return [c == 1 for c in codes]

    def batch_put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        return distinct_only(self._put_distinct, keys, segments)

    def _put_distinct(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        return [put_status(c) for c in self._move(keys, segments, put=True)]

    def batch_get(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        return distinct_only(self._get_distinct, keys, segments)

    def _get_distinct(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        codes = self._move(keys, segments, put=False)
        statuses = [get_status(c) for c in codes]
        unclear = [i for i, c in enumerate(codes) if c in _AMBIGUOUS_GET]
        found = self._diagnose([keys[i] for i in unclear], [sum(n for _, n in segments[i]) for i in unclear])
        for i, status in zip(unclear, found):
            statuses[i] = status
        return statuses

    def close(self) -> None:
        """Wait for calls in flight (up to ``close_timeout``); the last user frees the client.

        A call still stuck in the client keeps it alive: freeing it under the
        call could crash the process; the library frees it at exit.
        """
        if self._closed:
            return
        self._closed = True
        idle = self._runner.drain(self._close_timeout)
        self._runner.stop()
        with _CLIENTS_LOCK:
            shared = _CLIENTS[self._factory]
            shared[2] -= 1
            if shared[2] == 0:
                del _CLIENTS[self._factory]
                if idle:
                    self._store.close()

    # -- store calls ---------------------------------------------------------

    def _move(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], put: bool) -> list[int]:
        """Codes of one batched put or get: single-buffer calls when every key has one segment."""
        if len(keys) != len(segments):
            raise ValueError(f"{len(keys)} keys but {len(segments)} segment lists")
        if self.settings.lookup_only:
            raise RuntimeError("this Memcache client is lookup-only (the scheduler's); it cannot move values")
        direct = DIRECTS[self.settings.memory][0 if put else 1]
        if all(len(s) == 1 for s in segments):
            single = self._store.batch_put_from if put else self._store.batch_get_into
            return self._call(len(keys), lambda idx: single(
                [keys[i] for i in idx], [segments[i][0][0] for i in idx], [segments[i][0][1] for i in idx], direct))
        layers = self._store.batch_put_from_layers if put else self._store.batch_get_into_layers
        return self._call(len(keys), lambda idx: layers(
            [keys[i] for i in idx], [[a for a, _ in segments[i]] for i in idx],
            [[n for _, n in segments[i]] for i in idx], direct))

    def _call(self, n: int, call: Callable[[list[int]], list[int]]) -> list[int]:
        """Codes of ``call`` over all ``n`` keys, in chunks, each within the call deadline."""
        codes: list[int] = []
        for start in range(0, n, CHUNK):
            idx = list(range(start, min(start + CHUNK, n)))
            codes += self._bounded(len(idx), lambda idx=idx: call(idx))
        return codes

    def _open(self) -> None:
        if self._closed:
            raise RuntimeError("MemcacheBackend is closed")

    def _bounded(self, n: int, fn: Callable[[], list[Any]]) -> list[Any]:
        """``fn()`` on a runner thread: its codes, or UNAVAILABLE for all after the deadline or while down."""
        self._open()
        if not self._link.usable():
            return [UNAVAILABLE] * n

        def guarded() -> list[Any]:
            self._open()  # checked on the runner thread: close() waits for what got past it
            return fn()

        try:
            codes = self._runner.run(guarded, self._call_timeout)
        except FutureTimeout:
            codes = [UNAVAILABLE] * n
        if not isinstance(codes, list) or len(codes) != n:
            codes = [INVALID_PARAM] * n  # the binding answers a refused batch with a shorter list
        if any(isinstance(c, int) and c in _LINK_DOWN for c in codes):
            self._link.probe(0.2)
        return codes

    def _diagnose(self, keys: list[str], expected: list[int]) -> list[Status]:
        """Tell a length mismatch (CORRUPT) from a missing key or a failure, for gets that said -1 / -3000."""
        exist = self._call(len(keys), lambda idx: self._store.batch_is_exist([keys[i] for i in idx]))
        present = [k for k, e in zip(keys, exist) if e == 1]
        infos = self._call(len(present), lambda idx: self._store.batch_get_key_info([present[i] for i in idx]))
        sizes = {k: info.size() for k, info in zip(present, infos) if not isinstance(info, int)}
        return [
            Status.MISSING if e == 0
            else Status.CORRUPT if sizes.get(key, 0) not in (0, want)
            else Status.ERROR
            for key, e, want in zip(keys, exist, expected)
        ]


def _resolve(settings: MemcacheSettings) -> MemcacheSettings:
    """Fill ``device_id`` and ``memory`` from the process: NPU ones when torch_npu is loaded."""
    npu = sys.modules.get("torch_npu") is not None
    device_id = settings.device_id
    if device_id is None:
        device_id = int(sys.modules["torch"].npu.current_device()) if npu else 0
    return replace(settings, device_id=device_id, memory=settings.memory or ("device" if npu else "host"))
