"""The staged path: an accelerator's KV cache and a pool without mapped slots (Mooncake, Memcache).

Loads (receiving thread, or the forward thread for synchronous loads): the
backend copies whole values into page-locked staging; the headers are
checked there, then one host-to-device copy and one on-device scatter per
plane move the accepted blocks, on the transfer stream. The caller gets the
stream's event and makes the compute stream wait on it; nobody blocks on the
copy. Chunk by chunk: the backend copies the next chunk into staging while
the one before crosses the link, so a load takes about its backend's copy
time when that is the longest stage.

Saves (sending thread): an on-device gather after the compute stream's event
for that layer, then a device-to-host copy into staging, from where the pool
put runs (``staging_save.py``). The gathers run on the transfer stream and the
copies into staging on a link stream of their own: the gathers (device memory
only) are soon all done, so the forward thread may reuse the cache blocks
while the copies still cross the link, and the pool put of one chunk overlaps
the copy of the next into staging. The price is device scratch: each chunk in
staging keeps its own until its copy is over, at most the save staging's size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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


class StagedPath(SavesThroughStaging):
    def __init__(
        self, labels: ValueLabels, device: Device, layout: BlockLayout, backend: Backend,
        load_staging: StagingBuffer, save_staging: StagingBuffer, timeout: float,
    ) -> None:
        super().__init__(labels, device, backend, save_staging, timeout)
        self._layout = layout
        self._backend = backend
        self._loads = load_staging
        self._timeout = timeout
        self._stream = device.new_stream()
        self._link = device.new_stream()  # a save's copies into staging, behind its gathers

    def warm_up(self, layer_sets: Iterable[Sequence[int]]) -> None:
        self._layout.warm_up(layer_sets)

    def _load(self, batch: DistinctBlocks, unit: Unit, labels: ValueLabels) -> Loaded:
        statuses: list[Status] = []
        event = None
        value = labels.value_bytes(unit)
        for start, end in chunks(len(batch.firsts), value):
            piece = self._loads.allocate((end - start) * value, self._timeout)
            if piece is None:  # no staging within the timeout
                statuses += [Status.ERROR] * (end - start)
                continue
            try:
                got, event = self._load_chunk(
                    batch.firsts[start:end], batch.targets[start:end], unit, labels, piece, event
                )
                statuses += got
            finally:
                self._loads.release(piece, after=event)
        return Loaded(batch.spread(statuses), event)

    def _load_chunk(
        self, blocks: Sequence[BlockRef], targets: Sequence[list[int]], unit: Unit, labels: ValueLabels,
        piece: Slice, event: torch.Event | None,
    ) -> tuple[list[Status], torch.Event | None]:
        n, value = len(blocks), labels.value_bytes(unit)
        rows = piece.tensor.view(n, value)
        segments = [[(piece.address + i * value, value)] for i in range(n)]
        statuses = self._backend.batch_get(labels.keys(blocks, unit), segments)
        statuses = check_headers(rows[:, :HEADER_BYTES], labels.headers(blocks, unit), statuses)
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
                scratch = scratch.index_select(0, self.device.indices(list(row_of)))
            self._layout.scatter(scratch[:, HEADER_BYTES:], self.device.indices(list(ids)), unit.layers)
            return statuses, self.device.record(self._stream)

    def _copy_out(self, blocks: Sequence[BlockRef], unit: Unit, computed: torch.Event | None, piece: Slice) -> Copied:
        """The gather on the transfer stream, the copy into staging behind it on the link stream.

        Each chunk gathers into a scratch of its own, kept until its copy into
        staging is over (``Copied.source``): the gathers do not wait for the link.
        """
        rows = piece.tensor.view(len(blocks), -1)
        with self.device.on(self._stream):
            self.device.wait(computed, self._stream)
            scratch = self.device.empty(rows.numel()).view(rows.shape)
            self._layout.gather(self.device.indices([b.block_id for b in blocks]), unit.layers,
                                scratch[:, HEADER_BYTES:])
            gathered = self.device.record(self._stream)
        with self.device.on(self._link):
            self.device.wait(gathered, self._link)
            rows.copy_(scratch, non_blocking=True)
            return Copied(blocks, unit, piece, gathered, self.device.record(self._link), scratch)
