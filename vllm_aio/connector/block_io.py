"""Moves one batch of blocks, for one value unit, between the KV cache and the pool.

A *unit* is the set of layers one stored value holds: every layer, or one
layer with layerwise transfer. Every value is ``header + payload``
(``pool/entry.py``); a value whose header differs from the one this rank would
have written for that key is refused (``CORRUPT``) before its payload reaches
the device.

Batches move in chunks of about ``_CHUNK_BYTES``, each with its own staging
slice, so a batch larger than the staging buffer still moves (waiting for
space instead of failing) and, on accelerators, the pool copy of one chunk
overlaps the host-device copy of the previous one.

Where the backend keeps values in slots of a host mapping the device can map
(the embedded pool on CUDA), values skip staging altogether: one gather kernel
per chunk reads the slots, one scatter writes them (``mapped_slots.py``).
Otherwise:

Loads (receiving thread, or the forward thread for synchronous loads):
* host KV cache (CPU): the backend copies the payload straight into the cache
  blocks and the header into a staging slice; a refused value's bytes are
  overwritten when vLLM recomputes the block;
* accelerator: the backend copies whole values into page-locked staging; the
  headers are checked there, then one host-to-device copy and one on-device
  scatter per plane move the accepted blocks, on the transfer stream. The
  caller gets the stream's event and makes the compute stream wait on it;
  nobody blocks on the copy.

Saves (sending thread): the blocks are gathered into staging (on an
accelerator: an on-device gather after the compute stream's event for that
layer, then a device-to-host copy), ``CopyHandoff`` tells the forward thread
the cache blocks may be reused, and the pool put runs from staging.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_aio.backends import Backend, Status
from vllm_aio.connector.block_layout import BlockLayout, LayerCache
from vllm_aio.connector.mapped_slots import MappedSlots, SlotLoad
from vllm_aio.connector.staging import Slice, StagingBuffer, even_ranges
from vllm_aio.device import Device
from vllm_aio.log import get_logger
from vllm_aio.pool.entry import HASH_PREFIX_BYTES, HEADER_BYTES, EntryHeader, describe
from vllm_aio.pool.host_pool import SLOT_STORED
from vllm_aio.pool.keys import Unit, block_key

logger = get_logger(__name__)

# Bytes per pipelined piece of a batch on accelerators (pool copy vs. PCIe copy).
_CHUNK_BYTES = 64 << 20
# The direct path's pieces are larger (device scratch only, no staging): every
# piece launches one scatter or gather per layer plane, ~8 us of host time
# each on the H200 host, and 32 layers x 2 planes per 64 MiB of whole blocks
# left the host launching, not the link copying (66% of pinned H2D at 256
# blocks). Two pieces in flight keep the gather of one behind the scatter of
# the other.
_DIRECT_CHUNKS = 4  # x _CHUNK_BYTES


@dataclass(frozen=True)
class BlockRef:
    block_id: int
    block_hash: bytes


@dataclass
class Batch:
    """Blocks of several requests moved together, with the request of each."""

    blocks: list[BlockRef]
    req_ids: list[str]
    retention: int = 0  # of the requests saving them (``Backend.batch_put``)
    # Saves with KV events: positions whose value failed for an earlier layer
    # (a layerwise batch is saved once per layer; ``saves.py``).
    unsaved: set[int] = field(default_factory=set)


@dataclass
class Loaded:
    """What ``BlockIO.load`` did: a status per block, and the copies still in flight.

    ``copied``: the event after which the cache holds the accepted blocks
    (None: it does already); the caller's stream waits on it. ``settle``
    gives the final statuses once the copies are done: a value whose pool
    slot was rewritten during a direct copy is ``CORRUPT`` there.
    """

    statuses: list[Status]
    copied: torch.Event | None = None
    _settle: Callable[[], list[Status]] | None = None

    def settle(self) -> list[Status]:
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

    def held(self) -> bool:
        """Called by the save after copying part of the blocks: False if abandoned."""
        with self._lock:
            return not self._abandoned

    def copied(self) -> bool:
        """Called by the save after its copy: False if it was abandoned meanwhile."""
        with self._lock:
            self._done.set()
            return not self._abandoned

    def wait(self, timeout: float) -> bool:
        """Called by the forward thread: True once copied; False abandons the save."""
        if self._done.wait(timeout):
            return True
        with self._lock:
            self._abandoned = not self._done.is_set()
            return not self._abandoned


class BlockIO:
    def __init__(
        self,
        layout: BlockLayout,
        backend: Backend,
        header: EntryHeader,  # the layer field is set per unit
        load_staging: StagingBuffer,
        save_staging: StagingBuffer,
        timeout: float,
        direct: MappedSlots | None = None,
    ) -> None:
        self._layout = layout
        self._direct = direct
        self._backend = backend
        self._header = header
        self._timeout = timeout
        self.device = Device(layout.device)
        self._loads = load_staging
        self._saves = save_staging
        self._stream = self.device.new_stream()
        self._fixed_header: dict[int | None, bytes] = {}  # per unit tag

    @property
    def direct(self) -> bool:
        """Whether values move straight between pool slots and the cache (no staging)."""
        return self._direct is not None

    def close(self) -> None:
        """Unmap what the device mapped; before the backend closes."""
        if self._direct is not None:
            self._direct.close()

    @property
    def namespace_digest(self) -> str:
        return self._header.namespace_digest

    def rename(self, namespace_digest: str) -> None:
        """Key and label values under another namespace from now on (a new weight version).

        Both attributes are replaced, not mutated: a transfer thread holding
        the old ones finishes its batch consistently, and a value whose header
        and key disagree could only ever be refused at load.
        """
        self._fixed_header = {}
        self._header = dataclasses.replace(self._header, namespace_digest=namespace_digest)

    def value_bytes(self, unit: Unit) -> int:
        return HEADER_BYTES + self._layout.payload_bytes(unit.layers)

    def keys(self, blocks: Sequence[BlockRef], unit: Unit) -> list[str]:
        digest, shard = self._header.namespace_digest, self._header.shard
        return [block_key(digest, shard, b.block_hash, unit.tag) for b in blocks]

    def _headers(self, blocks: Sequence[BlockRef], unit: Unit) -> list[bytes]:
        fixed = self._fixed(unit)
        return [fixed + b.block_hash[:HASH_PREFIX_BYTES].ljust(HASH_PREFIX_BYTES, b"\0") for b in blocks]

    def _fixed(self, unit: Unit) -> bytes:
        """The header of ``unit``'s values up to the block hash: the same for every block, packed once."""
        fixed = self._fixed_header.get(unit.tag)
        if fixed is None:
            header = EntryHeader(
                self._header.namespace_digest,
                self._header.shard,
                -1 if unit.tag is None else unit.tag,
                self._header.block_size,
                self._layout.payload_bytes(unit.layers),
            )
            fixed = self._fixed_header[unit.tag] = header.pack(bytes(HASH_PREFIX_BYTES))[:-HASH_PREFIX_BYTES]
        return fixed

    # ---- loads -------------------------------------------------------------
    def prepare(self, blocks: Sequence[BlockRef]) -> DistinctBlocks:
        """A batch loaded unit after unit (layerwise): prepared once, handed to every ``load``."""
        return DistinctBlocks(blocks)

    def load(self, blocks: Sequence[BlockRef] | DistinctBlocks, unit: Unit) -> Loaded:
        """Pool -> KV cache: a status per block and the copies' event (``Loaded``).

        Blocks of one batch may share a key (requests with a common prefix
        loaded in one step, each into blocks of its own): each key is read
        from the pool once and its value copied to every block naming it.
        """
        batch = blocks if isinstance(blocks, DistinctBlocks) else DistinctBlocks(blocks)
        if self._direct is not None:
            return self._load_direct(batch, unit)
        statuses: list[Status] = []
        event = None
        value = HEADER_BYTES if self.device.is_host else self.value_bytes(unit)
        for start, end in _chunks(len(batch.firsts), self.value_bytes(unit)):
            piece = self._loads.allocate((end - start) * value, self._timeout)
            if piece is None:  # no staging within the timeout
                statuses += [Status.ERROR] * (end - start)
                continue
            chunk = batch.firsts[start:end]
            targets = batch.targets[start:end]
            try:
                if self.device.is_host:
                    statuses += self._load_into_host_cache(chunk, targets, unit, piece)
                    continue
                got, event = self._load_through_staging(chunk, targets, unit, piece, event)
                statuses += got
            finally:
                self._loads.release(piece, after=None if self.device.is_host else event)
        return Loaded(batch.spread(statuses), event)

    def _load_direct(self, batch: "DistinctBlocks", unit: Unit) -> Loaded:
        statuses: list[Status] = []
        copies: list[tuple[int, SlotLoad]] = []  # (chunk start, its copy)
        with self.device.on(self._stream):
            for start, end in _chunks(len(batch.firsts), self.value_bytes(unit), _DIRECT_CHUNKS):
                plan = batch.plans.get((start, end))
                if plan is None:
                    plan = batch.plans[(start, end)] = self._direct.plan(
                        [b.block_hash for b in batch.firsts[start:end]], batch.targets[start:end]
                    )
                got, copy = self._direct.load(
                    plan, self._header.namespace_digest, self._header.shard, unit, self._fixed(unit)
                )
                statuses += got
                copies.append((start, copy))
        # Each chunk's event follows its scatter, on one stream: the last covers them all.
        event = next((copy.event for _, copy in reversed(copies) if copy.event is not None), None)

        def settle() -> list[Status]:
            for start, copy in copies:
                for position in copy.torn(self._direct.store):
                    statuses[start + position] = Status.CORRUPT
            return batch.spread(statuses)

        return Loaded(batch.spread(statuses), event, settle)

    def _load_into_host_cache(
        self, blocks: Sequence[BlockRef], targets: Sequence[list[int]], unit: Unit, piece: Slice
    ) -> list[Status]:
        segments = [
            [(piece.address + i * HEADER_BYTES, HEADER_BYTES)] + self._layout.segments(b.block_id, unit.layers)
            for i, b in enumerate(blocks)
        ]
        statuses = self._backend.batch_get(self.keys(blocks, unit), segments)
        statuses = _check_headers(piece.tensor.view(len(blocks), HEADER_BYTES), self._headers(blocks, unit), statuses)
        # Blocks sharing a key get the bytes of the one the pool wrote into.
        copies = [(b.block_id, dst) for b, t, s in zip(blocks, targets, statuses) if s is Status.OK for dst in t[1:]]
        if copies:
            src, dst = zip(*copies)
            self._layout.copy_blocks(torch.tensor(src), torch.tensor(dst), unit.layers)
        return statuses

    def _load_through_staging(
        self,
        blocks: Sequence[BlockRef],
        targets: Sequence[list[int]],
        unit: Unit,
        piece: Slice,
        event: torch.Event | None,
    ) -> tuple[list[Status], torch.Event | None]:
        n, value = len(blocks), self.value_bytes(unit)
        rows = piece.tensor.view(n, value)
        segments = [[(piece.address + i * value, value)] for i in range(n)]
        statuses = self._backend.batch_get(self.keys(blocks, unit), segments)
        statuses = _check_headers(rows[:, :HEADER_BYTES], self._headers(blocks, unit), statuses)
        # One row per destination block: a value shared by several blocks is
        # repeated on the device, not read from the pool again.
        picks = [(i, dst) for i, s in enumerate(statuses) if s is Status.OK for dst in targets[i]]
        if not picks:
            return statuses, event
        row_of, ids = zip(*picks)
        with self.device.on(self._stream):
            scratch = self.device.empty(rows.numel()).view(n, value)
            scratch.copy_(rows, non_blocking=True)
            if list(row_of) != list(range(n)):
                scratch = scratch.index_select(0, self._on_device(list(row_of)))
            self._layout.scatter(scratch[:, HEADER_BYTES:], self._on_device(list(ids)), unit.layers)
            return statuses, self.device.record(self._stream)

    # ---- saves -------------------------------------------------------------
    def save(
        self, blocks: Sequence[BlockRef], unit: Unit, computed: torch.Event | None, handoff: CopyHandoff,
        retention: int = 0,
    ) -> list[Status]:
        """KV cache -> staging (then ``handoff``) -> pool, one value per key.

        Blocks sharing a key with an earlier block of the batch hold the same
        KV (same chained hash): only the first is put; the others report
        ``EXISTS`` once it is stored (concurrent puts of one key can leave
        Mooncake with a key and no value).
        """
        batch = DistinctBlocks(blocks)
        save = self._save_direct if self._direct is not None else self._save_distinct
        statuses = save(batch.firsts, unit, computed, handoff, retention)
        return batch.spread(statuses, repeat=lambda s: Status.EXISTS if s.stored else s)

    def _save_distinct(
        self, blocks: Sequence[BlockRef], unit: Unit, computed: torch.Event | None, handoff: CopyHandoff,
        retention: int,
    ) -> list[Status]:
        """``save`` of blocks with distinct keys.

        ``computed``: an event after the forward wrote these blocks (None on CPU,
        where the hooks run after the writes in program order). Chunks copied
        out are put as staging runs short, the rest once every block is out.
        """
        statuses: list[Status] = []
        pending: deque[_Copied] = deque()
        chunks = _chunks(len(blocks), self.value_bytes(unit))
        try:
            for start, end in chunks:
                piece = self._save_slice((end - start) * self.value_bytes(unit), pending, statuses, handoff, retention)
                if piece is None or not handoff.held():
                    if piece is not None:
                        self._saves.release(piece)
                    break
                pending.append(self._copy_out(blocks[start:end], unit, computed, piece))
                computed = None  # later chunks follow on the same stream
            if pending:  # the last gather also covers the earlier ones (stream order)
                self.device.synchronize(pending[-1].gathered)
        finally:
            keep = handoff.copied()
        while pending:
            statuses += self._put(pending.popleft(), keep, retention)
        return statuses + [Status.NO_SPACE if keep else Status.ERROR] * (len(blocks) - len(statuses))

    def _save_direct(
        self, blocks: Sequence[BlockRef], unit: Unit, computed: torch.Event | None, handoff: CopyHandoff,
        retention: int,
    ) -> list[Status]:
        """``save`` of distinct blocks straight into reserved pool slots (``mapped_slots.py``).

        ``handoff`` is told once the last gather out of the cache is done; the
        slots are published once the payload copies into them are too.
        """
        statuses: list[Status] = []
        filled: list[tuple[list[int], np.ndarray, list[BlockRef]]] = []  # per chunk: positions, slots, blocks
        gathered = written = None
        try:
            with self.device.on(self._stream):
                self.device.wait(computed, self._stream)
                for start, end in _chunks(len(blocks), self.value_bytes(unit), _DIRECT_CHUNKS):
                    if not handoff.held():
                        break
                    chunk = blocks[start:end]
                    slots = self._direct.reserve(self._header.namespace_digest, self._header.shard, unit,
                                                 [b.block_hash for b in chunk], retention)
                    statuses += [Status.EXISTS if s == SLOT_STORED else Status.NO_SPACE for s in slots.tolist()]
                    fill = np.flatnonzero(slots >= 0)
                    if len(fill):
                        picked = [chunk[i] for i in fill.tolist()]
                        filled.append(((start + fill).tolist(), slots[fill], picked))
                        gathered = self._direct.copy_out([b.block_id for b in picked], slots[fill], unit.layers)
                written = self._direct.written()
            self.device.synchronize(gathered)  # the cache blocks may be reused from here on
        except BaseException:
            for _, slots, _ in filled:  # after the copies into them, whatever they reached
                self._direct.abandon(slots, self._direct.written())
            raise
        finally:
            keep = handoff.copied()
        for positions, slots, chunk in filled:
            if not keep:  # the bytes may be torn: never published
                self._direct.abandon(slots, written)
                for p in positions:
                    statuses[p] = Status.ERROR
                continue
            for p, stored in zip(positions, self._direct.publish(slots, self._headers(chunk, unit), written)):
                statuses[p] = Status.OK if stored else Status.EXISTS
        return statuses + [Status.ERROR] * (len(blocks) - len(statuses))

    def _save_slice(
        self, nbytes: int, pending: deque["_Copied"], statuses: list[Status], handoff: CopyHandoff, retention: int
    ) -> Slice | None:
        """Staging for the next chunk; puts earlier chunks of this save to make room."""
        while (piece := self._saves.allocate(nbytes, 0)) is None and pending:
            oldest = pending.popleft()
            self.device.synchronize(oldest.gathered)
            statuses += self._put(oldest, handoff.held(), retention)
        return piece or self._saves.allocate(nbytes, self._timeout)

    def _copy_out(
        self, blocks: Sequence[BlockRef], unit: Unit, computed: torch.Event | None, piece: Slice
    ) -> "_Copied":
        rows = piece.tensor.view(len(blocks), -1)
        ids = [b.block_id for b in blocks]
        if self.device.is_host:
            self._layout.gather(torch.tensor(ids), unit.layers, rows[:, HEADER_BYTES:])
            return _Copied(blocks, unit, piece, None, None)
        with self.device.on(self._stream):
            self.device.wait(computed, self._stream)
            scratch = self.device.empty(rows.numel()).view(rows.shape)
            self._layout.gather(self._on_device(ids), unit.layers, scratch[:, HEADER_BYTES:])
            gathered = self.device.record(self._stream)
            rows.copy_(scratch, non_blocking=True)
            return _Copied(blocks, unit, piece, gathered, self.device.record(self._stream))

    def _put(self, chunk: "_Copied", keep: bool, retention: int) -> list[Status]:
        """Pool put of one copied chunk, unless its copy may be torn (``keep`` False)."""
        n = len(chunk.blocks)
        try:
            if not keep:
                return [Status.ERROR] * n
            self.device.synchronize(chunk.in_staging)
            rows = chunk.piece.tensor.view(n, -1)
            headers = bytearray(b"".join(self._headers(chunk.blocks, chunk.unit)))
            rows[:, :HEADER_BYTES] = torch.frombuffer(headers, dtype=torch.uint8).view(n, HEADER_BYTES)
            value = rows.shape[1]
            segments = [[(chunk.piece.address + i * value, value)] for i in range(n)]
            return self._backend.batch_put(self.keys(chunk.blocks, chunk.unit), segments, retention)
        finally:
            self._saves.release(chunk.piece)

    def _on_device(self, values: list[int]) -> torch.Tensor:
        return self.device.indices(values)


def open_block_io(
    kv_caches: Mapping[str, LayerCache],
    layer_names: Sequence[str],
    num_blocks: int,
    backend: Backend,
    header: EntryHeader,
    staging_bytes: int,
    timeout: float,
) -> BlockIO:
    """A ``BlockIO`` over these cache tensors, wired as every user needs it.

    Values move straight between the pool's slots and the cache where the
    backend has slots and the device can map them (``MappedSlots.open``: the
    embedded pool on the CPU and on CUDA).

    One staging buffer per direction (page-locked on accelerators), and the
    memory the backend will copy between registered with it once: the
    staging buffers, and on the CPU the KV cache itself, which the backend
    reads and writes in place. The worker, the tests and the benchmarks all
    build their ``BlockIO`` here.
    """
    layout = BlockLayout(kv_caches, layer_names, num_blocks)
    device = Device(layout.device)
    loads, saves = StagingBuffer(device, staging_bytes), StagingBuffer(device, staging_bytes)
    spans = layout.memory_spans() if device.is_host else []
    for address, size in spans + [(s.address, s.capacity) for s in (loads, saves)]:
        backend.register_memory(address, size)
    direct = MappedSlots.open(backend.slots(), layout, device)
    return BlockIO(layout, backend, header, loads, saves, timeout, direct)


@dataclass
class _Copied:
    """A chunk of a save, out of the cache (``gathered``) and on its way to staging."""

    blocks: Sequence[BlockRef]
    unit: Unit
    piece: Slice
    gathered: torch.Event | None  # after this the cache blocks may be reused
    in_staging: torch.Event | None  # after this the staging rows hold the values


class DistinctBlocks:
    """A batch's blocks reduced to one per block hash, i.e. per pool key (``BlockIO.prepare``).

    ``firsts``: the first block of each distinct hash, in batch order;
    ``targets``: per distinct hash, the block ids of every block naming it
    (its first block's id first). ``plans`` keeps what the direct path
    derives from them once per batch, for every layer that loads it.
    """

    def __init__(self, blocks: Sequence[BlockRef]) -> None:
        self.plans: dict[tuple[int, int], object] = {}
        index: dict[bytes, int] = {}
        self.firsts: list[BlockRef] = []
        self.targets: list[list[int]] = []
        self._which: list[int] = []  # per block: its distinct hash's position
        for b in blocks:
            j = index.setdefault(b.block_hash, len(self.firsts))
            if j == len(self.firsts):
                self.firsts.append(b)
                self.targets.append([])
            self.targets[j].append(b.block_id)
            self._which.append(j)

    def spread(self, statuses: list[Status], repeat: Callable[[Status], Status] = lambda s: s) -> list[Status]:
        """Per block, the status of its hash; ``repeat`` maps it for blocks after the first."""
        if len(self.firsts) == len(self._which):  # no hash twice: the statuses as they are
            return list(statuses)
        seen: set[int] = set()
        out = []
        for j in self._which:
            out.append(statuses[j] if j not in seen else repeat(statuses[j]))
            seen.add(j)
        return out


def _chunks(n: int, value_bytes: int, scale: int = 1) -> list[tuple[int, int]]:
    """Even [start, end) row ranges of at most about ``scale`` x _CHUNK_BYTES each."""
    return even_ranges(n, scale * _CHUNK_BYTES // value_bytes)


def _check_headers(stored: torch.Tensor, expected: list[bytes], statuses: list[Status]) -> list[Status]:
    """OK only where the stored header is exactly the one this reader would write (one batched compare)."""
    if not expected:
        return statuses
    want = torch.frombuffer(bytearray(b"".join(expected)), dtype=torch.uint8).view(-1, HEADER_BYTES)
    equal = (stored == want).all(dim=1).tolist()
    out = list(statuses)
    for i, same in enumerate(equal):
        if out[i] is Status.OK and not same:
            out[i] = Status.FOREIGN
            got = stored[i].contiguous().numpy().tobytes()
            logger.debug("vllm_aio: refused a value: stored %s, expected %s", describe(got), describe(expected[i]))
    return out
