"""The migration protocol's operations, served in the engine-core process next to the scheduler half.

Why here: what the operations need lives in this process only: the pool
(reservations, pins, lookups), the scheduler half (running requests to flush,
the current key namespace) and vLLM's block hash function with its seed. The
instance's OpenAI server forwards ``POST /v1/kv_migration/{op}`` here over a
unix socket (``endpoints.py``, ``channel.py``).

Operations (JSON objects in and out; ``token_ids`` always names the request:
prompt + tokens generated so far):

========================  =============================================================
``session``               what a peer must know: namespace (weight version included),
                          block size, value size, hash seed fingerprint, shared store,
                          TransferEngine session and the pool's slot base address
``extra_size``            full blocks of ``token_ids`` already here and lacking
``allocate``              (target) reserve slots for the lacking blocks
``flush``                 (source) have every full block of the running request stored
``transfer``              (source) write the blocks into the target's reserved slots
``commit``                (target) publish what landed, in prefix order; idempotent
``abort``                 (target) give a reservation up
``weight_version``        key everything under another weight version from now on
``status``                reservations and pool slots in use
========================  =============================================================

Errors are 4xx answers naming the problem (``MigrationRefused``); the
channel turns any other exception into a 500 with one log line.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from vllm_aio.backends.base import Backend
from vllm_aio.config import AioConfig
from vllm_aio.log import get_logger
from vllm_aio.migration import source
from vllm_aio.migration.flushes import FlushRequests
from vllm_aio.migration.prefix import PrefixHasher
from vllm_aio.migration.target import MigrationRefused, MigrationTarget
from vllm_aio.migration.transport import LinkSettings, LinkUnavailableError, PeerLink, TransferError, late_write_bound
from vllm_aio.pool.entry import HASH_PREFIX_BYTES, HEADER_BYTES, EntryHeader
from vllm_aio.pool.keys import parse_block_key
from vllm_aio.shared.deployment import Deployment
from vllm_aio.shared.keying import PoolKeying

logger = get_logger(__name__)

# A request of more tokens than this is refused (a 1M-token context is 16x less).
MAX_TOKENS = 16 << 20
_VERSION_CHARS = 128


class MigrationControl:
    def __init__(self, keying: PoolKeying, flushes: FlushRequests, backend: Backend, deployment: Deployment,
                 cfg: AioConfig, hasher: PrefixHasher, role: str) -> None:
        self._keying = keying  # the scheduler half's: the namespace its lookups and the workers' saves use
        self._flushes = flushes
        self._backend = backend
        self._dep = deployment
        self._cfg = cfg
        self._hasher = hasher
        self._role = role
        self._store = backend.slots()
        self._target = None
        if self._store is not None:
            self._target = MigrationTarget(self._store, cfg.migration_watchdog_timeout, late_write_bound())
        self._link: PeerLink | None = None  # the TransferEngine, opened by the first call that needs it
        self._ops: dict[str, Callable[[Mapping[str, Any]], dict]] = {
            "session": self.session, "extra_size": self.extra_size, "allocate": self.allocate,
            "flush": self.flush, "transfer": self.transfer, "commit": self.commit, "abort": self.abort,
            "weight_version": self.weight_version, "status": self.status,
        }

    def handle(self, op: str, body: Mapping[str, Any]) -> tuple[int, dict]:
        fn = self._ops.get(op)
        if fn is None:
            return 404, {"error": f"unknown operation {op!r}; operations: {', '.join(self._ops)}"}
        try:
            return 200, fn(body)
        except MigrationRefused as exc:
            logger.info("vllm_aio: migration %s refused (%d): %s", op, exc.status, exc)
            return exc.status, {"error": str(exc)}

    # ---- what a peer must know -------------------------------------------------
    def session(self, body: Mapping[str, Any]) -> dict:
        _fields(body, set())
        parts = self._keying.parts
        info = {
            "namespace": parts.namespace_digest,
            "weight_version": self._keying.namespace.weight_version,
            "model": self._dep.namespace.model,
            "block_size": self._dep.block_size,
            "value_bytes": self._dep.value_bytes,
            "hash_seed": self._hasher.fingerprint(),
            "shared_store": self._backend.shared_store(),
            "role": self._role,
            "watchdog_timeout_s": self._cfg.migration_watchdog_timeout,
            "parts": len(parts.shards) * len(parts.tags),
        }
        if self._store is not None:
            link = self._peer_link()
            info.update(session_id=link.session_id, slot_base=self._store.region()[0], slot_size=self._store.slot_size)
        return info

    def extra_size(self, body: Mapping[str, Any]) -> dict:
        _fields(body, {"token_ids"})
        tokens = _token_ids(body)
        hashes = self._hasher.hashes(tokens)
        have = self._present(hashes)
        bs = self._dep.block_size
        return {
            "total_tokens": len(tokens),
            "full_blocks": len(hashes),
            "matched_blocks": have,
            "lacking_blocks": len(hashes) - have,
            "matched_tokens": have * bs,
            "extra_tokens": len(tokens) - have * bs,
        }

    # ---- target ----------------------------------------------------------------
    def allocate(self, body: Mapping[str, Any]) -> dict:
        _fields(body, {"token_ids", "namespace", "hash_seed", "shared_store"}, {"migration_id"})
        tokens = _token_ids(body)
        self._check_peer(body)
        hashes = self._hasher.hashes(tokens)
        first = self._present(hashes)
        shared = body["shared_store"] is not None and body["shared_store"] == self._backend.shared_store()
        migration_id = _optional_str(body, "migration_id")
        if shared or self._target is None:
            if not shared:
                raise MigrationRefused(
                    409, f"this instance's store ({self._cfg.backend}) takes no peer writes and the source "
                    f"does not share it (source {body['shared_store']!r}, here {self._backend.shared_store()!r})"
                )
            # One store: after the source's flush every block is there already; nothing to reserve.
            return {"migration_id": migration_id or "shared", "first_block": first, "slots": [], "shared": True,
                    "deadline_s": self._cfg.migration_watchdog_timeout / 2}
        lacking = hashes[first:]
        keys = [self._keying.parts.keys(h) for h in lacking]
        headers = [[self._header(k) for k in block] for block in keys]
        res = self._target.allocate(migration_id, first, keys, headers)
        remaining = max(0.0, res.expires - time.monotonic())
        return {"migration_id": res.migration_id, "first_block": res.first_block, "slots": res.slots,
                "shared": False, "deadline_s": remaining / 2}

    def commit(self, body: Mapping[str, Any]) -> dict:
        _fields(body, {"migration_id", "token_ids"})
        tokens = _token_ids(body)
        migration_id = _str(body, "migration_id")
        answer = {"migration_id": migration_id}
        if self._target is not None and migration_id != "shared":
            answer = dict(self._target.commit(migration_id, HEADER_BYTES))
        have = self._present(self._hasher.hashes(tokens))
        answer.update(matched_blocks=have, matched_tokens=have * self._dep.block_size)
        return answer

    def abort(self, body: Mapping[str, Any]) -> dict:
        _fields(body, {"migration_id"})
        if self._target is None:
            raise MigrationRefused(404, "this instance holds no reservations (its store takes no peer writes)")
        return self._target.abort(_str(body, "migration_id"))

    # ---- source ----------------------------------------------------------------
    def flush(self, body: Mapping[str, Any]) -> dict:
        _fields(body, {"token_ids"}, {"timeout_s"})
        if not self._dep.save_enabled:
            raise MigrationRefused(409, f"this instance stores no KV (kv_role={self._role}): it cannot be a source")
        hashes = self._hasher.hashes(_token_ids(body))
        timeout = _seconds(body, "timeout_s", default=self._cfg.transfer_timeout)
        blocks = source.flush(self._flushes, self._backend, self._keying.parts, hashes, time.monotonic() + timeout)
        return {"blocks": blocks}

    def transfer(self, body: Mapping[str, Any]) -> dict:
        _fields(body, {"token_ids", "first_block", "slots", "target", "deadline_s"})
        if self._store is None:
            raise MigrationRefused(409, f"this instance's store ({self._cfg.backend}) has no slots to send from")
        deadline = time.monotonic() + _seconds(body, "deadline_s")
        target = body["target"]
        if not isinstance(target, Mapping):
            raise MigrationRefused(400, "target: expected the target's session object")
        self._check_peer(target, value_size=True)
        hashes = self._hasher.hashes(_token_ids(body))
        first = _int(body, "first_block", 0, len(hashes))
        slots = _slots(body, len(hashes) - first, len(self._keying.parts.keys(b"")))
        local, remote, pinned, versions = source.spans(
            self._store, self._keying.parts, hashes[first:], slots, _int(target, "slot_base", 0, 1 << 62)
        )
        started = time.monotonic()
        try:
            sent = self._peer_link().write(_str(target, "session_id"), local, remote,
                                           [self._store.slot_size] * len(local), deadline)
        except TransferError as exc:
            raise MigrationRefused(502, f"writing to the target failed: {exc}") from None
        if not self._store.unchanged(pinned, versions).all():
            raise MigrationRefused(409, "source values were evicted while being sent; retry the migration")
        return {"bytes": sent, "values": len(local), "seconds": time.monotonic() - started}

    # ---- runtime settings --------------------------------------------------------
    def weight_version(self, body: Mapping[str, Any]) -> dict:
        _fields(body, {"weight_version"})
        version = _str(body, "weight_version")
        if len(version) > _VERSION_CHARS:
            raise MigrationRefused(400, f"weight_version: at most {_VERSION_CHARS} characters")
        old = self._keying.namespace.weight_version
        self._keying.set_weight_version(version)
        logger.info("vllm_aio: weight version %r -> %r: keys now in namespace %s", old, version,
                    self._keying.parts.namespace_digest)
        return {"weight_version": version, "namespace": self._keying.parts.namespace_digest}

    def status(self, body: Mapping[str, Any]) -> dict:
        _fields(body, set())
        out: dict[str, Any] = {"namespace": self._keying.parts.namespace_digest}
        if self._target is not None:
            out.update(self._target.status(), writing_slots=self._store.writing_slots(),
                       pool_slots=self._store.region()[1] // self._store.slot_size)
        return out

    # ---- helpers ---------------------------------------------------------------
    def _present(self, hashes: list[bytes]) -> int:
        return self._backend.count_complete_blocks(self._keying.parts, hashes) if hashes else 0

    def _header(self, key: str) -> bytes:
        digest, shard, tag, block_hash = parse_block_key(key)
        header = EntryHeader(digest, shard, -1 if tag is None else tag, self._dep.block_size,
                             self._dep.value_bytes - HEADER_BYTES)
        return header.pack(block_hash[:HASH_PREFIX_BYTES].ljust(HASH_PREFIX_BYTES, b"\0"))

    def _check_peer(self, peer: Mapping[str, Any], value_size: bool = False) -> None:
        """The peer keys its blocks exactly as this instance does, or nothing moves."""
        mine = self._keying.parts.namespace_digest
        if _str(peer, "namespace") != mine:
            raise MigrationRefused(
                409, f"namespace mismatch: the peer keys blocks under {peer['namespace']} and this instance under "
                f"{mine} (weight version {self._keying.namespace.weight_version!r}); model, dtype, block size, "
                "parallel shape, salt and weight version must all be equal"
            )
        if "hash_seed" in peer and _str(peer, "hash_seed") != self._hasher.fingerprint():
            raise MigrationRefused(409, "block hash seed mismatch: give both instances the same PYTHONHASHSEED")
        if value_size and _int(peer, "slot_size", 1, 1 << 40) != self._store.slot_size:
            raise MigrationRefused(409, f"slot size mismatch: peer {peer['slot_size']}, here {self._store.slot_size}")

    def _peer_link(self) -> PeerLink:
        if self._link is None:
            settings = LinkSettings(self._cfg.migration_protocol, self._cfg.migration_device_name,
                                    self._cfg.migration_hostname)
            try:
                self._link = PeerLink(settings, self._store.region())
            except LinkUnavailableError as exc:
                raise MigrationRefused(503, f"this instance cannot send or receive migrations: {exc}") from None
        return self._link

    def close(self) -> None:
        if self._target is not None:
            self._target.close()
        if self._link is not None:
            self._link.close()


# ---- body validation: each problem is a 400 naming the field --------------------
def _fields(body: Mapping[str, Any], required: set[str], optional: set[str] = frozenset()) -> None:
    missing = sorted(required - set(body))
    unknown = sorted(set(body) - required - set(optional))
    if missing or unknown:
        what = "; ".join(filter(None, [missing and f"missing {', '.join(missing)}",
                                       unknown and f"unknown {', '.join(unknown)}"]))
        raise MigrationRefused(400, f"{what} (expected {', '.join(sorted(required | set(optional))) or 'an empty object'})")


def _token_ids(body: Mapping[str, Any]) -> list[int]:
    tokens = body["token_ids"]
    if not isinstance(tokens, list) or not tokens:
        raise MigrationRefused(400, "token_ids: expected a non-empty list of token ids")
    if len(tokens) > MAX_TOKENS:
        raise MigrationRefused(413, f"token_ids: {len(tokens)} tokens; at most {MAX_TOKENS}")
    if not all(type(t) is int and 0 <= t < 1 << 31 for t in tokens):
        raise MigrationRefused(400, "token_ids: expected integers in [0, 2**31)")
    return tokens


def _str(body: Mapping[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or len(value) > 256:
        raise MigrationRefused(400, f"{key}: expected a string of at most 256 characters")
    return value


def _optional_str(body: Mapping[str, Any], key: str) -> str | None:
    return None if body.get(key) is None else _str(body, key)


def _int(body: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    value = body.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise MigrationRefused(400, f"{key}: expected an integer in [{lo}, {hi}]")
    return value


def _seconds(body: Mapping[str, Any], key: str, default: float | None = None) -> float:
    value = body.get(key, default)
    if type(value) not in (int, float) or not 0 < value <= 3600:
        raise MigrationRefused(400, f"{key}: expected seconds in (0, 3600]")
    return float(value)


def _slots(body: Mapping[str, Any], blocks: int, parts: int) -> list[list[int]]:
    slots = body["slots"]
    if (not isinstance(slots, list) or len(slots) != blocks
            or not all(isinstance(b, list) and len(b) == parts and all(type(s) is int and s >= -1 for s in b)
                       for b in slots)):
        raise MigrationRefused(400, f"slots: expected {blocks} lists of {parts} slot numbers (-1: present)")
    return slots
