"""The Mooncake store as a pooled backend: zero-copy batches over a shared pool.

Why Mooncake: its master hands out space in memory segments that other
processes contribute (a standalone ``mooncake_client`` or engines themselves),
so a pool outlives any one engine and is shared across hosts. Values move
between those segments and our registered KV memory without a staging copy:
``batch_put_from_multi_buffers`` gathers a block's per-layer pieces straight
from the cache and ``batch_get_into_multi_buffers`` scatters them back. Over
tcp each piece costs a transfer slice of its own, so pieces smaller than 32 KiB
on average are gathered into one registered staging buffer instead (2.5x faster
for 8 KiB pieces, measured by benchmarks/mooncake_backend.py).

What this module adds over the raw client, each learned the hard way:

- Settings users of vLLM and vllm-ascend already know: a ``MOONCAKE_CONFIG_PATH``
  file written for their connectors works unchanged. Keys that mean something
  here are honoured (``tenant_id``; ``mode`` decides whether this engine
  contributes memory), theirs that do not are ignored and named in one log
  line, and any other key fails at start: a typo must fail, not silently miss.
- Every return code becomes a typed ``Status``. The codes (``ErrorCode`` in
  Mooncake's ``types.h``; verified against a real master, see the tests):
  0 or a byte count on success; -200 pool full; -600 invalid parameters (also a
  destination smaller than the value); -704 not found; -705 already exists;
  -800 transfer failed (also a destination larger than the value, or the
  memory owner gone); -900 master RPC failed. A put of an existing key returns
  0 and keeps the old value, so it reports ``OK``, not ``EXISTS``.
- Bounded failure. With the master gone, every client call blocks about 4.3 s
  (the C++ RPC pool reconnects three times, one second apart, and exposes no
  setting), and ``setup`` retries for about 90 s. We check the master's TCP
  port before ``setup``, lower the setup retries, retry RPC failures only while
  the port answers and a few hundred ms remain, and after a failure answer
  ERROR at once until a probe sees the master again. (Not covered: a port
  that accepts TCP but is not a master costs ``setup`` 30 s per retry.)
- ``setup`` holds the GIL for its whole duration; the batch calls release it.
- No call reaches the store after ``close`` (the client segfaults then).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from vllm_aio.backends.base import Backend, Segment, Status, distinct_only
from vllm_aio.backends.segments import gather, scatter, total
from vllm_aio.config import ConfigError, parse_size
from vllm_aio.log import get_logger

logger = get_logger(__name__)

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
_ENV_CONFIG_PATH = "MOONCAKE_CONFIG_PATH"
_ENV_OVERRIDES = {"MOONCAKE_MASTER": "master_server_address", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "global_segment_size"}
_ENV_SETUP_RETRIES = "MC_STORE_CLIENT_SETUP_RETRIES"
# Each setup attempt against a dead master costs ~4.4 s: two stay under 10 s.
_SETUP_RETRIES = "2"
_ZERO_SIZE_RE = re.compile(r"^\s*0+(\.0+)?\s*([KMGT]?B?)\s*$", re.IGNORECASE)

DEFAULT_TENANT_ID = "default"  # Mooncake's tenant when none is given
# ``mode`` in vLLM's MooncakeStoreConnector files: whether the engine
# contributes ``global_segment_size`` (embedded) or no memory (standalone-store).
MODES = ("embedded", "standalone-store")
# Keys that files written for vLLM's MooncakeStoreConnector
# (vllm/distributed/mooncake_store.py) or vllm-ascend's AscendStoreConnector
# (ascend_store/backend/mooncake_backend.py, over its versions) may hold and
# that mean nothing to this backend: key -> why it is ignored. ``enable_offload``
# too: vLLM never passes it to setup (it sizes vLLM's own disk staging), and
# passing enable_ssd_offload to an engine's client fails setup (-1300) unless
# the master runs with --enable_offload.
_SSD_TIER = "the SSD tier is the memory owner's: mooncake_client --enable_offload"
_PLACEMENT = "placement hints: puts use Mooncake's default placement"
_IGNORED_FILE_KEYS = {
    "enable_offload": _SSD_TIER,
    "enable_ssd_offload": _SSD_TIER,
    "ssd_offload_path": _SSD_TIER,
    "enable_ssd_prefetch": _SSD_TIER,
    "ssd_prefetch_cooldown_sec": _SSD_TIER,
    "ssd_prefetch_dedup_ttl_sec": _SSD_TIER,
    "ssd_get_wait_ms": _SSD_TIER,
    "alloc_in_same_node": _PLACEMENT,
    "prefer_alloc_in_same_node": _PLACEMENT,
    "preferred_segment": _PLACEMENT,
    "use_ascend_direct": "vllm-ascend's transport switch: protocol chooses the transport",
    "staging_buffer_size": "vllm-ascend's device staging: this backend stages by itself",
}


class MooncakeUnavailableError(RuntimeError):
    """The Mooncake client cannot be imported or the master cannot be reached."""


@dataclass(frozen=True)
class MooncakeSettings:
    # Address ("host:port") of the mooncake_master RPC service. Required.
    master_server_address: str
    # Address other clients reach this one at; empty: the local address that
    # routes to the master (127.0.0.1 for a master on loopback).
    local_hostname: str = ""
    # Where transfer engines find each other; P2PHANDSHAKE needs no server.
    metadata_server: str = "P2PHANDSHAKE"
    # Transfer protocol: "tcp", or "rdma" / "ascend" passed through to Mooncake.
    protocol: str = "tcp"
    # RDMA / Ascend device names ("" lets Mooncake choose).
    device_name: str = ""
    # Bytes this process contributes to the pool (int or "4GB"); 0: none,
    # a standalone memory-owning client holds the pool.
    global_segment_size: int = 0
    # Bytes of the client's own transfer buffer (int or "16MB"); zero-copy
    # batches into registered memory do not use it.
    local_buffer_size: int = 16 << 20
    # Mooncake tenant of every client of this engine (scheduler and workers).
    # Its keys are scoped by it (``_scoped``), so tenants see none of each
    # other's keys on any master; a master started with --enable_multi_tenants
    # and a quota file also enforces quotas (there, puts of a tenant the file
    # does not name fail). Null or blank in a file means "default", as in vLLM.
    tenant_id: str = DEFAULT_TENANT_ID

    def __post_init__(self) -> None:
        for field in ("metadata_server", "protocol", "tenant_id"):
            if not getattr(self, field):
                raise ConfigError(f"{field}: must not be empty")
        _split_address("master_server_address", self.master_server_address)

    @classmethod
    def load(
        cls, inline: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> MooncakeSettings:
        """Settings from the ``MOONCAKE_CONFIG_PATH`` file, then ``inline``, then env overrides."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        mode = None
        if path := environ.get(_ENV_CONFIG_PATH):
            file_values, mode = _read_file(path)
            values.update(file_values)
        values.update(_check_keys(inline or {}, "the inline Mooncake settings"))
        for env, key in _ENV_OVERRIDES.items():
            if env in environ:
                values[key] = environ[env]
        if "master_server_address" not in values:
            raise ConfigError(
                "master_server_address: missing; set it in the JSON file named by "
                f"{_ENV_CONFIG_PATH}, in the inline settings, or with MOONCAKE_MASTER"
            )
        settings = cls(**{key: _coerce(key, value) for key, value in values.items()})
        if mode is not None:
            _check_mode(mode, settings.global_segment_size, f"{_ENV_CONFIG_PATH} file {path}")
        return settings

    def resolved_hostname(self) -> str:
        """``local_hostname``, or the local address that routes to the master."""
        if self.local_hostname:
            return self.local_hostname
        return _route_address(_split_address("master_server_address", self.master_server_address)[0])


_FIELDS = {f.name: f for f in dataclasses.fields(MooncakeSettings)}
_SIZE_FIELDS = {"global_segment_size": True, "local_buffer_size": True}  # name -> zero allowed


def _read_json(path: str) -> Mapping[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{_ENV_CONFIG_PATH}: cannot read Mooncake settings from {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{_ENV_CONFIG_PATH}: {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _read_file(path: str) -> tuple[dict[str, Any], str | None]:
    """A settings file's keys that are fields, and its ``mode``; logs the keys it ignores."""
    where = f"{_ENV_CONFIG_PATH} file {path}"
    data = _check_keys(_read_json(path), where, also_accepted=["mode", *_IGNORED_FILE_KEYS])
    mode = data.get("mode")
    if mode is not None and mode not in MODES:
        raise ConfigError(f"mode: expected one of {', '.join(MODES)}, got {mode!r} in {where}")
    ignored = tuple(sorted(set(data) & set(_IGNORED_FILE_KEYS)))
    if ignored:
        _log_ignored(where, ignored)
    return {key: value for key, value in data.items() if key in _FIELDS}, mode


@functools.cache  # once per process and file: the scheduler and a worker may share one
def _log_ignored(where: str, keys: tuple[str, ...]) -> None:
    by_reason: dict[str, list[str]] = {}
    for key in keys:
        by_reason.setdefault(_IGNORED_FILE_KEYS[key], []).append(key)
    reasons = "; ".join(f"{', '.join(names)} ({why})" for why, names in by_reason.items())
    logger.warning("%s: ignoring keys that mean nothing to vllm_aio: %s", where, reasons)


def _check_mode(mode: str, global_segment_size: int, where: str) -> None:
    """vLLM's rule, which refuses the same files: embedded contributes memory, standalone-store none."""
    if mode == "standalone-store" and global_segment_size:
        raise ConfigError(
            f'mode, global_segment_size: mode "standalone-store" in {where} contributes no memory, but '
            f'global_segment_size is {global_segment_size} bytes; set it to 0, or use mode "embedded"'
        )
    if mode == "embedded" and not global_segment_size:
        raise ConfigError(
            f'mode, global_segment_size: mode "embedded" in {where} contributes global_segment_size bytes, '
            'but it is 0 or missing; give a size such as "4GB", or use mode "standalone-store"'
        )


def _check_keys(
    values: Mapping[str, Any], where: str, also_accepted: Sequence[str] = ()
) -> Mapping[str, Any]:
    accepted = set(_FIELDS) | set(also_accepted)
    unknown = sorted(set(values) - accepted)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(unknown)} in {where}; accepted keys: {', '.join(sorted(accepted))}"
        )
    return values


def _coerce(key: str, value: Any) -> Any:
    if key in _SIZE_FIELDS:
        return _parse_size(key, value, allow_zero=_SIZE_FIELDS[key])
    if key == "tenant_id":
        return _tenant_id(value)
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def _tenant_id(value: Any) -> str:
    """vLLM's rule: null or blank is the default tenant, surrounding blanks are dropped."""
    if value is None:
        return DEFAULT_TENANT_ID
    if not isinstance(value, str) or not value.isprintable():
        raise ConfigError(f"tenant_id: expected a string of printable characters or null, got {value!r}")
    return value.strip() or DEFAULT_TENANT_ID


def _parse_size(key: str, value: Any, allow_zero: bool) -> int:
    """Like ``parse_size``, but 0 (or "0GB") may mean "no memory"."""
    if allow_zero and not isinstance(value, bool):
        if value == 0 or (isinstance(value, str) and _ZERO_SIZE_RE.match(value)):
            return 0
    return parse_size(key, value)


def _split_address(key: str, address: str) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{key}: expected 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def _route_address(host: str) -> str:
    """The local IP the kernel would use to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def tcp_reachable(address: str, timeout: float) -> bool:
    """Whether something accepts TCP connections at ``host:port`` within ``timeout``."""
    host, port = _split_address("master_server_address", address)
    try:
        with socket.create_connection((host, port), timeout=max(timeout, 0.001)):
            return True
    except OSError:
        return False


def _import_store() -> type:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise MooncakeUnavailableError(
            f"the Mooncake backend needs the mooncake package ({e}); install it with {INSTALL_HINT} "
            "(on Debian/Ubuntu it also needs: apt-get install libibverbs1 librdmacm1 libnuma1)"
        ) from e
    return MooncakeDistributedStore


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


class _MasterLink:
    """Whether the master answers, so a dead master costs ERROR, not 4 s a call.

    After an RPC failure the link is down: calls fail at once, and at most one
    TCP probe per ``probe_interval`` checks whether the master came back.
    """

    def __init__(self, address: str, probe_interval: float = 0.5, probe_timeout: float = 0.2) -> None:
        self.address = address
        self._probe_interval = probe_interval
        self._probe_timeout = probe_timeout
        self._lock = threading.Lock()
        self._down = False
        self._last_probe = 0.0

    def usable(self) -> bool:
        with self._lock:
            if not self._down:
                return True
            now = time.monotonic()
            if now - self._last_probe < self._probe_interval:
                return False
            self._last_probe = now
        up = tcp_reachable(self.address, self._probe_timeout)
        with self._lock:
            self._down = not up
        return up

    def probe(self, timeout: float) -> bool:
        """Probe now; mark the link down when the master does not answer."""
        up = tcp_reachable(self.address, min(timeout, self._probe_timeout))
        with self._lock:
            self._down = not up
            self._last_probe = time.monotonic()
        return up


class _CallGate:
    """Counts calls in flight so ``close`` never frees the client under one."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inflight = 0
        self.closed = False

    @contextmanager
    def call(self) -> Iterator[None]:
        with self._cond:
            if self.closed:
                raise RuntimeError("MooncakeBackend is closed")
            self._inflight += 1
        try:
            yield
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def close(self, timeout: float) -> None:
        with self._cond:
            self.closed = True
            self._cond.wait_for(lambda: self._inflight == 0, timeout=timeout)


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


BatchCall = Callable[[list[int]], list[int]]  # indices of keys -> one code per index


class MooncakeBackend(Backend):
    """``Backend`` over ``MooncakeDistributedStore`` (see the module docstring)."""

    def __init__(
        self,
        settings: MooncakeSettings,
        *,
        connect_timeout: float = 3.0,
        rpc_retry_budget: float = 0.3,
        store_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.settings = settings
        self._retry_budget = rpc_retry_budget
        self._gate = _CallGate()
        self._link = _MasterLink(settings.master_server_address)
        self._registered: list[tuple[int, int]] = []
        self._reg_lock = threading.Lock()
        self._store = self._setup(store_factory or _import_store(), connect_timeout)
        self._multi = hasattr(self._store, "batch_put_from_multi_buffers")
        # Mean segment size below which batches are staged (tcp only: RDMA
        # scatter-gather does not pay per segment the way tcp slices do).
        self._stage_below = STAGE_BELOW if settings.protocol == "tcp" else 0
        self._staging: _Staging | None = None
        self._staging_lock = threading.Lock()

    @classmethod
    def from_config(
        cls, inline: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> MooncakeBackend:
        return cls(MooncakeSettings.load(inline, environ))

    def _setup(self, store_factory: Callable[[], Any], connect_timeout: float) -> Any:
        s = self.settings
        if not tcp_reachable(s.master_server_address, connect_timeout):
            raise MooncakeUnavailableError(
                f"Mooncake master at {s.master_server_address} is unreachable "
                f"(no TCP connection within {connect_timeout:.1f} s); start it or fix master_server_address"
            )
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

    def register_memory(self, address: int, size: int) -> None:
        """Register a region; one inside a registered region needs nothing.

        Mooncake refuses overlapping registrations, and the contract has no
        unregister: a region that overlaps earlier ones either covers them or
        reuses memory freed since, so it replaces them.
        """
        with self._reg_lock, self._gate.call():
            if any(a <= address and address + size <= a + n for a, n in self._registered):
                return
            for a, n in [r for r in self._registered if r[0] < address + size and address < r[0] + r[1]]:
                self._store.unregister_buffer(a)
                self._registered.remove((a, n))
            rc = self._store.register_buffer(address, size)
            if rc != 0:
                raise RuntimeError(f"Mooncake register_buffer({address:#x}, {size}) failed with code {rc}")
            self._registered.append((address, size))

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        keys = self._scoped(keys)
        codes = self._call(len(keys), lambda idx: self._store.batch_is_exist([keys[i] for i in idx]))
        return [c == 1 for c in codes]

    def batch_put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        return distinct_only(self._put_distinct, self._scoped(keys), segments)

    def _put_distinct(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        path = self._path(segments)
        if path == "multi":
            codes = self._call(len(keys), lambda idx: self._put_multi(keys, segments, idx))
        elif path == "single":
            codes = self._call(len(keys), lambda idx: self._put_single(keys, segments, idx))
        else:
            codes = self._call(len(keys), lambda idx: self._staging_for().put(keys, segments, idx))
        return [put_status(c) for c in codes]

    def batch_get(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        return distinct_only(self._get_distinct, self._scoped(keys), segments)

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

    def _put_multi(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], idx: list[int]) -> list[int]:
        ptrs, sizes = _columns(segments, idx)
        return self._store.batch_put_from_multi_buffers([keys[i] for i in idx], ptrs, sizes)

    def _get_multi(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], idx: list[int]) -> list[int]:
        ptrs, sizes = _columns(segments, idx)
        return self._store.batch_get_into_multi_buffers([keys[i] for i in idx], ptrs, sizes)

    def _put_single(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], idx: list[int]) -> list[int]:
        return self._store.batch_put_from(
            [keys[i] for i in idx], [segments[i][0][0] for i in idx], [segments[i][0][1] for i in idx]
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

    def _call(self, n: int, call: BatchCall) -> list[int]:
        """Run ``call`` on all ``n`` keys, retrying RPC failures within the budget."""
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
        if size >= 0:
            return Status.CORRUPT if size != expected else Status.ERROR
        return Status.MISSING if size in _MISSING_CODES else Status.ERROR


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

    def put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], idx: list[int]) -> list[int]:
        def transfer(rnd: list[int], offsets: list[int]) -> list[int]:
            for i, off in zip(rnd, offsets):
                gather(segments[i], self._base + off)
            return self._store.batch_put_from(
                [keys[i] for i in rnd], [self._base + o for o in offsets], [total(segments[i]) for i in rnd]
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
