"""The in-place path: the backend copies straight into and out of the KV cache's own memory.

Two cases, one logic: the KV cache is host memory (the CPU), or it is device
memory and the backend moves device memory itself (``Memory.DEVICE`` in its
``segment_memory``: Mooncake's Ascend transport, device-direct, as vllm-ascend
moves it). ``open_block_io`` registers the cache and this path's buffers with
the backend once, as host or device memory.

Loads: the backend copies each payload straight into the cache blocks and its
header into a slice of header staging (in the cache's memory), where it is
checked; a refused value's bytes are overwritten when vLLM recomputes the
block. Blocks sharing a key get the bytes of the one the store wrote into, on
the transfer stream.

Saves: the blocks are gathered into staging rows (in the cache's memory) on
the transfer stream after the forward's event, and put from there on the put
thread (``staging_save.py``). Putting straight from the cache would save that
gather but hold vLLM's blocks for the whole put (``wait_for_save`` would wait
for the store, not for an on-device gather), and a put that outlived the
forward's wait could store bytes vLLM had meanwhile overwritten.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_aio.backends import Backend, Status
from vllm_aio.connector.worker.block_io.base import Loaded, chunks
from vllm_aio.connector.worker.block_io.blocks import BlockRef, DistinctBlocks
from vllm_aio.connector.worker.block_io.labels import ValueLabels, check_headers
from vllm_aio.connector.worker.block_io.staging_save import Copied, SavesThroughStaging
from vllm_aio.device.accelerator import Device
from vllm_aio.device.block_layout import BlockLayout
from vllm_aio.device.staging import Slice, StagingBuffer
from vllm_aio.pool.entry import HEADER_BYTES
from vllm_aio.pool.keys import Unit


class InPlacePath(SavesThroughStaging):
    def __init__(
        self, labels: ValueLabels, device: Device, layout: BlockLayout, backend: Backend,
        header_staging: StagingBuffer, save_staging: StagingBuffer, timeout: float,
    ) -> None:
        super().__init__(labels, device, backend, save_staging, timeout)
        self._layout = layout
        self._backend = backend
        self._headers = header_staging
        self._timeout = timeout
        self._stream = device.new_stream()

    def _load(self, batch: DistinctBlocks, unit: Unit, labels: ValueLabels) -> Loaded:
        statuses: list[Status] = []
        event = None
        for start, end in chunks(len(batch.firsts), labels.value_bytes(unit)):
            piece = self._headers.allocate((end - start) * HEADER_BYTES, self._timeout)
            if piece is None:  # no staging within the timeout
                statuses += [Status.ERROR] * (end - start)
                continue
            try:
                got, copied = self._load_chunk(batch.firsts[start:end], batch.targets[start:end], unit, labels, piece)
                statuses += got
                if copied is not None:  # one stream: the last event covers the earlier copies
                    event = copied
            finally:
                self._headers.release(piece)
        return Loaded(batch.spread(statuses), event)

    def _load_chunk(
        self, blocks: Sequence[BlockRef], targets: Sequence[list[int]], unit: Unit, labels: ValueLabels,
        piece: Slice,
    ) -> tuple[list[Status], torch.Event | None]:
        segments = [
            [(piece.address + i * HEADER_BYTES, HEADER_BYTES)] + self._layout.segments(b.block_id, unit.layers)
            for i, b in enumerate(blocks)
        ]
        statuses = self._backend.batch_get(labels.keys(blocks, unit), segments)
        # The store has written when batch_get returns; device headers come back in one small copy.
        stored = piece.tensor.view(len(blocks), HEADER_BYTES).cpu()
        statuses = check_headers(stored, labels.headers(blocks, unit), statuses)
        copies = [(b.block_id, dst) for b, t, s in zip(blocks, targets, statuses) if s is Status.OK for dst in t[1:]]
        if not copies:
            return statuses, None
        src, dst = zip(*copies)
        with self.device.on(self._stream):
            self._layout.copy_blocks(self.device.indices(list(src)), self.device.indices(list(dst)), unit.layers)
            return statuses, self.device.record(self._stream)

    def _copy_out(self, blocks: Sequence[BlockRef], unit: Unit, computed: torch.Event | None, piece: Slice) -> Copied:
        """The gather into the staging rows, after ``computed`` (on the CPU the hooks run after the
        forward's writes in program order: nothing to wait for, and the copy is done on return)."""
        rows = piece.tensor.view(len(blocks), -1)
        with self.device.on(self._stream):
            self.device.wait(computed, self._stream)
            self._layout.gather(self.device.indices([b.block_id for b in blocks]), unit.layers,
                                rows[:, HEADER_BYTES:])
            gathered = self.device.record(self._stream)
        return Copied(blocks, unit, piece, gathered, gathered)
