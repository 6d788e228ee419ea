"""The host cache path: the KV cache is host memory (CPU) and the backend copies into and out of it.

Loads: the backend copies each payload straight into the cache blocks and its
header into a staging slice, where it is checked; a refused value's bytes
are overwritten when vLLM recomputes the block. Saves: the blocks are
gathered into staging rows and put from there (``staging_save.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_aio.backends import Backend, Status
from vllm_aio.connector.block_io.base import Loaded, chunks
from vllm_aio.connector.block_io.blocks import BlockRef, DistinctBlocks
from vllm_aio.connector.block_io.labels import ValueLabels, check_headers
from vllm_aio.connector.block_io.staging_save import Copied, SavesThroughStaging
from vllm_aio.connector.block_layout import BlockLayout
from vllm_aio.connector.staging import Slice, StagingBuffer
from vllm_aio.device import Device
from vllm_aio.pool.entry import HEADER_BYTES
from vllm_aio.pool.keys import Unit


class HostCachePath(SavesThroughStaging):
    def __init__(
        self, labels: ValueLabels, device: Device, layout: BlockLayout, backend: Backend,
        load_staging: StagingBuffer, save_staging: StagingBuffer, timeout: float,
    ) -> None:
        super().__init__(labels, device, backend, save_staging, timeout)
        self._layout = layout
        self._backend = backend
        self._headers = load_staging
        self._timeout = timeout

    def _load(self, batch: DistinctBlocks, unit: Unit, labels: ValueLabels) -> Loaded:
        statuses: list[Status] = []
        for start, end in chunks(len(batch.firsts), labels.value_bytes(unit)):
            piece = self._headers.allocate((end - start) * HEADER_BYTES, self._timeout)
            if piece is None:  # no staging within the timeout
                statuses += [Status.ERROR] * (end - start)
                continue
            try:
                statuses += self._load_chunk(batch.firsts[start:end], batch.targets[start:end], unit, labels, piece)
            finally:
                self._headers.release(piece)
        return Loaded(batch.spread(statuses))

    def _load_chunk(
        self, blocks: Sequence[BlockRef], targets: Sequence[list[int]], unit: Unit, labels: ValueLabels,
        piece: Slice,
    ) -> list[Status]:
        segments = [
            [(piece.address + i * HEADER_BYTES, HEADER_BYTES)] + self._layout.segments(b.block_id, unit.layers)
            for i, b in enumerate(blocks)
        ]
        statuses = self._backend.batch_get(labels.keys(blocks, unit), segments)
        statuses = check_headers(piece.tensor.view(len(blocks), HEADER_BYTES), labels.headers(blocks, unit), statuses)
        # Blocks sharing a key get the bytes of the one the pool wrote into.
        copies = [(b.block_id, dst) for b, t, s in zip(blocks, targets, statuses) if s is Status.OK for dst in t[1:]]
        if copies:
            src, dst = zip(*copies)
            self._layout.copy_blocks(torch.tensor(src), torch.tensor(dst), unit.layers)
        return statuses

    def _copy_out(self, blocks: Sequence[BlockRef], unit: Unit, computed: torch.Event | None, piece: Slice) -> Copied:
        """The hooks run after the forward's writes in program order: ``computed`` is passed already."""
        rows = piece.tensor.view(len(blocks), -1)
        self._layout.gather(torch.tensor([b.block_id for b in blocks]), unit.layers, rows[:, HEADER_BYTES:])
        return Copied(blocks, unit, piece, None, None)
