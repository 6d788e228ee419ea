"""Peer-to-peer writes between embedded pools: this process's Mooncake TransferEngine, serving its
pool's slot data, writes ``(local, remote, length)`` spans into slots a target reserved. Spans are
coalesced, batches bounded in descriptors and bytes, deadlines checked before each batch, batches to
one peer serialised. A failed write raises ``TransferError``; its bytes may still land, so a target
must not reuse the slots before the source gave up. What TransferEngine does that shaped this:
``docs/migration.md``, "The transport".
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_aio.backends.mooncake_settings import route_address

# Half the tcp transport's per-peer queue (~2,048): one batch over it breaks
# the link to that peer for the life of the engine. 1,024 ran as fast as 2,048.
MAX_BATCH_DESCRIPTORS = 1024
# How long one batch may run, in bytes: the deadline is checked between batches.
# Batches of this size already reached the largest batches' bandwidth.
MAX_BATCH_BYTES = 64 << 20
# Seconds a batch to a stalled peer may block (TransferEngine's floor; its default is 30).
TRANSFER_TIMEOUT_S = 5
_ENV_TRANSFER_TIMEOUT = "MC_TRANSFER_TIMEOUT"
_METADATA = "P2PHANDSHAKE"  # peers exchange their segment descriptors directly: no metadata server
# Where "" as hostname routes from: the interface of the default route (no packet is sent).
_DEFAULT_ROUTE_PROBE = "8.8.8.8"

Addresses = Sequence[int] | np.ndarray
Spans = tuple[np.ndarray, np.ndarray, np.ndarray]  # local addresses, remote addresses, lengths


class TransferError(RuntimeError):
    """A write did not complete: the peer failed it, or the caller's deadline passed."""


class LinkUnavailableError(RuntimeError):
    """TransferEngine cannot be imported, started, or given the region."""


@dataclass(frozen=True)
class LinkSettings:
    # TransferEngine protocol: "tcp", or "rdma" / "ascend" passed through.
    protocol: str = "tcp"
    # RDMA / NPU device names ("" lets Mooncake choose; nothing for tcp).
    device_name: str = ""
    # Address peers reach this engine at; "" is the address of the interface
    # carrying the default route (127.0.0.1 on a host without one).
    hostname: str = ""

    def __post_init__(self) -> None:
        if not self.protocol:
            raise ValueError("protocol: must not be empty")

    def resolved_hostname(self) -> str:
        return self.hostname or route_address(_DEFAULT_ROUTE_PROBE)


def late_write_bound() -> float:
    """Seconds after the source's deadline that bytes of a batch already sent may still land.

    A batch that failed (a stalled peer) can land when the peer resumes, up
    to the transfer timeout after it started; one more second covers a
    batch's own duration (``MAX_BATCH_BYTES`` over tcp).
    """
    try:
        timeout = float(os.environ.get(_ENV_TRANSFER_TIMEOUT, TRANSFER_TIMEOUT_S))
    except ValueError:
        timeout = TRANSFER_TIMEOUT_S
    return max(timeout, TRANSFER_TIMEOUT_S) + 1.0


def coalesce(local: Addresses, remote: Addresses, lengths: Addresses) -> Spans:
    """The spans with each one whose local and remote addresses both continue the previous span merged into it."""
    loc, rem, size = _as_spans(local, remote, lengths)
    if len(size) == 0:
        return loc, rem, size
    continues = (loc[1:] == loc[:-1] + size[:-1]) & (rem[1:] == rem[:-1] + size[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return loc[starts], rem[starts], np.add.reduceat(size, starts)


def plan_batches(
    local: Addresses, remote: Addresses, lengths: Addresses,
    max_descriptors: int = MAX_BATCH_DESCRIPTORS, max_bytes: int = MAX_BATCH_BYTES,
) -> list[Spans]:
    """The spans coalesced, cut to at most ``max_bytes`` each, in batches of at most
    ``max_descriptors`` descriptors and ``max_bytes`` bytes, in order."""
    loc, rem, size = _split_long(*coalesce(local, remote, lengths), max_bytes)
    ends = np.cumsum(size)
    batches, start = [], 0
    while start < len(size):
        before = int(ends[start - 1]) if start else 0
        # Every descriptor fits in max_bytes, so at least the first one is taken.
        stop = min(int(np.searchsorted(ends, before + max_bytes, side="right")), start + max_descriptors)
        batches.append((loc[start:stop], rem[start:stop], size[start:stop]))
        start = stop
    return batches


def _as_spans(local: Addresses, remote: Addresses, lengths: Addresses) -> Spans:
    loc, rem, size = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (local, remote, lengths))
    if not len(loc) == len(rem) == len(size):
        raise ValueError(f"spans: {len(loc)} local addresses, {len(rem)} remote, {len(size)} lengths")
    if len(size) and int(size.min()) <= 0:
        raise ValueError(f"spans: lengths must be positive, got {int(size.min())}")
    return loc, rem, size


def _split_long(loc: np.ndarray, rem: np.ndarray, size: np.ndarray, max_bytes: int) -> Spans:
    """Descriptors longer than ``max_bytes`` cut into pieces of ``max_bytes`` (the last one shorter)."""
    pieces = -(-size // max_bytes)
    if len(size) == 0 or int(pieces.max()) == 1:
        return loc, rem, size
    owner = np.repeat(np.arange(len(size)), pieces)
    first_piece = np.cumsum(pieces) - pieces
    offset = (np.arange(len(owner)) - first_piece[owner]) * max_bytes
    return loc[owner] + offset, rem[owner] + offset, np.minimum(size[owner] - offset, max_bytes)


def _import_engine() -> type:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise LinkUnavailableError(
            f"KV migration needs Mooncake's TransferEngine ({e}): pip install mooncake-transfer-engine "
            "(mooncake-transfer-engine-non-cuda on hosts without CUDA, as pip install 'vllm_aio[mooncake]' "
            "does; on Debian/Ubuntu also apt-get install libibverbs1 librdmacm1 libnuma1)"
        ) from e
    return TransferEngine


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


class PeerLink:
    """This process's TransferEngine with ``region`` (address, bytes) registered (see the module docstring)."""

    def __init__(self, settings: LinkSettings, region: tuple[int, int]) -> None:
        self.settings = settings
        self.region = region
        hostname = settings.resolved_hostname()
        self._engine: Any = self._start(_import_engine(), settings, hostname)
        self._session_id = f"{hostname}:{self._engine.get_rpc_port()}"
        rc = self._engine.register_memory(*region)
        if rc != 0:
            raise LinkUnavailableError(
                f"TransferEngine refused to register {_mib(region[1])} at {region[0]:#x} (rc={rc})"
            )
        self._state = threading.Condition()  # guards _closed, _in_flight and _peer_locks
        self._closed = False
        self._in_flight = 0
        self._peer_locks: dict[str, threading.Lock] = {}

    @staticmethod
    def _start(engine_type: type, settings: LinkSettings, hostname: str) -> Any:
        # The transfer timeout is read when the engine is built; the user's own setting wins.
        user_timeout = _ENV_TRANSFER_TIMEOUT in os.environ
        if not user_timeout:
            os.environ[_ENV_TRANSFER_TIMEOUT] = str(TRANSFER_TIMEOUT_S)
        try:
            engine = engine_type()
        finally:
            if not user_timeout:
                del os.environ[_ENV_TRANSFER_TIMEOUT]
        rc = engine.initialize(hostname, _METADATA, settings.protocol, settings.device_name)
        if rc != 0:
            raise LinkUnavailableError(
                f"TransferEngine.initialize({hostname!r}, {_METADATA!r}, {settings.protocol!r}, "
                f"{settings.device_name!r}) failed (rc={rc})"
            )
        return engine

    @property
    def session_id(self) -> str:
        """What a peer passes to ``write`` to reach this engine: ``host:rpc_port``."""
        return self._session_id

    def write(self, session_id: str, local: Addresses, remote: Addresses, lengths: Addresses,
              deadline: float) -> int:
        """Write each span's ``length`` bytes at ``local`` (in this region) to ``remote`` in the
        peer's registered memory; returns the bytes written.

        ``deadline`` is a ``time.monotonic()`` value: no batch starts after it.
        Raises ``TransferError`` when a batch fails or the deadline passes
        (the peer then holds some of the bytes), ``ValueError`` for spans
        outside this region.
        """
        batches = plan_batches(local, remote, lengths)
        self._check_local(batches)
        total = sum(int(size.sum()) for _, _, size in batches)
        written = 0
        with self._batches_to(session_id) as peer_lock:
            for number, (loc, rem, size) in enumerate(batches, 1):
                where = f"batch {number} of {len(batches)}, {len(size)} spans, {_mib(int(size.sum()))}"
                with peer_lock:
                    if time.monotonic() >= deadline:
                        raise TransferError(
                            f"write to {session_id} stopped at its deadline before {where}; "
                            f"{_mib(written)} of {_mib(total)} written"
                        )
                    rc = self._engine.batch_transfer_sync_write(session_id, loc.tolist(), rem.tolist(), size.tolist())
                if rc != 0:
                    raise TransferError(
                        f"write to {session_id} failed (rc={rc}) at {where}; {_mib(written)} of {_mib(total)} "
                        "written before it"
                    )
                written += int(size.sum())
        return written

    def _check_local(self, batches: list[Spans]) -> None:
        """Refuse spans outside the registered region (a stray address would be read from as is)."""
        if not batches:
            return
        start, length = self.region
        low = min(int(loc.min()) for loc, _, _ in batches)
        high = max(int((loc + size).max()) for loc, _, size in batches)
        if low < start or high > start + length:
            raise ValueError(
                f"spans [{low:#x}, {high:#x}) reach outside the registered region "
                f"[{start:#x}, {start + length:#x})"
            )

    @contextmanager
    def _batches_to(self, session_id: str) -> Iterator[threading.Lock]:
        """Counts the write in flight (``close`` waits for it) and yields the peer's batch lock."""
        with self._state:
            if self._closed:
                raise TransferError(f"write to {session_id}: this PeerLink is closed")
            self._in_flight += 1
            lock = self._peer_locks.setdefault(session_id, threading.Lock())
        try:
            yield lock
        finally:
            with self._state:
                self._in_flight -= 1
                self._state.notify_all()

    def close(self) -> None:
        """Wait for writes in flight, unregister the region and release the engine (~1 s). Idempotent."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            self._state.wait_for(lambda: self._in_flight == 0)
        self._engine.unregister_memory(self.region[0])
        self._engine = None  # its destructor joins the engine's threads and frees its port
