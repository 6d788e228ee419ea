"""The Memcache store (``memcache_hybrid``, Ascend's pooled KV store) as a pooled backend.

Its meta service places values in memory that clients contribute (DRAM or NPU
HBM); a batch moves in one call (``batch_put_from`` / ``batch_get_into``, or the
``*_layers`` variants for several segments per key). Learned from 1.3.0 ("seen"):

- Settings: the library's own file (``memcache_settings.py``).
- A memory-owning client needs an Ascend NPU: ``init`` checks the driver before
  any protocol, host_tcp / host_shm included (seen); we name that cause. The
  scheduler's lookup-only client (``init_bm=False``) needs none.
- Codes (``MmcErrorCode``, mmc_types.h): a put of an existing key returns 0 and
  keeps the old value, so OK; a pool without room answers -1 (seen); -1 / -3000
  on a get may hide a length mismatch, which a lookup settles.
- Copy types: each call names which side is DRAM and which HBM. Segments are
  host memory (``base.py``) unless they lie in a region registered as device
  memory; a batch moves with the copy type of its keys' memory.
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
from collections.abc import Callable, Sequence
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any

from vllm_aio.backends.base import Backend, Memory, Status, check_memory, distinct_only
from vllm_aio.backends.memcache_settings import ENV_CONFIG_PATH, MemcacheSettings, tcp_address
from vllm_aio.backends.remote import (
    ABSENT, CallGate, MasterLink, Regions, count_by_probes, diagnose, exists_over, tcp_reachable,
)
from vllm_aio.device.segment import Segment
from vllm_aio.pool.keys import BlockParts

__all__ = ["MemcacheBackend", "MemcacheSettings", "MemcacheUnavailableError"]

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
MIXED_MEMORY = UNAVAILABLE - 1  # ours: a key's segments mix host and device memory (never sent)

# memfabric_hybrid.bm.BmCopyType: which side of the copy is HBM / DRAM.
L2G, G2L, G2H, H2G = 0, 1, 2, 3
DIRECTS = {Memory.HOST: (H2G, G2H), Memory.DEVICE: (L2G, G2L)}  # segments' memory -> (put, get)

_NO_SPACE = frozenset({MMC_ERROR, NOT_ENOUGH_MEMORY, EXCEED_CAPACITY})
_MISSING = frozenset({OBJECT_NOT_EXISTS, UNMATCHED_KEY, UNMATCHED_STATE})
_AMBIGUOUS_GET = frozenset({MMC_ERROR, INVALID_PARAM})
_LINK_DOWN = frozenset({UNAVAILABLE, TIMEOUT, LINK_NOT_FOUND, NOT_CONNECT_META, CLIENT_NOT_INIT})
CHUNK = 512  # keys per native call: the smallest batch limit any binding version had

INSTALL_HINT = "pip install 'vllm_aio[memcache]'"
DRIVER_FILES = ("/etc/ascend_install.info", "/usr/local/Ascend/driver/version.info")
# Methods of DistributedObjectStore this module calls (the tests check them against the library).
STORE_METHODS = ("init", "close", "register_buffer", "batch_is_exist", "batch_put_from", "batch_get_into",
                 "batch_put_from_layers", "batch_get_into_layers", "batch_get_key_info")


@dataclass
class _Client:
    """The process's client. One per process (seen: closing one DistributedObjectStore
    un-initializes all of the process's), and vLLM runs the scheduler and a TP=1
    worker in one process: their backends share it."""

    store: Any
    lookup_only: bool  # made by init(init_bm=False): a memory-owning backend cannot use it
    users: int = 0  # backends not yet closed; the last one frees the store


_CLIENTS: dict[Any, _Client] = {}  # store factory -> its client; guarded by _CLIENTS_LOCK
_CLIENTS_LOCK = threading.Lock()


class MemcacheUnavailableError(RuntimeError):
    """The Memcache client cannot be imported, reach its meta service, or start."""


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
        self._threads = threads
        for i in range(threads):
            threading.Thread(target=self._work, name=f"memcache-{i}", daemon=True).start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def run(self, fn: Callable[[], Any], timeout: float) -> Any:
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut.result(timeout=timeout)

    def stop(self) -> None:  # the threads end after the calls already queued
        for _ in range(self._threads):
            self._jobs.put(None)


class MemcacheBackend(Backend):
    """``Backend`` over ``memcache_hybrid.DistributedObjectStore`` (see the module docstring).

    ``probe_interval``: seconds between probes of a meta service found gone.
    """

    event_medium = "MEMCACHE"  # no block_watch: the client does not report evictions

    def __init__(self, settings: MemcacheSettings, *, value_bytes: int | None = None,
                 connect_timeout: float = 3.0, call_timeout: float = 5.0,
                 init_timeout: float = 30.0, close_timeout: float = 5.0, probe_interval: float = 0.5,
                 store_factory: Callable[[], Any] | None = None) -> None:
        self.settings = settings = _resolve(settings)
        self._value_bytes = value_bytes  # of every value; None: any (see base.distinct_only)
        self._call_timeout, self._close_timeout = call_timeout, close_timeout
        self._gate = CallGate("MemcacheBackend")
        meta = tcp_address("ock.mmc.meta_service_url", settings.meta_service_url)
        self._link = MasterLink(meta, "Memcache meta service", probe_interval=probe_interval)
        self._regions = Regions()  # guarded by _reg_lock
        self._reg_lock = threading.Lock()
        self._factory = factory = store_factory or import_store()
        needs = {"ock.mmc.meta_service_url": settings.meta_service_url}
        if settings.config_store_url and not settings.lookup_only:  # init waits for it (seen: > 30 s)
            needs["ock.mmc.local_service.config_store_url"] = settings.config_store_url
        for key, url in needs.items():
            if not tcp_reachable(tcp_address(key, url), connect_timeout):
                raise MemcacheUnavailableError(
                    f"Memcache: {key} {url} is unreachable (no TCP connection within {connect_timeout:.1f} s); start "
                    f"the meta service (config in $MMC_META_CONFIG_PATH) or fix {key} in {settings.config_path}")
        self._runner = _Runner()
        with _CLIENTS_LOCK:
            if (client := _CLIENTS.get(factory)) is None:
                self._store = factory()
                try:
                    rc, native = self._runner.run(self._init, init_timeout)
                except FutureTimeout:
                    rc, native = None, f"Memcache init took over {init_timeout:.0f} s"
                if rc != 0:
                    self._runner.stop()
                    raise MemcacheUnavailableError(self._init_failure(rc, native) if rc is not None else native)
                client = _CLIENTS[factory] = _Client(self._store, settings.lookup_only)
            elif client.lookup_only and not settings.lookup_only:
                self._runner.stop()
                raise MemcacheUnavailableError(
                    "this process already has a lookup-only Memcache client and the library allows one client "
                    "per process: create the memory-owning backend (the worker's) before the scheduler's")
            self._store = client.store
            client.users += 1

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

    def segment_memory(self) -> frozenset[Memory]:
        """Host memory; a memory-owning client also moves its NPU's memory (HBM)."""
        return frozenset({Memory.HOST}) if self.settings.lookup_only else frozenset(Memory)

    def wants_registration(self) -> bool:
        return not self.settings.lookup_only

    def register_memory(self, address: int, size: int, memory: Memory = Memory.HOST) -> None:
        """Register a region once (a region inside a registered one needs nothing)."""
        self._gate.check_open()
        check_memory(self, memory)
        if self.settings.lookup_only:
            return  # register_buffer segfaults on a lookup-only client (seen)

        def register() -> None:
            with self._gate.call():
                if not self._regions.covers(address, size):
                    if (rc := self._store.register_buffer(address, size)) != 0:
                        raise RuntimeError(f"Memcache register_buffer({address:#x}, {size}) failed with code {rc}")
                    self._regions.add(address, size, memory)

        with self._reg_lock:
            try:
                self._runner.run(register, self._call_timeout)
            except FutureTimeout:
                raise RuntimeError(f"Memcache register_buffer took over {self._call_timeout:.0f} s") from None

    def shared_store(self) -> str:
        return f"memcache:{self.settings.meta_service_url}"

    def describe(self) -> str:
        s = self.settings
        role = " lookup-only" if s.lookup_only else ""
        return (f"meta_service={s.meta_service_url} protocol={s.protocol} device_id={s.device_id}{role} "
                f"config={ENV_CONFIG_PATH}={s.config_path}")

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return exists_over(self._call, self._store.batch_is_exist, keys)

    def count_complete_blocks(self, parts: BlockParts, hashes: Sequence[bytes]) -> int:
        """One probe key per block (``remote.count_by_probes``), one round trip per 8,192 blocks."""
        return count_by_probes(self.batch_exists, parts, hashes)

    def batch_put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], retention: int = 0) -> list[Status]:
        # Memcache's client has no per-value eviction priority: every class is stored alike.
        return distinct_only(self._put_distinct, keys, segments, self._value_bytes, Status.ERROR)

    def _put_distinct(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        return [put_status(c) for c in self._move(keys, segments, put=True)]

    def batch_get(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        return distinct_only(self._get_distinct, keys, segments, self._value_bytes, Status.CORRUPT)

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
        if self._gate.closed:
            return
        idle = self._gate.close(self._close_timeout)
        self._runner.stop()
        with _CLIENTS_LOCK:
            client = _CLIENTS[self._factory]
            client.users -= 1
            if client.users == 0:
                del _CLIENTS[self._factory]
                if idle:
                    self._store.close()

    # -- store calls ---------------------------------------------------------

    def _move(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], put: bool) -> list[int]:
        """Codes of one batched put or get, one native batch per kind of memory the keys' segments are in."""
        if len(keys) != len(segments):
            raise ValueError(f"{len(keys)} keys but {len(segments)} segment lists")
        if self.settings.lookup_only:
            raise RuntimeError("this Memcache client is lookup-only (the scheduler's); it cannot move values")
        kinds = [self._regions.memory_of(segs) for segs in segments]
        codes = [MIXED_MEMORY] * len(keys)
        for memory in {k for k in kinds if k is not None}:
            idx = [i for i, k in enumerate(kinds) if k is memory]
            moved = self._move_in(memory, [keys[i] for i in idx], [segments[i] for i in idx], put)
            for i, code in zip(idx, moved):
                codes[i] = code
        return codes

    def _move_in(self, memory: Memory, keys: list[str], segments: list[Sequence[Segment]], put: bool) -> list[int]:
        """Codes of keys whose segments all lie in ``memory``: single-buffer calls when each has one segment."""
        direct = DIRECTS[memory][0 if put else 1]
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

    def _bounded(self, n: int, fn: Callable[[], list[Any]]) -> list[Any]:
        """``fn()`` on a runner thread: its codes, or UNAVAILABLE for all after the deadline or while down."""
        self._gate.check_open()
        if not self._link.usable():
            return [UNAVAILABLE] * n

        def guarded() -> list[Any]:
            with self._gate.call():  # on the runner thread: close() waits for what got past it
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

        def stored(key: str, exists: int) -> int | None:  # size 0: the lookup did not say
            return ABSENT if exists == 0 else (sizes.get(key) or None) if exists == 1 else None

        return [diagnose(stored(key, e), want) for key, e, want in zip(keys, exist, expected)]


def _resolve(settings: MemcacheSettings) -> MemcacheSettings:
    """Fill ``device_id`` from the process: torch.npu's current device when torch_npu is loaded, else 0."""
    if settings.device_id is not None:
        return settings
    npu = sys.modules.get("torch_npu") is not None
    return replace(settings, device_id=int(sys.modules["torch"].npu.current_device()) if npu else 0)
