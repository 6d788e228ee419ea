"""Plumbing shared by the backends whose store sits behind a service (Mooncake, Memcache).

- ``MasterLink``: whether the service answers. Both client libraries block for
  seconds per call once their service is gone (Mooncake ~4 s, Memcache 60 s):
  after a failure, calls answer ERROR at once until a TCP probe sees it again.
  It logs one line when the service stops answering and one when it is back.
- ``CallGate``: counts calls in flight, so ``close`` never frees a client under
  one (both clients crash on a call after their close).
- ``Regions``: the memory registered with a client, and which of it is device memory.
- ``exists_over``: ``batch_exists`` over a batched native call that answers 1 per present key.
- ``count_by_probes``: the block lookup of a store without per-block records.
- ``diagnose``: a get that failed in a way that may hide a length mismatch,
  settled by the size the store holds for the key.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from vllm_aio.backends.base import Memory, Status
from vllm_aio.device.segment import Segment
from vllm_aio.errors import ConfigError
from vllm_aio.log import get_logger
from vllm_aio.pool.keys import BlockParts

logger = get_logger(__name__)

# A backend's bounded runner: ``(n, native)`` runs ``native(indices)`` over
# all ``n`` keys (in chunks, retried, ...) and returns one code per key.
BatchCall = Callable[[int, Callable[[list[int]], list[int]]], list[int]]


def split_address(key: str, address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port``; ``key`` names the setting in the error."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{key}: expected 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def tcp_reachable(address: str, timeout: float) -> bool:
    """Whether something accepts TCP connections at ``host:port`` within ``timeout``."""
    host, port = split_address("address", address)
    try:
        with socket.create_connection((host, port), timeout=max(timeout, 0.001)):
            return True
    except OSError:
        return False


class MasterLink:
    """Whether the service at ``address`` answers, so a dead one costs ERROR, not seconds a call.

    After a failure (``probe`` finding it gone) the link is down: ``usable``
    answers False at once, and at most one probe per ``probe_interval`` checks
    whether the service came back. ``service`` names it in the two log lines
    (down, back). ``reachable`` and ``clock`` are the TCP probe and the
    monotonic clock (tests give their own).
    """

    def __init__(
        self,
        address: str,
        service: str,
        probe_interval: float = 0.5,
        probe_timeout: float = 0.2,
        reachable: Callable[[str, float], bool] = tcp_reachable,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        self.service = service
        self.probe_interval = probe_interval
        self.probe_timeout = probe_timeout
        self._reachable = reachable
        self._clock = clock
        self._lock = threading.Lock()
        self._down = False  # guarded by _lock, as _last_probe
        self._last_probe = float("-inf")

    def usable(self) -> bool:
        """True unless the link is down and no probe is due (or the one due fails)."""
        with self._lock:
            if not self._down:
                return True
            now = self._clock()
            if now - self._last_probe < self.probe_interval:
                return False
            self._last_probe = now
        return self._settle(self._reachable(self.address, self.probe_timeout))

    def probe(self, timeout: float) -> bool:
        """Probe now (after a failed call); the link is down when the service does not answer."""
        up = self._reachable(self.address, min(timeout, self.probe_timeout))
        with self._lock:
            self._last_probe = self._clock()
        return self._settle(up)

    def _settle(self, up: bool) -> bool:
        """Record a probe's answer; a change is logged, once, by whichever thread saw it."""
        with self._lock:
            changed, self._down = self._down == up, not up
        if changed and up:
            logger.info("vllm_aio: %s at %s answers again; pool calls go to it", self.service, self.address)
        elif changed:
            logger.warning("vllm_aio: %s at %s does not answer; until it does, lookups miss and saves fail, "
                           "and requests compute their KV (probed every %.1f s)", self.service, self.address,
                           self.probe_interval)
        return up


class CallGate:
    """Counts calls in flight so ``close`` never frees the client under one."""

    def __init__(self, name: str) -> None:
        self._name = name  # the backend, in "<name> is closed"
        self._cond = threading.Condition()
        self._inflight = 0  # guarded by _cond, as _closed
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self._name} is closed")

    @contextmanager
    def call(self) -> Iterator[None]:
        """Around one call into the client; raises ``RuntimeError`` once closed."""
        with self._cond:
            self.check_open()
            self._inflight += 1
        try:
            yield
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def close(self, timeout: float) -> bool:
        """Refuse new calls; wait up to ``timeout`` for those in flight. False: one still runs."""
        with self._cond:
            self._closed = True
            return self._cond.wait_for(lambda: self._inflight == 0, timeout=timeout)


class Regions:
    """Memory registered with a client: ``(address, size)`` spans, some of them device memory.

    Not locked: the owner serialises registrations (one lock around the
    registration call and this bookkeeping); ``memory_of`` only reads.
    """

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []  # in registration order
        self._device: list[tuple[int, int]] = []  # the spans registered as device memory

    def covers(self, address: int, size: int) -> bool:
        """Whether one registered span holds all of ``[address, address + size)``."""
        return any(a <= address and address + size <= a + n for a, n in self.spans)

    def overlapping(self, address: int, size: int) -> list[tuple[int, int]]:
        return [(a, n) for a, n in self.spans if a < address + size and address < a + n]

    def add(self, address: int, size: int, memory: Memory) -> None:
        self.spans.append((address, size))
        if memory is Memory.DEVICE:
            self._device.append((address, size))

    def remove(self, span: tuple[int, int]) -> None:
        self.spans.remove(span)
        if span in self._device:
            self._device.remove(span)

    def memory_of(self, segments: Sequence[Segment]) -> Memory | None:
        """The kind of memory every segment points to; None when they mix kinds.

        A segment is device memory when it lies in a span registered as such,
        host memory otherwise (the contract's default, see ``base.py``).
        """
        if not self._device:
            return Memory.HOST
        device = [any(a <= p and p + n <= a + m for a, m in self._device) for p, n in segments]
        if all(device):
            return Memory.DEVICE
        return None if any(device) else Memory.HOST


def exists_over(call: BatchCall, exist: Callable[[list[str]], list[int]], keys: Sequence[str]) -> list[bool]:
    """``batch_exists`` through ``call`` (the backend's bounded, batched runner) of ``exist``."""
    keys = list(keys)
    codes = call(len(keys), lambda idx: exist([keys[i] for i in idx]))
    return [c == 1 for c in codes]


# Blocks per exists call of a lookup: a 128k-token prompt of 16-token blocks
# is one round trip; longer prompts take one more per 8,192 blocks.
LOOKUP_BLOCKS = 8192


def count_by_probes(
    exists: Callable[[list[str]], list[bool]], parts: BlockParts, hashes: Sequence[bytes]
) -> int:
    """Leading blocks whose probe key (``BlockParts.probe_keys``) is stored.

    A store keeps no record per block, and a marker value per block could not
    know that the other ranks finished their parts. So one part stands for each
    block: one key per block, whatever the layers and shards, in one bounded
    call per ``LOOKUP_BLOCKS`` blocks, stopping at the first missing one. Any
    other part missing fails at load and vLLM recomputes the block.
    """
    keys = parts.probe_keys(hashes)
    for start in range(0, len(keys), LOOKUP_BLOCKS):
        present = exists(keys[start : start + LOOKUP_BLOCKS])
        if not all(present):
            return start + present.index(False)
    return len(keys)


ABSENT = -1  # a stored size meaning "no such key"


def diagnose(stored: int | None, expected: int) -> Status:
    """The status of a get that failed in a way that may hide a length mismatch.

    ``stored``: the size the store now holds for the key, ``ABSENT`` when it
    holds none, None when the lookup failed too. A size other than the
    destination's is a length mismatch (CORRUPT); the right size means the
    transfer itself failed (ERROR).
    """
    if stored is None:
        return Status.ERROR
    if stored == ABSENT:
        return Status.MISSING
    return Status.CORRUPT if stored != expected else Status.ERROR
