"""KV cache events for the pool: which blocks a KV-aware router may find in it.

vLLM publishes ``BlockStored`` / ``BlockRemoved`` events (``--kv-events-config``)
so a router can send a request to the instance that holds its prefix; this
module decides the pool's, on the scheduler side, in plain Python (the facade
turns them into vLLM's event types: ``vllm_events.py``). Nothing here runs
unless the user enabled KV cache events.

Stored. A block counts as stored once every part of it (every shard, every
layer unit) is in the pool. Several ranks store a block's parts, each its own
shard (replicas split the blocks, ``pool/ownership.py``), and each reports the
parts it settled (``SavedParts``, in the step's connector output). The
scheduler, a single process, collects the shards per block and announces the
block once, when the last shard arrives: a router sees one ``BlockStored`` per
block however many ranks stored it. The event's payload (tokens, parent hash,
LoRA) is taken from the request when its save is planned (``expect``), because
the request may have finished by the time the parts are reported. Reports
travel with steps (vLLM's connector output), so a save that settles after an
engine's last step is announced at its next step.

Removed. Where the store can watch blocks (``Backend.block_watch``: the
embedded pool's eviction log, read in this process whichever process evicted),
an announced block whose part leaves is reported removed. Elsewhere (Mooncake,
Memcache: their clients never say what was evicted) a block is reported removed
only when a lookup finds an announced block incomplete (``missing``).
Announcements of such stores are remembered up to ``_REMOTE_ANNOUNCED`` blocks,
the oldest forgotten silently beyond that.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_aio.pool.keys import BlockParts

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from vllm_aio.backends.base import BlockWatch

# Blocks announced to a store that cannot watch them: about 30 MB of hashes.
_REMOTE_ANNOUNCED = 1 << 18


def kv_events_on(vllm_config: Any, save_enabled: bool) -> bool:
    """vLLM's KV cache events asked for (``--kv-events-config``), where this instance saves: only an
    instance that saves has pool blocks to announce."""
    events_config = vllm_config.kv_events_config
    return bool(events_config and events_config.enable_kv_cache_events) and save_enabled


@dataclass
class SavedParts:
    """What one rank settled of its saves since its last report (worker -> scheduler).

    Hashes are concatenated (vLLM's all have one size), as in the step
    metadata. ``stored``: blocks whose every unit this rank saved is in the
    pool (put now, or there already); ``failed``: blocks it could not store.
    """

    shard: str
    hash_size: int
    stored: bytes = b""
    failed: bytes = b""

    @staticmethod
    def split(joined: bytes, size: int) -> list[bytes]:
        return [joined[i : i + size] for i in range(0, len(joined), size)]


class SettledSaves:
    """A rank's settled saves, added on its sending thread and taken once per step (worker side)."""

    def __init__(self, shard: str) -> None:
        self._shard = shard
        self._lock = threading.Lock()
        self._stored: list[bytes] = []
        self._failed: list[bytes] = []

    def add(self, hashes: Sequence[bytes], stored: Sequence[bool]) -> None:
        with self._lock:
            for block_hash, ok in zip(hashes, stored):
                (self._stored if ok else self._failed).append(block_hash)

    def take(self) -> SavedParts | None:
        with self._lock:
            if not (self._stored or self._failed):
                return None
            stored, failed = self._stored, self._failed
            self._stored, self._failed = [], []
        size = len((stored or failed)[0])
        return SavedParts(self._shard, size, b"".join(stored), b"".join(failed))


@dataclass
class Stored:
    """Consecutive blocks of one prefix now complete in the pool (vLLM's ``BlockStored``)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    lora_name: str | None


@dataclass
class Removed:
    """Announced blocks no longer complete in the pool (vLLM's ``BlockRemoved``)."""

    block_hashes: list[bytes]


@dataclass
class _Pending:
    """A block handed to saves, waiting for every shard's part."""

    event: Stored  # of this one block
    deadline: float
    shards: set[str] = field(default_factory=set)


class KVEvents:
    """The pool's KV events of one instance: fed by the scheduler half, taken once per step."""

    def __init__(self, block_size: int, watch: "BlockWatch | None", timeout: float) -> None:
        self._block_size = block_size
        self._watch = watch
        # A save abandoned past transfer_timeout never reports: forget it after twice that.
        self._timeout = 2 * timeout
        self._pending: dict[bytes, _Pending] = {}  # block hash -> its save, in planning order
        self._confirmed: list[bytes] = []  # every shard reported; announced at the next take
        self._remote: OrderedDict[bytes, None] = OrderedDict()  # announced, without a watch
        self._removed: list[bytes] = []  # found missing by lookups, without a watch
        self._digest: str | None = None  # the namespace announced blocks are keyed under

    def expect(self, request: "Request", first: int, end: int) -> None:
        """Blocks [first, end) of ``request`` were handed to saves this step."""
        bs, hashes, tokens = self._block_size, request.block_hashes, request.all_token_ids
        lora = request.lora_request
        deadline = time.monotonic() + self._timeout
        for i in range(first, end):
            if hashes[i] in self._pending:
                continue  # another request saves the same block
            event = Stored(
                [hashes[i]], hashes[i - 1] if i else None, list(tokens[i * bs : (i + 1) * bs]), bs,
                lora.adapter_id if lora else None, lora.name if lora else None,
            )
            self._pending[hashes[i]] = _Pending(event, deadline)

    def saved(self, reports: Iterable[SavedParts], parts: BlockParts) -> None:
        """Ranks' settled saves (vLLM's ``update_connector_output``)."""
        for report in reports:
            for block_hash in SavedParts.split(report.failed, report.hash_size):
                self._pending.pop(block_hash, None)
            for block_hash in SavedParts.split(report.stored, report.hash_size):
                pending = self._pending.get(block_hash)
                if pending is None:
                    continue
                pending.shards.add(report.shard)
                if pending.shards.issuperset(parts.shards):
                    self._confirmed.append(block_hash)

    def missing(self, block_hash: bytes) -> None:
        """A lookup found this block incomplete (stores without a watch)."""
        if self._watch is None and block_hash in self._remote:
            del self._remote[block_hash]
            self._removed.append(block_hash)

    def take(self, parts: BlockParts) -> list[Stored | Removed]:
        """The events since the last call (vLLM's ``take_events``, once per step)."""
        removed = self._namespace_changed(parts.namespace_digest)
        stored = self._announce(parts)
        removed += self._watch.take_gone() if self._watch is not None else self._removed
        self._removed = []
        self._expire()
        events: list[Stored | Removed] = list(_runs(stored))
        if removed:
            events.append(Removed(removed))
        return events

    def _namespace_changed(self, digest: str) -> list[bytes]:
        """Blocks of another weight version never hit again: every announced one is removed."""
        if self._digest == digest:
            return []
        self._digest = digest
        if self._watch is not None:
            return self._watch.clear()
        gone, self._remote = list(self._remote), OrderedDict()
        return gone

    def _announce(self, parts: BlockParts) -> list[Stored]:
        """The confirmed blocks not announced before; with a watch, only those complete now."""
        confirmed, self._confirmed = self._confirmed, []
        pending = [self._pending.pop(h) for h in confirmed if h in self._pending]
        if not pending:  # most steps: no pool lock taken
            return []
        if self._watch is not None:
            fresh = set(self._watch.add(parts, [p.event.block_hashes[0] for p in pending]))
            return [p.event for p in pending if p.event.block_hashes[0] in fresh]
        out = []
        for p in pending:
            block_hash = p.event.block_hashes[0]
            if block_hash not in self._remote:
                out.append(p.event)
            self._remote[block_hash] = None
            self._remote.move_to_end(block_hash)
        while len(self._remote) > _REMOTE_ANNOUNCED:
            self._remote.popitem(last=False)
        return out

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            block_hash, oldest = next(iter(self._pending.items()))
            if oldest.deadline > now:
                return
            del self._pending[block_hash]


def _runs(blocks: Sequence[Stored]) -> list[Stored]:
    """One event per run of blocks that chain (each one's parent the previous one), as vLLM's own."""
    out: list[Stored] = []
    for b in blocks:
        last = out[-1] if out else None
        if last is not None and b.parent_block_hash == last.block_hashes[-1] and b.lora_name == last.lora_name:
            last.block_hashes += b.block_hashes
            last.token_ids += b.token_ids
        else:
            out.append(Stored(list(b.block_hashes), b.parent_block_hash, list(b.token_ids), b.block_size,
                              b.lora_id, b.lora_name))
    return out
