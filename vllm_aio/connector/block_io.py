"""Moves one batch of blocks, for one value unit, between the KV cache and the pool.

A *unit* is the set of layers one stored value holds: every layer, or one
layer with layerwise transfer. Every value is ``header + payload``
(``pool/entry.py``); a value whose header differs from the one this rank would
have written for that key is refused (``CORRUPT``) before its payload reaches
the device.

Loads, on the receiving thread:
* host KV cache (CPU): the backend copies the payload straight into the cache
  blocks and the header into a staging slice; a refused value's bytes are
  overwritten when vLLM recomputes the block;
* accelerator: the backend copies whole values into page-locked staging; the
  headers are checked there, then one host-to-device copy and one on-device
  scatter per plane move the accepted blocks, on the transfer stream.

Saves, on the sending thread: the blocks are gathered into staging (on an
accelerator: on-device gather, one device-to-host copy, after the compute
stream's event for that layer), then ``copy_done`` tells the forward thread
the cache blocks may be reused, and the pool put runs from staging.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_aio.backends import Backend, Status
from vllm_aio.connector.block_layout import BlockLayout
from vllm_aio.connector.staging import StagingBuffer
from vllm_aio.device import Device
from vllm_aio.log import get_logger
from vllm_aio.pool.entry import HEADER_BYTES, EntryHeader, describe
from vllm_aio.pool.keys import Unit, block_key

logger = get_logger(__name__)

# Bytes per pipelined piece of a batch on accelerators (pool copy vs. PCIe copy).
_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class BlockRef:
    block_id: int
    block_hash: bytes


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
    ) -> None:
        self._layout = layout
        self._backend = backend
        self._header = header
        self._load_staging = load_staging
        self._save_staging = save_staging
        self._timeout = timeout
        self.device = Device(layout.device)
        self._stream = self.device.new_stream()

    def value_bytes(self, unit: Unit) -> int:
        return HEADER_BYTES + self._layout.payload_bytes(unit.layers)

    def keys(self, blocks: Sequence[BlockRef], unit: Unit) -> list[str]:
        digest, shard = self._header.namespace_digest, self._header.shard
        return [block_key(digest, shard, b.block_hash, unit.tag) for b in blocks]

    def _headers(self, blocks: Sequence[BlockRef], unit: Unit) -> list[bytes]:
        header = EntryHeader(
            self._header.namespace_digest,
            self._header.shard,
            -1 if unit.tag is None else unit.tag,
            self._header.block_size,
            self._layout.payload_bytes(unit.layers),
        )
        return [header.pack(b.block_hash) for b in blocks]

    # ---- loads -------------------------------------------------------------
    def load(self, blocks: Sequence[BlockRef], unit: Unit) -> list[Status]:
        """Pool -> KV cache; the cache holds the accepted blocks when this returns."""
        if not blocks:
            return []
        if self.device.is_host:
            return self._load_into_host_cache(blocks, unit)
        return self._load_through_staging(blocks, unit)

    def _load_into_host_cache(self, blocks: Sequence[BlockRef], unit: Unit) -> list[Status]:
        n = len(blocks)
        piece = self._load_staging.allocate(n * HEADER_BYTES, self._timeout)
        if piece is None:
            return [Status.ERROR] * n
        try:
            segments = [
                [(piece.address + i * HEADER_BYTES, HEADER_BYTES)]
                + self._layout.segments(b.block_id, unit.layers)
                for i, b in enumerate(blocks)
            ]
            statuses = self._backend.batch_get(self.keys(blocks, unit), segments)
            return _check_headers(piece.tensor.view(n, HEADER_BYTES), self._headers(blocks, unit), statuses)
        finally:
            self._load_staging.release(piece)

    def _load_through_staging(self, blocks: Sequence[BlockRef], unit: Unit) -> list[Status]:
        n, value = len(blocks), self.value_bytes(unit)
        piece = self._load_staging.allocate(n * value, self._timeout)
        if piece is None:
            return [Status.ERROR] * n
        try:
            rows = piece.tensor.view(n, value)
            keys, headers = self.keys(blocks, unit), self._headers(blocks, unit)
            statuses: list[Status] = []
            done = None
            # Chunks pipeline the pool copy of chunk k+1 with chunk k's
            # host-to-device copy and scatter on the transfer stream.
            for start in range(0, n, self._chunk_rows(value)):
                end = min(n, start + self._chunk_rows(value))
                segments = [[(piece.address + i * value, value)] for i in range(start, end)]
                got = self._backend.batch_get(keys[start:end], segments)
                got = _check_headers(rows[start:end, :HEADER_BYTES], headers[start:end], got)
                statuses += got
                accepted = [start + i for i, s in enumerate(got) if s is Status.OK]
                if accepted:
                    done = self._to_device(rows, start, end, accepted, blocks, unit)
            # The staging slice is reused once the copies have read it.
            self.device.synchronize(done)
            return statuses
        finally:
            self._load_staging.release(piece)

    def _to_device(
        self, rows: torch.Tensor, start: int, end: int, accepted: list[int], blocks: Sequence[BlockRef], unit: Unit
    ) -> torch.Event | None:
        with self.device.on(self._stream):
            scratch = self.device.empty(rows[start:end].numel()).view(end - start, -1)
            scratch.copy_(rows[start:end], non_blocking=True)
            if len(accepted) < end - start:
                scratch = scratch.index_select(0, self._on_device([i - start for i in accepted]))
            ids = self._on_device([blocks[i].block_id for i in accepted])
            self._layout.scatter(scratch[:, HEADER_BYTES:], ids, unit.layers)
            return self.device.record(self._stream)

    @staticmethod
    def _chunk_rows(value: int) -> int:
        return max(1, _CHUNK_BYTES // value)

    # ---- saves -------------------------------------------------------------
    def save(
        self, blocks: Sequence[BlockRef], unit: Unit, computed: torch.Event | None, handoff: CopyHandoff
    ) -> list[Status]:
        """KV cache -> staging (then ``handoff``) -> pool.

        ``computed``: an event after the forward wrote these blocks (None on CPU,
        where the hooks run after the writes in program order).
        """
        n, value = len(blocks), self.value_bytes(unit)
        piece = self._save_staging.allocate(n * value, self._timeout) if blocks else None
        if piece is None:
            handoff.copied()
            return [Status.NO_SPACE] * n
        try:
            rows = piece.tensor.view(n, value)
            try:
                copied = self._gather(blocks, unit, computed, rows)
            finally:
                keep = handoff.copied()
            if not keep:
                return [Status.ERROR] * n
            keys = self.keys(blocks, unit)
            headers = bytearray(b"".join(self._headers(blocks, unit)))
            statuses: list[Status] = []
            # Each chunk is put as soon as its device-to-host copy is done.
            for (start, end), event in copied:
                self.device.synchronize(event)
                rows[start:end, :HEADER_BYTES] = torch.frombuffer(
                    headers, dtype=torch.uint8, offset=start * HEADER_BYTES, count=(end - start) * HEADER_BYTES
                ).view(end - start, HEADER_BYTES)
                segments = [[(piece.address + i * value, value)] for i in range(start, end)]
                statuses += self._backend.batch_put(keys[start:end], segments)
            return statuses
        finally:
            self._save_staging.release(piece)

    def _gather(
        self, blocks: Sequence[BlockRef], unit: Unit, computed: torch.Event | None, rows: torch.Tensor
    ) -> list[tuple[tuple[int, int], torch.Event | None]]:
        """Copies the blocks out of the cache; returns row chunks with their copy events.

        When this returns the cache blocks may be reused: on an accelerator they
        were gathered into device scratch, which the chunked copies to host read.
        """
        n = len(blocks)
        ids = [b.block_id for b in blocks]
        if self.device.is_host:
            self._layout.gather(torch.tensor(ids), unit.layers, rows[:, HEADER_BYTES:])
            return [((0, n), None)]
        step = self._chunk_rows(rows.shape[1])
        chunks = []
        with self.device.on(self._stream):
            self.device.wait(computed, self._stream)
            scratch = self.device.empty(rows.numel()).view(rows.shape)
            self._layout.gather(self._on_device(ids), unit.layers, scratch[:, HEADER_BYTES:])
            gathered = self.device.record(self._stream)
            for start in range(0, n, step):
                end = min(n, start + step)
                rows[start:end].copy_(scratch[start:end], non_blocking=True)
                chunks.append(((start, end), self.device.record(self._stream)))
        self.device.synchronize(gathered)
        return chunks

    def _on_device(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self._layout.device, non_blocking=True)


def _check_headers(stored: torch.Tensor, expected: list[bytes], statuses: list[Status]) -> list[Status]:
    """OK only where the stored header is exactly the one this reader would write."""
    raw = stored.contiguous().numpy().tobytes()
    out = []
    for i, (want, status) in enumerate(zip(expected, statuses)):
        got = raw[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]
        if status is Status.OK and got != want:
            status = Status.FOREIGN
            logger.debug("vllm_aio: refused a value: stored %s, expected %s", describe(got), describe(want))
        out.append(status)
    return out
