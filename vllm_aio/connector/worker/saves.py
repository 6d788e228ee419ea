"""How a worker saves the blocks a step filled: one strategy, chosen at start.

* ``WholeBlockSaves``: in ``wait_for_save`` every layer of the step's blocks
  is handed to the sending thread as one value per block.
* ``LayerwiseSaves``: a *store* generator hands layer i's blocks to the
  sending thread right after the layer's attention (``after_layer``).

Either way the forward thread then waits (bounded by ``transfer_timeout``)
until the sending thread has copied the step's blocks out of the cache, so
vLLM may free or reuse them. Where the model runner opens every step with
``handle_preemptions`` (vLLM's GPU and CPU runners: before it zeroes, copies
or writes any block), that wait is there, at the next step's start, and
``wait_for_save`` returns at once: the step that computed a prompt hands back
its token while its blocks are still being copied out. Until a runner is seen
calling it, ``wait_for_save`` waits. The pool puts go on in the background
from staging, on a thread of their own (``block_io/staging_save.py``), and a
save they cannot keep up with is dropped, not waited for. A failed or dropped
save is counted and logged once per kind; the request goes on.

A request that read a block whose load failed in the step computed wrong KV
there (``StepLoads``): its blocks of that step are left out of the save, and
vLLM's recompute saves them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Generator, Sequence

import torch

from vllm_aio.backends import Status
from vllm_aio.connector.worker.block_io import Batch, BlockIO, BlockRef, CopyHandoff
from vllm_aio.connector.events import SettledSaves
from vllm_aio.connector.worker.loads import StepLoads
from vllm_aio.connector.worker.transfer import TransferThread
from vllm_aio.log import get_logger
from vllm_aio.pool.keys import Unit
from vllm_aio.pool.ownership import Ownership
from vllm_aio.shared.metadata import AioConnectorMetadata, BlockTransfer

logger = get_logger(__name__)


class Saves:
    """The strategy interface and the sending-thread work both strategies share."""

    def __init__(
        self, io: BlockIO, owner: Ownership, units: list[Unit], send: TransferThread,
        add_stats: Callable[..., None], timeout: float, step_loads: Callable[[], StepLoads],
        settled: SettledSaves | None = None,
    ) -> None:
        """``step_loads``: the step's loads so far (a request that read a failed one saves nothing)."""
        self._io = io
        self._owner = owner
        self._units = units
        self._send = send
        self._add_stats = add_stats
        self._timeout = timeout
        self._step_loads = step_loads
        self._settled = settled  # with KV events: what this rank's saves left in the pool
        self._handoffs: list[CopyHandoff] = []  # not waited for yet, forward thread only
        self._runner_opens_steps = False  # handle_preemptions seen: the copies are waited for at the next step
        self._failures_logged: set[Status] = set()

    def after_layer(self, layer_name: str, meta: AioConnectorMetadata) -> None:
        """Right after the layer's attention wrote its KV."""

    def open_step(self) -> None:
        """``handle_preemptions``, first in the step: returns once the previous steps' blocks are
        out of the cache (this step may zero or write them)."""
        self._runner_opens_steps = True
        self._wait_copied()

    def end_step(self, meta: AioConnectorMetadata) -> None:
        """``wait_for_save``: returns once the step's blocks are out of the cache, or at once where
        the next step's ``open_step`` waits for that."""
        if not self._runner_opens_steps:
            self._wait_copied()

    def rescue(self, transfers: list[BlockTransfer]) -> None:
        """Every unit of these blocks handed to the sending thread at once; returns
        once they are out of the cache (vLLM gives them to other requests now)."""
        for batch in self._batches(transfers):
            for unit in self._units:
                self._submit(batch, unit, StepLoads())  # computed in earlier steps
        self._wait_copied()

    def _wait_copied(self) -> None:
        deadline = time.monotonic() + self._timeout
        handoffs, self._handoffs = self._handoffs, []
        for handoff in handoffs:
            if not handoff.wait(max(0.0, deadline - time.monotonic())):
                self._log_failure(Status.ERROR, f"copy out of the KV cache exceeded transfer_timeout="
                                  f"{self._timeout}s, save abandoned")

    def _batches(self, transfers: list[BlockTransfer]) -> list[Batch]:
        """This rank's blocks of the transfers, one batch per retention class."""
        batches: dict[int, Batch] = {}
        for t in transfers:
            batch = batches.setdefault(t.retention, Batch([], [], t.retention))
            first = t.first_index
            for i in self._owner.owned_blocks(range(first, first + len(t))):
                batch.blocks.append(BlockRef(t.block_ids[i - first], t.block_hash(i - first)))
                batch.req_ids.append(t.req_id)
            if t.reads:
                batch.reads[t.req_id] = t.reads
        return [batches[r] for r in sorted(batches)]

    def _submit(self, batch: Batch, unit: Unit, loads: StepLoads | None = None) -> None:
        if not batch.blocks:
            return
        handoff = CopyHandoff()
        computed = self._io.device.record()  # after this layer's attention wrote its KV
        loads = self._step_loads() if loads is None else loads
        self._send.submit(self._save, batch, unit, computed, handoff, loads)
        self._handoffs.append(handoff)

    def _save(self, batch: Batch, unit: Unit, computed: torch.Event | None, handoff: CopyHandoff,
              loads: StepLoads) -> None:
        """Runs on the sending thread: the copy out of the cache. ``_saved`` follows once the
        statuses are in (through staging: from the put thread, after the pool puts)."""
        started = time.perf_counter()
        try:
            wrong = _read_failed_loads(batch, loads)
            kept = [i for i, req_id in enumerate(batch.req_ids) if req_id not in wrong]
            if not kept:
                handoff.copied()  # nothing to copy out of the cache
                self._saved(batch, unit, handoff.copied_at - started, kept, [])
                return
            self._io.begin_save([batch.blocks[i] for i in kept], unit, computed, handoff, batch.retention,
                                lambda got: self._saved(batch, unit, handoff.copied_at - started, kept, got))
        except Exception as exc:
            self._log_failure(Status.ERROR, str(exc))
            self._saved(batch, unit, time.perf_counter() - started, range(len(batch.blocks)), [])  # every block failed

    def _saved(self, batch: Batch, unit: Unit, copy_seconds: float, kept: Sequence[int], got: list[Status]) -> None:
        """The statuses of the kept blocks are in: counted, logged, settled. ``copy_seconds``: from the
        save's start until its blocks were out of the cache (``CopyHandoff.copied_at``)."""
        statuses = [Status.ERROR] * len(batch.blocks)  # a block not kept was computed wrongly: not stored
        for i, status in zip(kept, got):
            statuses[i] = status
        counts = Counter(statuses[i] for i in kept)
        for status in (Status.NO_SPACE, Status.ERROR):
            if counts[status]:
                self._log_failure(status, f"{counts[status]} blocks")
        if counts[Status.DROPPED]:
            self._log_failure(Status.DROPPED, f"{counts[Status.DROPPED]} blocks not offered to the pool: the "
                              "puts of earlier saves still held the staging buffer")
        last = unit is self._units[-1]
        if self._settled is not None:
            self._settle(batch, statuses, last)
        self._add_stats(
            save_blocks=counts[Status.OK] if last else 0,
            save_bytes=counts[Status.OK] * self._io.value_bytes(unit),
            save_seconds=copy_seconds,
            save_already_stored=counts[Status.EXISTS] if last else 0,
            save_failures=counts[Status.NO_SPACE] + counts[Status.ERROR],
            save_dropped=counts[Status.DROPPED],
        )

    def _settle(self, batch: Batch, statuses: list[Status], last: bool) -> None:
        """A block is settled once its last unit was saved, and stored if every unit of it was."""
        batch.unsaved.update(i for i, status in enumerate(statuses) if not status.stored)
        if last:
            self._settled.add([b.block_hash for b in batch.blocks],
                              [i not in batch.unsaved for i in range(len(batch.blocks))])

    def _log_failure(self, status: Status, detail: str) -> None:
        if status in self._failures_logged:
            return
        self._failures_logged.add(status)
        logger.warning(
            "vllm_aio: pool save failed (%s: %s); requests continue, later failures of this "
            "kind are only counted in the KV Transfer metrics",
            status.value,
            detail,
        )


def _read_failed_loads(batch: Batch, loads: StepLoads) -> set[str]:
    """The batch's requests that read a block whose load failed in this step."""
    if not batch.reads:  # the usual step: nothing loaded that a save depends on
        return set()
    failed = loads.failed_blocks()
    return {req_id for req_id, reads in batch.reads.items() if not failed.isdisjoint(reads)}


class WholeBlockSaves(Saves):
    def end_step(self, meta: AioConnectorMetadata) -> None:
        for batch in self._batches(meta.saves):
            self._submit(batch, self._units[0])
        super().end_step(meta)


class LayerwiseSaves(Saves):
    def __init__(self, *args, layer_names: list[str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._unit_of_layer = dict(zip(layer_names, self._units))
        self._store: Generator[None, Unit, None] | None = None  # this step's

    def after_layer(self, layer_name: str, meta: AioConnectorMetadata) -> None:
        unit = self._unit_of_layer.get(layer_name)
        if unit is None or not meta.saves:
            return
        if self._store is None:
            self._store = self._store_layers(self._batches(meta.saves))
            next(self._store)
        self._store.send(unit)

    def end_step(self, meta: AioConnectorMetadata) -> None:
        self._store = None
        super().end_step(meta)

    def _store_layers(self, batches: list[Batch]) -> Generator[None, Unit, None]:
        """Hands the step's blocks of each layer it is sent to the sending thread."""
        while True:
            unit = yield
            for batch in batches:
                self._submit(batch, unit)
