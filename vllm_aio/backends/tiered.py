"""The tiered store: the embedded host pool (local tier) in front of Mooncake or Memcache (remote
tier). Lookups span both tiers, loads read the local tier first and promote remote hits into it,
saves go to the local tier at once and to the remote tier in the background (a bounded queue) or
write-through; a remote failure is a miss or a counted drop, never the local tier's. No ``slots()``:
values take the staged path. What is guaranteed: ``docs/backends.md``, "Inside the tiered store".
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import TypeVar

from vllm_aio.backends.base import Backend, Memory, Status, check_memory, distinct_only
from vllm_aio.device.segment import Segment
from vllm_aio.log import get_logger
from vllm_aio.pool.keys import BlockParts

logger = get_logger(__name__)

T = TypeVar("T")

_BOUNCE_BYTES = 32 << 20  # the background writer's buffer: values per remote put batch
_CLOSE_TIMEOUT = 10.0  # seconds close waits for queued background writes


class TieredBackend(Backend):
    """``local`` (the embedded pool) in front of ``remote`` (see the module docstring)."""

    def __init__(self, local: Backend, remote: Backend, value_bytes: int, remote_title: str, *,
                 write_through: bool, queue_size: int) -> None:
        self.local = local
        self.remote = remote
        self._value_bytes = value_bytes
        self._remote_title = remote_title
        self._write_through = write_through
        self._queue_size = queue_size
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()  # guarded by _lock, as _writer and _warned
        # Made by the first background save: only workers save, and only they
        # register its buffer with the remote tier.
        self._writer: _RemoteWriter | None = None
        self._warned: set[str] = set()

    # -- lookups ---------------------------------------------------------------

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        present = self.local.batch_exists(keys)
        rest = [i for i, p in enumerate(present) if not p]
        if rest:
            found = self._remote_or("lookup", [False] * len(rest),
                                    lambda: self.remote.batch_exists([keys[i] for i in rest]))
            for i, p in zip(rest, found):
                present[i] = p
        return present

    def count_complete_blocks(self, parts: BlockParts, hashes: Sequence[bytes]) -> int:
        """Leading blocks complete in either tier: the local run, then the remote run after it, and so on."""
        n = 0
        while n < len(hashes):
            n += self.local.count_complete_blocks(parts, hashes[n:])
            if n == len(hashes):
                break
            start = n
            more = self._remote_or("lookup", 0, lambda: self.remote.count_complete_blocks(parts, hashes[start:]))
            if not more:  # block n is in neither tier
                break
            n += more
        return n

    def lease_blocks(self, parts: BlockParts, hashes: Sequence[bytes], seconds: float) -> None:
        """Both tiers: a load reads the local tier first and the rest from the remote one."""
        self.local.lease_blocks(parts, hashes, seconds)
        self._remote_or("lease", None, lambda: self.remote.lease_blocks(parts, hashes, seconds))

    def presence_epoch(self) -> int | None:
        """Both tiers' epochs summed (each only grows, so the sum moves when either does);
        None when either tier has none: an answer about it holds only when given."""
        remote = self._remote_or("lookup", None, self.remote.presence_epoch)
        local = self.local.presence_epoch()
        return None if remote is None or local is None else local + remote

    # -- loads and saves --------------------------------------------------------

    def batch_get(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        # A repeat is answered here: the tier asked second would see it alone and run it.
        return distinct_only(self._get_distinct, keys, segments)

    def _get_distinct(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[Status]:
        statuses = self.local.batch_get(keys, segments)
        rest = [i for i, s in enumerate(statuses) if s is not Status.OK]
        hits = len(keys) - len(rest)
        promoted: list[int] = []
        if rest:
            got = self._remote_or("load", [Status.ERROR] * len(rest), lambda: self.remote.batch_get(
                [keys[i] for i in rest], [segments[i] for i in rest]))
            for i, status in zip(rest, got):
                if status is Status.OK:
                    promoted.append(i)
                if status is Status.OK or statuses[i] is Status.MISSING:  # else the local failure says more
                    statuses[i] = status
        if promoted:
            # The segments hold the value now; a refused promotion only means the next load is remote again.
            self.local.batch_put([keys[i] for i in promoted], [segments[i] for i in promoted])
        self._count(local_tier_hits=hits, remote_tier_hits=len(promoted))
        return statuses

    def batch_put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], retention: int = 0) -> list[Status]:
        return distinct_only(functools.partial(self._put_distinct, retention=retention), keys, segments)

    def _put_distinct(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]], retention: int) -> list[Status]:
        statuses = self.local.batch_put(keys, segments, retention)
        stored = [i for i, s in enumerate(statuses) if s is Status.OK]
        refused = [i for i, s in enumerate(statuses) if not s.stored]  # only the remote tier can keep these
        now = sorted(stored + refused) if self._write_through else refused
        if now:
            answers = self._remote_or("save", [Status.ERROR] * len(now), lambda: self.remote.batch_put(
                [keys[i] for i in now], [segments[i] for i in now], retention))
            local_only = 0
            for i, status in zip(now, answers):
                if statuses[i].stored:
                    local_only += not status.stored
                elif status.stored:
                    statuses[i] = status
            self._count(remote_tier_dropped=local_only)
        if stored and not self._write_through:
            self._writer_for().offer([keys[i] for i in stored], retention)
        return statuses

    def flush(self, timeout: float) -> bool:
        """Wait until every background write queued so far has run; False if some still wait."""
        with self._lock:
            writer = self._writer
        return writer is None or writer.flush(timeout)

    # -- capabilities -----------------------------------------------------------

    def register_memory(self, address: int, size: int, memory: Memory = Memory.HOST) -> None:
        check_memory(self, memory)
        self.local.register_memory(address, size, memory)
        self.remote.register_memory(address, size, memory)

    def segment_memory(self) -> frozenset[Memory]:
        return self.local.segment_memory() & self.remote.segment_memory()

    def wants_registration(self) -> bool:
        return self.local.wants_registration() or self.remote.wants_registration()

    def shared_store(self) -> str | None:
        """The remote store only when writes go through: in the background, another
        instance on it may not find a value yet. Otherwise the local tier's (a named pool)."""
        return self.remote.shared_store() if self._write_through else self.local.shared_store()

    def describe(self) -> str:
        write = "through" if self._write_through else f"background (queue {self._queue_size})"
        return (f"local tier: {self.local.describe()}; remote tier: {self._remote_title} "
                f"{self.remote.describe()}; remote writes {write}")

    def take_counters(self) -> dict[str, int]:
        with self._lock:
            counts, self._counts = dict(self._counts), Counter()
        return counts

    def gauges(self) -> dict[str, float]:
        """The local tier's: the remote store is shared and reports its own fill."""
        return self.local.gauges()

    def close(self) -> None:
        """Queued background writes first (up to ``_CLOSE_TIMEOUT``), as they read the local
        tier and write the remote one; then both tiers."""
        with self._lock:
            writer, self._writer = self._writer, None
        try:
            if writer is not None:
                writer.close(_CLOSE_TIMEOUT)
            self.remote.close()
        finally:
            self.local.close()

    # -- helpers ------------------------------------------------------------------

    def _writer_for(self) -> _RemoteWriter:
        with self._lock:
            if self._writer is None:
                self._writer = _RemoteWriter(self.local, self.remote, self._value_bytes, self._queue_size,
                                             lambda n: self._count(remote_tier_dropped=n))
            return self._writer

    def _count(self, **amounts: int) -> None:
        with self._lock:
            self._counts.update({k: v for k, v in amounts.items() if v})

    def _remote_or(self, what: str, fallback: T, call: Callable[[], T]) -> T:
        """``call()`` on the remote tier; ``fallback`` (a miss) if it raises, logged once per ``what``."""
        try:
            return call()
        except Exception as exc:  # the local tier serves on; the next call tries the remote tier again
            with self._lock:
                first = what not in self._warned
                self._warned.add(what)
            if first:
                logger.warning("vllm_aio: remote tier (%s) failed at %s, the local tier serves on: %s",
                               self._remote_title, what, exc)
            return fallback


class _RemoteWriter:
    """Background writes to the remote tier, on a thread of its own.

    The queue holds keys (with their retention class) only, at most ``capacity``: a save's staging is reused
    once the save returns, so each value is read back from the local tier when
    its turn comes, into one buffer registered with the remote tier once.
    ``dropped(n)`` counts values that never reach the remote tier.
    """

    def __init__(self, local: Backend, remote: Backend, value_bytes: int, capacity: int,
                 dropped: Callable[[int], None]) -> None:
        self._local = local
        self._remote = remote
        self._value_bytes = value_bytes
        self._capacity = capacity
        self._dropped = dropped
        self._batch = max(1, _BOUNCE_BYTES // value_bytes)
        self._buffer = ctypes.create_string_buffer(self._batch * value_bytes)
        self._address = ctypes.addressof(self._buffer)
        remote.register_memory(self._address, self._batch * value_bytes)
        self._cond = threading.Condition()
        self._keys: deque[tuple[str, int]] = deque()  # (key, retention) waiting; guarded by _cond, as _busy and _closing
        self._busy = 0  # keys taken by the thread, not written yet
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="vllm_aio-remote-tier", daemon=True)
        self._thread.start()

    def offer(self, keys: list[str], retention: int) -> None:
        """Queue what fits; never waits."""
        with self._cond:
            room = 0 if self._closing else max(0, self._capacity - len(self._keys))
            self._keys.extend((key, retention) for key in keys[:room])
            self._cond.notify_all()
        if len(keys) > room:
            self._dropped(len(keys) - room)

    def flush(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._keys and not self._busy, timeout)

    def close(self, timeout: float) -> None:
        self.flush(timeout)
        with self._cond:
            self._closing = True
            left = len(self._keys)
            self._keys.clear()
            self._cond.notify_all()
        self._thread.join(timeout)
        if left:
            self._dropped(left)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._keys or self._closing)
                if not self._keys:
                    return
                batch = [self._keys.popleft() for _ in range(min(self._batch, len(self._keys)))]
                self._busy = len(batch)
            try:
                self._dropped(self._write(batch))
            except Exception as exc:  # a tier raised: these values stay in the local tier only
                logger.warning("vllm_aio: background write of %d values to the remote tier failed: %s",
                               len(batch), exc)
                self._dropped(len(batch))
            finally:
                with self._cond:
                    self._busy = 0
                    self._cond.notify_all()

    def _write(self, entries: list[tuple[str, int]]) -> int:
        """Local tier -> buffer -> remote tier, a put per retention class; how many values did not get there."""
        n = self._value_bytes
        keys = [key for key, _ in entries]
        segments = [[(self._address + i * n, n)] for i in range(len(keys))]
        ready = [i for i, s in enumerate(self._local.batch_get(keys, segments)) if s is Status.OK]
        stored = 0
        for retention in sorted({entries[i][1] for i in ready}):  # none: all evicted from the local tier
            chosen = [i for i in ready if entries[i][1] == retention]
            put = self._remote.batch_put([keys[i] for i in chosen], [segments[i] for i in chosen], retention)
            stored += sum(s.stored for s in put)
        return len(keys) - stored
