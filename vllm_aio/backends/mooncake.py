"""The Mooncake store as a pooled backend: zero-copy batches (``batch_put_from_multi_buffers``,
``batch_get_into_multi_buffers``) between registered KV memory and a pool shared across hosts, small
pieces gathered through a registered staging buffer. Over the raw client it adds typed statuses for
its return codes, bounded failure while the master is gone (``remote.MasterLink``), and no call
after ``close``. Why each: ``docs/backends.md``, "Inside the Mooncake backend".
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import importlib.util
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from vllm_aio.backends.base import Backend, Memory, Status, check_memory, distinct_only
from vllm_aio.backends.mooncake_settings import DEFAULT_TENANT_ID, MooncakeSettings
from vllm_aio.backends.remote import (
    ABSENT, CallGate, MasterLink, Regions, count_by_probes, diagnose, exists_over, tcp_reachable,
)
from vllm_aio.backends.segments import gather, scatter, total
from vllm_aio.device.segment import Segment
from vllm_aio.pool.keys import BlockParts

__all__ = ["MooncakeBackend", "MooncakeSettings", "MooncakeUnavailableError"]  # settings: for the benchmarks

# Mooncake ErrorCode values this backend distinguishes.
NO_AVAILABLE_HANDLE = -200  # no space left in any segment (pool full)
INVALID_PARAMS = -600  # bad arguments; at get: destination smaller than value
REPLICA_IS_NOT_READY = -703  # another client is still writing the value
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707  # the value may have been evicted while being read
REPLICA_IS_GONE = -712
TRANSFER_FAIL = -800  # at get: also a destination larger than the value
RPC_FAIL = -900  # the master did not answer

STAGE_BELOW = 32 << 10  # bytes: mean segment size under which tcp batches are staged
STAGING_SIZE = 32 << 20  # bytes of the staging buffer, allocated on first use

_MISSING_CODES = frozenset({REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND, REPLICA_IS_GONE})
# Get failures that may hide a length mismatch: asking the value's size tells.
_AMBIGUOUS_GET_CODES = frozenset({INVALID_PARAMS, TRANSFER_FAIL})

INSTALL_HINT = "pip install 'vllm_aio[mooncake]'"
_ENV_SETUP_RETRIES = "MC_STORE_CLIENT_SETUP_RETRIES"
# Each setup attempt against a dead master costs ~4.4 s: two stay under 10 s.
_SETUP_RETRIES = "2"


class MooncakeUnavailableError(RuntimeError):
    """The Mooncake client cannot be imported or the master cannot be reached."""


def import_store() -> type:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise MooncakeUnavailableError(
            f"the Mooncake backend needs the mooncake package ({e}); install it with {INSTALL_HINT} "
            "(on Debian/Ubuntu it also needs: apt-get install libibverbs1 librdmacm1 libnuma1)"
        ) from e
    return MooncakeDistributedStore


def _replicate_configs() -> tuple[Any, Any]:
    """(plain, soft-pinned) put configs."""
    from mooncake.store import ReplicateConfig, SoftPinAction

    pinned = ReplicateConfig()
    pinned.soft_pin_action = SoftPinAction.ENABLE
    return ReplicateConfig(), pinned


@contextmanager
def _env_default(name: str, value: str) -> Iterator[None]:
    """Set an environment variable for the block unless the user set it."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


NPU_DISTRIBUTION = "mooncake-transfer-engine-npu"  # Mooncake's wheel built with its Ascend transport


def ascend_transport_built() -> bool:
    """Whether the installed ``mooncake`` package is Mooncake's NPU build (which has the Ascend transport)."""
    return NPU_DISTRIBUTION in importlib.metadata.packages_distributions().get("mooncake", [])


def _select_npu() -> None:
    """Have an NPU current in this process before the client starts, where torch_npu exists.

    Mooncake's NPU build starts its Ascend transport in ``setup`` whatever the
    protocol (tcp too), and that transport asks for the current NPU, which
    vLLM's scheduler process never selects (``device.set_process_npu``).
    Elsewhere nothing is imported: the scheduler half stays without torch.
    """
    if importlib.util.find_spec("torch_npu") is not None:
        from vllm_aio.device.accelerator import set_process_npu

        set_process_npu()


def put_status(code: int) -> Status:
    """The status of one key after a put returned ``code``."""
    if code >= 0:
        return Status.OK
    if code == OBJECT_ALREADY_EXISTS:
        return Status.EXISTS
    if code == NO_AVAILABLE_HANDLE:
        return Status.NO_SPACE
    return Status.ERROR


def get_status(code: int, expected: int) -> Status:
    """The status of one key after a get of ``expected`` bytes returned ``code``."""
    if code >= 0:
        return Status.OK if code == expected else Status.CORRUPT
    if code in _MISSING_CODES:
        return Status.MISSING
    if code == LEASE_EXPIRED:
        return Status.CORRUPT
    return Status.ERROR


NativeCall = Callable[[list[int]], list[int]]  # indices of keys -> one code per index


class MooncakeBackend(Backend):
    """``Backend`` over ``MooncakeDistributedStore`` (see the module docstring)."""

    # One store for every instance of its master. No block_watch: the client
    # API (0.3.13) tells nobody what the master evicts or lets expire.
    event_medium = "MOONCAKE"

    def __init__(
        self,
        settings: MooncakeSettings,
        *,
        value_bytes: int | None = None,
        connect_timeout: float = 3.0,
        rpc_retry_budget: float = 0.3,
        store_factory: Callable[[], Any] | None = None,
        ascend_transport: bool | None = None,
    ) -> None:
        """``ascend_transport``: whether the installed Mooncake build has the Ascend transport
        (None: asked of the installed wheel, ``ascend_transport_built``)."""
        self.settings = settings
        self._value_bytes = value_bytes  # of every value; None: any (see base.distinct_only)
        self._retry_budget = rpc_retry_budget
        self._gate = CallGate("MooncakeBackend")
        self._link = MasterLink(settings.master_server_address, "Mooncake master")
        self._regions = Regions()  # guarded by _reg_lock
        self._reg_lock = threading.Lock()
        self._store = self._setup(store_factory or import_store(), connect_timeout)
        # Retention class 0 is stored plainly; higher classes soft-pinned: the
        # master evicts them only after every unpinned value (for the soft-pin
        # TTL, mooncake_master --default_kv_soft_pin_ttl, 30 min by default).
        self._unpinned, self._pinned = _replicate_configs()
        self._multi = hasattr(self._store, "batch_put_from_multi_buffers")
        # Device memory moves only over the Ascend transport, and only through the batch calls
        # that take addresses as they are: this backend's own staging (``_Staging``) is a host
        # memcpy, never chosen here (``_path`` stages only over tcp or without multi-buffer calls).
        built = ascend_transport_built() if ascend_transport is None else ascend_transport
        self._device_direct = settings.protocol == "ascend" and self._multi and built
        # Mean segment size below which batches are staged (tcp only: RDMA
        # scatter-gather does not pay per segment the way tcp slices do).
        self._stage_below = STAGE_BELOW if settings.protocol == "tcp" else 0
        self._staging: _Staging | None = None
        self._staging_lock = threading.Lock()

    def _setup(self, store_factory: Callable[[], Any], connect_timeout: float) -> Any:
        s = self.settings
        if not tcp_reachable(s.master_server_address, connect_timeout):
            raise MooncakeUnavailableError(
                f"Mooncake master at {s.master_server_address} is unreachable "
                f"(no TCP connection within {connect_timeout:.1f} s); start it or fix master_server_address"
            )
        _select_npu()
        store = store_factory()
        # Like vLLM, name the tenant only when there is one.
        tenant = {} if s.tenant_id == DEFAULT_TENANT_ID else {"tenant_id": s.tenant_id}
        with _env_default(_ENV_SETUP_RETRIES, _SETUP_RETRIES):
            rc = store.setup(
                s.resolved_hostname(), s.metadata_server, s.global_segment_size,
                s.local_buffer_size, s.protocol, s.device_name, s.master_server_address, **tenant,
            )
        if rc != 0:
            raise MooncakeUnavailableError(
                f"Mooncake setup against master {s.master_server_address} failed with code {rc} "
                f"(protocol {s.protocol!r}, metadata_server {s.metadata_server!r}, tenant_id {s.tenant_id!r})"
            )
        return store

    # -- Backend -----------------------------------------------------------

    def register_memory(self, address: int, size: int, memory: Memory = Memory.HOST) -> None:
        """Register a region; one inside a registered region needs nothing.

        Mooncake refuses overlapping registrations, and the contract has no
        unregister: a region that overlaps earlier ones either covers them or
        reuses memory freed since, so it replaces them.
        """
        check_memory(self, memory)
        with self._reg_lock, self._gate.call():
            if self._regions.covers(address, size):
                return
            for span in self._regions.overlapping(address, size):
                self._store.unregister_buffer(span[0])
                self._regions.remove(span)
            rc = self._store.register_buffer(address, size)
            if rc != 0:
                raise RuntimeError(f"Mooncake register_buffer({address:#x}, {size}) failed with code {rc}")
            self._regions.add(address, size, memory)

    def wants_registration(self) -> bool:
        return True

    def segment_memory(self) -> frozenset[Memory]:
        """Host memory; also this process's NPU memory where the store moves it directly (device-direct):
        Mooncake's NPU build, ``protocol: ascend`` and the multi-buffer batch calls. UNVERIFIED on an NPU."""
        return frozenset(Memory) if self._device_direct else frozenset({Memory.HOST})

    def shared_store(self) -> str:
        s = self.settings
        return f"mooncake:{s.master_server_address}:{s.tenant_id}"

    def describe(self) -> str:
        s = self.settings
        return (f"master={s.master_server_address} protocol={s.protocol} metadata_server={s.metadata_server} "
                f"tenant_id={s.tenant_id} global_segment_size={s.global_segment_size / 2**30:.2f}GiB")

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return exists_over(self._call, self._store.batch_is_exist, self._scoped(keys))

    def count_complete_blocks(self, parts: BlockParts, hashes: Sequence[bytes]) -> int:
        """One probe key per block (``remote.count_by_probes``), one round trip per 8,192 blocks."""
        return count_by_probes(self.batch_exists, parts, hashes)

    def lease_blocks(self, parts: BlockParts, hashes: Sequence[bytes], seconds: float) -> None:
        """Asked about, every stored part gets the master's read lease (``--default_kv_lease_ttl``,
        5 s by default; ``seconds`` cannot change it): a lookup probed one part per block only."""
        self.batch_exists([key for h in hashes for key in parts.keys(h)])

    def batch_put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], retention: int = 0) -> list[Status]:
        put = functools.partial(self._put_distinct, config=self._pinned if retention > 0 else self._unpinned)
        return distinct_only(put, self._scoped(keys), segments, self._value_bytes, Status.ERROR)

    def _put_distinct(
        self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], config: Any
    ) -> list[Status]:
        path = self._path(segments)
        if path == "multi":
            codes = self._call(len(keys), lambda idx: self._put_multi(keys, segments, idx, config))
        elif path == "single":
            codes = self._call(len(keys), lambda idx: self._put_single(keys, segments, idx, config))
        else:
            codes = self._call(len(keys), lambda idx: self._staging_for().put(keys, segments, idx, config))
        return [put_status(c) for c in codes]

    def batch_get(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        return distinct_only(self._get_distinct, self._scoped(keys), segments, self._value_bytes, Status.CORRUPT)

    def _get_distinct(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        path = self._path(segments)
        if path == "multi":
            codes = self._call(len(keys), lambda idx: self._get_multi(keys, segments, idx))
        elif path == "single":
            codes = self._call(len(keys), lambda idx: self._get_single(keys, segments, idx))
        else:
            codes = self._call(len(keys), lambda idx: self._staging_for().get(keys, segments, idx))
        expected = [sum(n for _, n in segs) for segs in segments]
        statuses = [get_status(c, e) for c, e in zip(codes, expected)]
        return [
            self._diagnose(keys[i], expected[i]) if c in _AMBIGUOUS_GET_CODES else s
            for i, (c, s) in enumerate(zip(codes, statuses))
        ]

    def _scoped(self, keys: Sequence[str]) -> list[str]:
        """Keys in the tenant's own key space: tenants stay apart on any master,
        including one without --enable_multi_tenants, which shares keys between them."""
        if self.settings.tenant_id == DEFAULT_TENANT_ID:
            return list(keys)
        return [f"{self.settings.tenant_id}/{k}" for k in keys]

    def close(self) -> None:
        """Wait for calls in flight (up to 30 s), then free the client (~1 s)."""
        if self._gate.closed:
            return
        self._gate.close(timeout=30.0)
        self._store.close()

    # -- store calls ---------------------------------------------------------

    def _path(self, segments: Sequence[Sequence[Segment]]) -> str:
        """How to move a batch: "single" (one segment per key), "multi" or "staged".

        Over tcp, a multi-buffer batch of small segments runs at about a third
        of a contiguous batch (each segment is a slice of its own); gathering
        them into one registered buffer first is faster (see
        benchmarks/mooncake_backend.py), so small segments are staged.
        """
        if all(len(s) == 1 for s in segments):
            return "single"
        totals = [total(s) for s in segments]
        count = sum(len(s) for s in segments)
        small = sum(totals) < count * self._stage_below and max(totals) <= STAGING_SIZE
        return "multi" if self._multi and not small else "staged"

    def _put_multi(
        self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], idx: list[int], config: Any
    ) -> list[int]:
        ptrs, sizes = _columns(segments, idx)
        return self._store.batch_put_from_multi_buffers([keys[i] for i in idx], ptrs, sizes, config)

    def _get_multi(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], idx: list[int]) -> list[int]:
        ptrs, sizes = _columns(segments, idx)
        return self._store.batch_get_into_multi_buffers([keys[i] for i in idx], ptrs, sizes)

    def _put_single(
        self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], idx: list[int], config: Any
    ) -> list[int]:
        return self._store.batch_put_from(
            [keys[i] for i in idx], [segments[i][0][0] for i in idx], [segments[i][0][1] for i in idx], config
        )

    def _get_single(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], idx: list[int]) -> list[int]:
        return self._store.batch_get_into(
            [keys[i] for i in idx], [segments[i][0][0] for i in idx], [segments[i][0][1] for i in idx]
        )

    def _staging_for(self) -> _Staging:
        with self._staging_lock:
            if self._staging is None:
                self._staging = _Staging(self, STAGING_SIZE)
            return self._staging

    def _call(self, n: int, call: NativeCall) -> list[int]:
        """Run ``call`` on all ``n`` keys, retrying RPC failures within the budget."""
        self._gate.check_open()
        codes = [RPC_FAIL] * n
        if n == 0 or not self._link.usable():
            return codes
        deadline = time.monotonic() + self._retry_budget
        pending = list(range(n))
        while True:
            with self._gate.call():
                results = call(pending)
            for i, code in zip(pending, results):
                codes[i] = code
            pending = [i for i in pending if codes[i] == RPC_FAIL]
            left = deadline - time.monotonic()
            if not pending or left <= 0 or not self._link.probe(left):
                return codes
            time.sleep(min(0.02, max(left, 0.0)))

    def _diagnose(self, key: str, expected: int) -> Status:
        """Tell a length mismatch (CORRUPT) from a failed transfer (ERROR)."""
        if not self._link.usable():
            return Status.ERROR
        with self._gate.call():
            size = self._store.get_size(key)
        return diagnose(size if size >= 0 else ABSENT if size in _MISSING_CODES else None, expected)


class _Staging:
    """Gather segments into one registered buffer and move it with the single-buffer batch.

    Used when keys have several segments and either they are small (tcp) or
    the store has no ``batch_*_multi_buffers``. One batch at a time; batches
    larger than the buffer go in rounds; a value larger than it fails (-600).
    """

    def __init__(self, backend: MooncakeBackend, size: int) -> None:
        self._store = backend._store
        self._buf = ctypes.create_string_buffer(size)
        self._base = ctypes.addressof(self._buf)
        self._size = size
        self._lock = threading.Lock()
        backend.register_memory(self._base, size)

    def put(
        self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], idx: list[int], config: Any
    ) -> list[int]:
        def transfer(rnd: list[int], offsets: list[int]) -> list[int]:
            for i, off in zip(rnd, offsets):
                gather(segments[i], self._base + off)
            return self._store.batch_put_from(
                [keys[i] for i in rnd], [self._base + o for o in offsets], [total(segments[i]) for i in rnd], config
            )

        return self._rounds(segments, idx, transfer)

    def get(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], idx: list[int]) -> list[int]:
        def transfer(rnd: list[int], offsets: list[int]) -> list[int]:
            sizes = [total(segments[i]) for i in rnd]
            codes = self._store.batch_get_into([keys[i] for i in rnd], [self._base + o for o in offsets], sizes)
            for i, off, size, code in zip(rnd, offsets, sizes, codes):
                if code == size:
                    scatter(self._base + off, segments[i])
            return codes

        return self._rounds(segments, idx, transfer)

    def _rounds(
        self,
        segments: Sequence[Sequence[Segment]],
        idx: list[int],
        transfer: Callable[[list[int], list[int]], list[int]],
    ) -> list[int]:
        codes: dict[int, int] = {}
        with self._lock:
            for rnd, offsets in self._plan(segments, idx, codes):
                codes.update(zip(rnd, transfer(rnd, offsets)))
        return [codes[i] for i in idx]

    def _plan(
        self, segments: Sequence[Sequence[Segment]], idx: list[int], codes: dict[int, int]
    ) -> Iterator[tuple[list[int], list[int]]]:
        rnd: list[int] = []
        offsets: list[int] = []
        used = 0
        for i in idx:
            size = total(segments[i])
            if size > self._size:
                codes[i] = INVALID_PARAMS
                continue
            if used + size > self._size:
                yield rnd, offsets
                rnd, offsets, used = [], [], 0
            rnd.append(i)
            offsets.append(used)
            used += size
        if rnd:
            yield rnd, offsets


def _columns(segments: Sequence[Sequence[Segment]], idx: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    ptrs = [[a for a, _ in segments[i]] for i in idx]
    sizes = [[n for _, n in segments[i]] for i in idx]
    return ptrs, sizes
