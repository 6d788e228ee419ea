"""The direct path: values move straight between the pool's slots and the KV cache.

Where the backend keeps values in slots of a host mapping the device can map
(the embedded pool, on the CPU and on CUDA), there is no staging: one gather
kernel per chunk reads the slots, one scatter writes them
(``connector/worker/block_io/mapped_slots.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from vllm_aio.backends import Status
from vllm_aio.connector.worker.block_io.base import BlockIO, CopyHandoff, Loaded, chunks
from vllm_aio.connector.worker.block_io.blocks import BlockRef, DistinctBlocks
from vllm_aio.connector.worker.block_io.labels import ValueLabels
from vllm_aio.connector.worker.block_io.mapped_slots import MappedSlots, SlotLoad
from vllm_aio.device.accelerator import Device
from vllm_aio.pool.host_pool import SLOT_STORED
from vllm_aio.pool.keys import Unit

# The direct path's chunks are larger (device scratch only, no staging): each
# launches one scatter or gather per layer plane, and chunks of ``_CHUNK_BYTES``
# left the host launching rather than the link copying. Two chunks in flight
# keep the gather of one behind the scatter of the other.
_DIRECT_CHUNKS = 4  # x _CHUNK_BYTES


class DirectPath(BlockIO):
    direct = True

    def __init__(self, labels: ValueLabels, device: Device, slots: MappedSlots) -> None:
        super().__init__(labels, device)
        self._slots = slots
        self._stream = device.new_stream()

    def close(self) -> None:
        """Unmap what the device mapped; before the backend closes."""
        self._slots.close()

    def warm_up(self, layer_sets: Iterable[Sequence[int]]) -> None:
        self._slots.warm_up(layer_sets)

    def _load(self, batch: DistinctBlocks, unit: Unit, labels: ValueLabels) -> Loaded:
        statuses: list[Status] = []
        copies: list[tuple[int, SlotLoad]] = []  # (chunk start, its copy)
        with self.device.on(self._stream):
            for start, end in chunks(len(batch.firsts), labels.value_bytes(unit), _DIRECT_CHUNKS):
                plan = batch.plans.get((start, end))
                if plan is None:
                    plan = batch.plans[(start, end)] = self._slots.plan(
                        [b.block_hash for b in batch.firsts[start:end]], batch.targets[start:end]
                    )
                got, copy = self._slots.load(plan, labels.namespace_digest, labels.shard, unit, labels.fixed(unit))
                statuses += got
                copies.append((start, copy))
        # Each chunk's event follows its scatter, on one stream: the last covers them all.
        event = next((copy.event for _, copy in reversed(copies) if copy.event is not None), None)

        def settle() -> list[Status]:
            for start, copy in copies:
                for position in copy.torn(self._slots.store):
                    statuses[start + position] = Status.CORRUPT
            return batch.spread(statuses)

        return Loaded(batch.spread(statuses), event, settle)

    def _save(
        self, blocks: Sequence[BlockRef], unit: Unit, labels: ValueLabels, computed: torch.Event | None,
        handoff: CopyHandoff, retention: int, done: Callable[[list[Status]], None],
    ) -> None:
        """Straight into reserved pool slots; ``done`` is called before this returns.

        ``handoff`` is told once the last gather out of the cache is done; the
        slots are published once the payload copies into them are too.
        """
        statuses: list[Status] = []
        filled: list[tuple[list[int], np.ndarray, list[BlockRef]]] = []  # per chunk: positions, slots, blocks
        gathered = written = None
        try:
            with self.device.on(self._stream):
                self.device.wait(computed, self._stream)
                for start, end in chunks(len(blocks), labels.value_bytes(unit), _DIRECT_CHUNKS):
                    if not handoff.held():
                        break
                    chunk = blocks[start:end]
                    slots = self._slots.reserve(labels.namespace_digest, labels.shard, unit,
                                                [b.block_hash for b in chunk], retention)
                    statuses += [Status.EXISTS if s == SLOT_STORED else Status.NO_SPACE for s in slots.tolist()]
                    fill = np.flatnonzero(slots >= 0)
                    if len(fill):
                        picked = [chunk[i] for i in fill.tolist()]
                        filled.append(((start + fill).tolist(), slots[fill], picked))
                        gathered = self._slots.copy_out([b.block_id for b in picked], slots[fill], unit.layers)
                written = self._slots.written()
            self.device.synchronize(gathered)  # the cache blocks may be reused from here on
        except BaseException:
            for _, slots, _ in filled:  # after the copies into them, whatever they reached
                self._slots.abandon(slots, self._slots.written())
            raise
        finally:
            keep = handoff.copied()
        for positions, slots, chunk in filled:
            if not keep:  # the bytes may be torn: never published
                self._slots.abandon(slots, written)
                for p in positions:
                    statuses[p] = Status.ERROR
                continue
            for p, stored in zip(positions, self._slots.publish(slots, labels.headers(chunk, unit), written)):
                statuses[p] = Status.OK if stored else Status.EXISTS
        done(statuses + [Status.ERROR] * (len(blocks) - len(statuses)))
