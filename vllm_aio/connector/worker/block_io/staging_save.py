"""A save through a staging buffer, shared by the in-place path and the staged path.

The blocks are copied out of the cache into staging chunk by chunk (how is
the path's ``CopyOut``) on the calling thread, the worker's sending thread;
``CopyHandoff`` tells the forward thread the cache blocks may be reused once
every chunk is out. Each chunk is put into the pool from staging on a thread
of its own, the put thread, as soon as its copy into staging is done: the
next step's copies never queue behind this step's puts (on an accelerator the
copies of later chunks run on meanwhile, ``staged.py``). When staging is full
of chunks that earlier saves have not put yet, the rest of the save is
dropped (``Status.DROPPED``): a save that cannot keep up is never waited for.
A save larger than the staging buffer waits (bounded) only where its own
earlier chunks hold the staging it needs.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_aio.backends import Backend, Status
from vllm_aio.connector.worker.block_io.base import BlockIO, CopyHandoff, chunks
from vllm_aio.connector.worker.block_io.blocks import BlockRef
from vllm_aio.connector.worker.block_io.labels import ValueLabels
from vllm_aio.connector.worker.transfer import TransferThread
from vllm_aio.device.accelerator import Device
from vllm_aio.device.staging import Slice, StagingBuffer
from vllm_aio.log import get_logger
from vllm_aio.pool.entry import HEADER_BYTES
from vllm_aio.pool.keys import Unit

logger = get_logger(__name__)


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
    def __init__(self, backend: Backend, staging: StagingBuffer, timeout: float, copy_out: CopyOut,
                 device: Device) -> None:
        self._backend = backend
        self._device = device  # the put thread waits on its events and, device-direct, puts from its memory
        self._staging = staging
        self._timeout = timeout
        self._copy_out = copy_out
        self._puts = TransferThread("vllm_aio-put")
        self._raised = False  # a put raised: logged once

    def save(
        self, blocks: Sequence[BlockRef], unit: Unit, labels: ValueLabels, computed: torch.Event | None,
        handoff: CopyHandoff, retention: int, done: Callable[[list[Status]], None],
    ) -> None:
        """``BlockIO._save`` of blocks with distinct keys, through staging: returns once they are out of
        the cache; the put thread puts them and calls ``done``."""
        results: list[list[Status]] = []  # each chunk's statuses, in order, appended by the put thread
        value = labels.value_bytes(unit)
        rest = Status.ERROR  # of blocks never copied: the forward thread stopped waiting
        last: Copied | None = None
        try:
            for start, end in chunks(len(blocks), value):
                # Staging that this save's own earlier chunks hold frees up as they are put: worth a
                # bounded wait. Staging that only earlier saves hold: this save cannot keep up.
                piece = self._staging.allocate((end - start) * value, self._timeout if last else 0)
                if piece is None:
                    rest = Status.DROPPED
                    break
                if not handoff.held():
                    self._staging.release(piece)
                    break
                last = self._copy_out(blocks[start:end], unit, computed, piece)
                computed = None  # later chunks follow on the same stream
                self._puts.submit(self._put, last, labels, handoff, retention, results)
            if last is not None:  # the last gather also covers the earlier ones (stream order)
                Device.synchronize(last.gathered)
        finally:
            handoff.copied()
        self._puts.submit(lambda: done([s for chunk in results for s in chunk]
                                       + [rest] * (len(blocks) - sum(map(len, results)))))

    def drain(self) -> None:
        self._puts.drain()

    def close(self) -> None:
        self._puts.close()

    def _put(self, chunk: Copied, labels: ValueLabels, handoff: CopyHandoff, retention: int,
             results: list[list[Status]]) -> None:
        """On the put thread: one copied chunk into the pool, unless its copy may be torn."""
        n = len(chunk.blocks)
        statuses = [Status.ERROR] * n
        try:
            self._device.bind_thread()
            # Even a chunk never put: its rows (and its device source) are given back only
            # once the copy into them is over, or the next slice there could be overwritten.
            Device.synchronize(chunk.in_staging)
            # Held now, after its copy: the copy read the blocks before vLLM could reuse them.
            if handoff.held():
                rows = chunk.piece.tensor.view(n, -1)
                headers = bytearray(b"".join(labels.headers(chunk.blocks, chunk.unit)))
                rows[:, :HEADER_BYTES] = torch.frombuffer(headers, dtype=torch.uint8).view(n, HEADER_BYTES)
                value = rows.shape[1]
                segments = [[(chunk.piece.address + i * value, value)] for i in range(n)]
                statuses = self._backend.batch_put(labels.keys(chunk.blocks, chunk.unit), segments, retention)
        except Exception as exc:  # the store unusable (closed, gone): its blocks count as failed saves
            if not self._raised:
                self._raised = True
                logger.warning("vllm_aio: pool put raised (%s); later such saves are only counted", exc)
        finally:
            self._staging.release(chunk.piece)
            results.append(statuses)


class SavesThroughStaging(BlockIO):
    """A path whose saves go through staging (``StagingSave``): the in-place path and the staged path,
    each with its own ``_copy_out``."""

    def __init__(self, labels: ValueLabels, device: Device, backend: Backend, save_staging: StagingBuffer,
                 timeout: float) -> None:
        super().__init__(labels, device)
        self._saves = StagingSave(backend, save_staging, timeout, self._copy_out, device)

    @abstractmethod
    def _copy_out(self, blocks: Sequence[BlockRef], unit: Unit, computed: torch.Event | None, piece: Slice) -> Copied:
        """Copies the payloads of (blocks, unit), once ``computed`` has passed, into the rows of ``piece``."""

    def _save(
        self, blocks: Sequence[BlockRef], unit: Unit, labels: ValueLabels, computed: torch.Event | None,
        handoff: CopyHandoff, retention: int, done: Callable[[list[Status]], None],
    ) -> None:
        self._saves.save(blocks, unit, labels, computed, handoff, retention, done)

    def drain(self) -> None:
        self._saves.drain()

    def close(self) -> None:
        self._saves.close()
