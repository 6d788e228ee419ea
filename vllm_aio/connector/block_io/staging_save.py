"""A save through a staging buffer, shared by the host cache path and the staged path.

The blocks are copied out of the cache into staging chunk by chunk (how is
the path's ``CopyOut``), ``CopyHandoff`` tells the forward thread the cache
blocks may be reused, and the pool put runs from staging. Chunks already
copied out are put as staging runs short, the rest once every block is out,
each as soon as its own copy into staging is done: on an accelerator the
copies of later chunks run on meanwhile (``staged.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_aio.backends import Backend, Status
from vllm_aio.connector.block_io.base import CopyHandoff, chunks
from vllm_aio.connector.block_io.blocks import BlockRef
from vllm_aio.connector.block_io.labels import ValueLabels
from vllm_aio.connector.staging import Slice, StagingBuffer
from vllm_aio.device import Device
from vllm_aio.pool.entry import HEADER_BYTES
from vllm_aio.pool.keys import Unit


@dataclass
class Copied:
    """A chunk of a save, out of the cache (``gathered``) and on its way to staging."""

    blocks: Sequence[BlockRef]
    unit: Unit
    piece: Slice
    gathered: torch.Event | None  # after this the cache blocks may be reused
    in_staging: torch.Event | None  # after this the staging rows hold the values
    source: torch.Tensor | None = None  # device bytes the copy into staging reads: kept until ``in_staging``


# Copies the payloads of (blocks, unit), once ``computed`` has passed, into the rows of a staging slice.
CopyOut = Callable[[Sequence[BlockRef], Unit, "torch.Event | None", Slice], Copied]


class StagingSave:
    def __init__(self, backend: Backend, staging: StagingBuffer, timeout: float, copy_out: CopyOut) -> None:
        self._backend = backend
        self._staging = staging
        self._timeout = timeout
        self._copy_out = copy_out

    def save(
        self, blocks: Sequence[BlockRef], unit: Unit, labels: ValueLabels, computed: torch.Event | None,
        handoff: CopyHandoff, retention: int,
    ) -> list[Status]:
        """``BlockIO._save`` of blocks with distinct keys, through staging."""
        statuses: list[Status] = []
        pending: deque[Copied] = deque()
        value = labels.value_bytes(unit)
        try:
            for start, end in chunks(len(blocks), value):
                piece = self._slice((end - start) * value, pending, statuses, labels, handoff, retention)
                if piece is None or not handoff.held():
                    if piece is not None:
                        self._staging.release(piece)
                    break
                pending.append(self._copy_out(blocks[start:end], unit, computed, piece))
                computed = None  # later chunks follow on the same stream
            if pending:  # the last gather also covers the earlier ones (stream order)
                Device.synchronize(pending[-1].gathered)
        finally:
            keep = handoff.copied()
        while pending:
            statuses += self._put(pending.popleft(), labels, keep, retention)
        return statuses + [Status.NO_SPACE if keep else Status.ERROR] * (len(blocks) - len(statuses))

    def _slice(
        self, nbytes: int, pending: deque[Copied], statuses: list[Status], labels: ValueLabels,
        handoff: CopyHandoff, retention: int,
    ) -> Slice | None:
        """Staging for the next chunk; puts earlier chunks of this save to make room."""
        while (piece := self._staging.allocate(nbytes, 0)) is None and pending:
            oldest = pending.popleft()
            Device.synchronize(oldest.gathered)
            statuses += self._put(oldest, labels, handoff.held(), retention)
        return piece or self._staging.allocate(nbytes, self._timeout)

    def _put(self, chunk: Copied, labels: ValueLabels, keep: bool, retention: int) -> list[Status]:
        """Pool put of one copied chunk, unless its copy may be torn (``keep`` False)."""
        n = len(chunk.blocks)
        try:
            # Even a chunk never put: its rows (and its device source) are given back only
            # once the copy into them is over, or the next slice there could be overwritten.
            Device.synchronize(chunk.in_staging)
            if not keep:
                return [Status.ERROR] * n
            rows = chunk.piece.tensor.view(n, -1)
            headers = bytearray(b"".join(labels.headers(chunk.blocks, chunk.unit)))
            rows[:, :HEADER_BYTES] = torch.frombuffer(headers, dtype=torch.uint8).view(n, HEADER_BYTES)
            value = rows.shape[1]
            segments = [[(chunk.piece.address + i * value, value)] for i in range(n)]
            return self._backend.batch_put(labels.keys(chunk.blocks, chunk.unit), segments, retention)
        finally:
            self._staging.release(chunk.piece)
