"""``BlockIO``: what every data path between the KV cache and the pool is, and shares.

A *unit* is the set of layers one stored value holds: every layer, or one
layer with layerwise transfer. A path moves one batch of blocks for one unit;
blocks of a batch that share a key are read from or put into the pool once
(``blocks.DistinctBlocks``). Batches move in chunks of about ``_CHUNK_BYTES``,
so a batch larger than a staging buffer still moves (waiting for space instead
of failing) and, on accelerators, the pool copy of one chunk overlaps the
host-device copy of the previous one.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from vllm_aio.backends import Status
from vllm_aio.connector.worker.block_io.blocks import BlockRef, DistinctBlocks
from vllm_aio.connector.worker.block_io.labels import ValueLabels
from vllm_aio.device.accelerator import Device
from vllm_aio.device.staging import even_ranges
from vllm_aio.pool.keys import Unit

# Bytes per pipelined piece of a batch (pool copy vs. host-device copy).
_CHUNK_BYTES = 64 << 20


@dataclass
class Loaded:
    """What ``BlockIO.load`` did: a status per block, and the copies still in flight.

    ``copied``: the event after which the cache holds the accepted blocks
    (None: it does already); the caller's stream waits on it. ``settle``
    gives the final statuses once the copies are done: a value whose pool
    slot was rewritten during a direct copy is ``CORRUPT`` there. The
    forward thread and the sending thread (``StepLoads``) may both ask.
    """

    statuses: list[Status]
    copied: torch.Event | None = None
    _settle: Callable[[], list[Status]] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def settle(self) -> list[Status]:
        with self._lock:
            if self._settle is not None:
                self.statuses, self._settle = self._settle(), None
            return self.statuses


class CopyHandoff:
    """Tells the forward thread when a save no longer reads the cache blocks.

    If the forward thread stops waiting (timeout), the save is abandoned: its
    bytes may have been read while vLLM reused the blocks, so they are never
    put into the pool.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._abandoned = False
        # ``time.perf_counter()`` when the copy ended: what the save's own time is measured to, since what
        # follows (publishing, puts) runs beside the next step's forward and would be timed with it.
        self.copied_at: float | None = None

    def held(self) -> bool:
        """Called by the save after copying part of the blocks: False if abandoned."""
        with self._lock:
            return not self._abandoned

    def copied(self) -> bool:
        """Called by the save after its copy: False if it was abandoned meanwhile."""
        with self._lock:
            self.copied_at = time.perf_counter()
            self._done.set()
            return not self._abandoned

    def wait(self, timeout: float) -> bool:
        """Called by the forward thread: True once copied; False abandons the save."""
        if self._done.wait(timeout):
            return True
        with self._lock:
            self._abandoned = not self._done.is_set()
            return not self._abandoned


class BlockIO(ABC):
    """Moves batches of blocks, one unit at a time, between the KV cache and the pool along one path.

    ``open_block_io`` picks the path once; a path implements ``_load`` and
    ``_save`` for blocks with distinct keys and never asks which path it is.
    """

    direct = False  # whether values move straight between pool slots and the cache (no staging)

    def __init__(self, labels: ValueLabels, device: Device) -> None:
        self._labels = labels
        self.device = device

    @property
    def namespace_digest(self) -> str:
        return self._labels.namespace_digest

    def rename(self, namespace_digest: str) -> None:
        """Key and label values under another namespace from now on (a new weight version).

        The labels are replaced, not mutated: a transfer thread holding the
        old ones finishes its batch consistently, and a value whose header and
        key disagree could only ever be refused at load.
        """
        self._labels = self._labels.renamed(namespace_digest)

    def value_bytes(self, unit: Unit) -> int:
        return self._labels.value_bytes(unit)

    def keys(self, blocks: Sequence[BlockRef], unit: Unit) -> list[str]:
        return self._labels.keys(blocks, unit)

    def close(self) -> None:
        """Release what the path holds of the backend's memory; before the backend closes."""

    def warm_up(self, layer_sets: Iterable[Sequence[int]]) -> None:
        """Compile and load the copies this path runs (Triton kernels, numba loops) for values of
        these layer sets, at registration: the first request's step then pays nothing for them.
        Moves no value and writes nothing of the pool."""

    def prepare(self, blocks: Sequence[BlockRef]) -> DistinctBlocks:
        """A batch loaded unit after unit (layerwise): prepared once, handed to every ``load``."""
        return DistinctBlocks(blocks)

    def load(self, blocks: Sequence[BlockRef] | DistinctBlocks, unit: Unit) -> Loaded:
        """Pool -> KV cache: a status per block and the copies' event (``Loaded``).

        Each key is read from the pool once and its value copied to every
        block naming it. Runs on the calling thread, bound to the cache's device first.
        """
        self.device.bind_thread()
        batch = blocks if isinstance(blocks, DistinctBlocks) else DistinctBlocks(blocks)
        return self._load(batch, unit, self._labels)

    def begin_save(
        self, blocks: Sequence[BlockRef], unit: Unit, computed: torch.Event | None, handoff: CopyHandoff,
        retention: int, done: Callable[[list[Status]], None],
    ) -> None:
        """KV cache -> pool, one value per key; ``handoff`` is told once the cache blocks may be reused,
        ``done`` gets a status per block once the pool holds what it will (on a staging path, from
        the thread that puts, after this returns).

        ``computed``: an event after the forward wrote these blocks (None on
        the CPU, where the hooks run after the writes in program order).
        Blocks sharing a key with an earlier block of the batch hold the same
        KV (same chained hash): only the first is put; the others report
        ``EXISTS`` once it is stored (concurrent puts of one key can leave
        Mooncake with a key and no value). Bound to the cache's device first, as ``load``.
        """
        self.device.bind_thread()
        batch = DistinctBlocks(blocks)
        self._save(batch.firsts, unit, self._labels, computed, handoff, retention,
                   lambda statuses: done(batch.spread(statuses, repeat=lambda s: Status.EXISTS if s.stored else s)))

    def save(
        self, blocks: Sequence[BlockRef], unit: Unit, computed: torch.Event | None, handoff: CopyHandoff,
        retention: int = 0,
    ) -> list[Status]:
        """``begin_save``, returning once the statuses are in."""
        statuses: Future[list[Status]] = Future()
        self.begin_save(blocks, unit, computed, handoff, retention, statuses.set_result)
        return statuses.result()

    def drain(self) -> None:
        """Returns once every save begun so far has its statuses (its pool puts are over)."""

    @abstractmethod
    def _load(self, batch: DistinctBlocks, unit: Unit, labels: ValueLabels) -> Loaded:
        """``load`` of a reduced batch, its statuses spread back over every block."""

    @abstractmethod
    def _save(
        self, blocks: Sequence[BlockRef], unit: Unit, labels: ValueLabels, computed: torch.Event | None,
        handoff: CopyHandoff, retention: int, done: Callable[[list[Status]], None],
    ) -> None:
        """``begin_save`` of blocks with distinct keys."""


def chunks(n: int, value_bytes: int, scale: int = 1) -> list[tuple[int, int]]:
    """Even [start, end) row ranges of at most about ``scale`` x _CHUNK_BYTES each."""
    return even_ranges(n, chunk_rows(value_bytes, scale))


def chunk_rows(value_bytes: int, scale: int = 1) -> int:
    """The most values of ``value_bytes`` one chunk holds."""
    return max(1, scale * _CHUNK_BYTES // value_bytes)
