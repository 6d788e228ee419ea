"""How a worker loads pool blocks into vLLM's KV cache: one strategy, chosen at start.

* ``BeforeForward`` (whole-block values): the step's loads run in
  ``start_load_kv``, before the forward; the compute stream waits for the copies.
* ``BeforeBuffer`` (with the dynamic buffer): the same, but when vLLM binds the
  step's metadata, because the buffer fills its first layers from the host
  copy right after and the loaded blocks must be there first.
* ``Layerwise``: a *retrieve* generator queues layer 0 (plus
  ``layerwise_prefetch_layers``) on the receiving thread; each
  ``wait_for_layer(i)`` waits for layer i alone and queues the next, so layer
  i+1 arrives while layer i computes. A layer past ``transfer_timeout`` fails
  the whole step's loads at once (not layer by layer).
* ``InBackground`` (``transfer_mode: async``): whole prefixes load on the receiving thread
  while vLLM keeps the requests waiting; ``finished`` reports them.

Every outcome goes to ``LoadReport``: blocks that could not be loaded (missing,
evicted mid-read, short, foreign header, pool down, too slow) are reported to
vLLM through ``get_block_ids_with_load_errors``, which recomputes them with
``kv_load_failure_policy: recompute``, and logged once per request and step.
A load's outcome is settled there, at the end of the step, once its copies
are done: a direct copy from pool slots learns only then whether a slot was
rewritten under it (vLLM then discards the request's output of that step).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from vllm_aio.backends import Status
from vllm_aio.connector.worker.block_io import Batch, BlockIO, BlockRef, DistinctBlocks, Loaded
from vllm_aio.connector.worker.transfer import TransferThread
from vllm_aio.log import get_logger
from vllm_aio.pool.keys import Unit
from vllm_aio.pool.ownership import Ownership
from vllm_aio.shared.metadata import AioConnectorMetadata, BlockTransfer

logger = get_logger(__name__)

AddStats = Callable[..., None]


@dataclass(frozen=True)
class StepLoads:
    """A step's loads so far, as the saves of that step see them.

    A request that read a block whose load failed (its own load's, or one it
    shares through vLLM's prefix cache) ran its forward over KV it did not
    get: what it computed in that step is wrong. vLLM discards that output
    and recomputes, but a save of that KV would serve it to every later
    request with the prefix. A direct copy learns of a torn slot only once the
    copy is done, so ``failed_blocks`` is asked on the sending thread, after
    the compute that waited for the copies.
    """

    recorded: frozenset[int] = frozenset()  # block ids failed already: timeouts, pool errors
    loads: tuple[tuple[list[BlockRef], Loaded], ...] = ()  # per load: its blocks and their outcome

    def failed_blocks(self) -> set[int]:
        failed = set(self.recorded)
        for blocks, loaded in self.loads:
            failed.update(b.block_id for b, status in zip(blocks, loaded.settle()) if status is not Status.OK)
        return failed


@dataclass
class _Load:
    batch: Batch
    unit: Unit
    future: "Future[Loaded]"
    started: float


class LoadReport:
    """Failed blocks per request, reported to vLLM and logged once per step; load stats."""

    def __init__(self, io: BlockIO, last_unit: Unit, add_stats: AddStats) -> None:
        self._io = io
        self._last_unit = last_unit
        self._add_stats = add_stats
        self._failed: dict[str, Counter[str]] = {}
        self._errors: set[int] = set()
        # Failed blocks of this step already reported to vLLM: the step's saves still ask for them
        # (vLLM 0.33's model runner V2 with a drafter takes load errors before wait_for_save).
        self._reported: set[int] = set()
        self._unsettled: list[tuple[Batch, Unit, Loaded]] = []

    def begin_step(self) -> None:
        """A new step: failures reported in earlier steps concern none of its saves."""
        self._reported = set()

    def finish(self, batch: Batch, unit: Unit, loaded: Loaded, started: float) -> None:
        """The load's copies are enqueued (the caller's stream waits on them); settled at ``take_errors``."""
        self._add_stats(load_seconds=time.perf_counter() - started)
        self._unsettled.append((batch, unit, loaded))

    def fail(self, batch: Batch, reason: str) -> None:
        for block, req_id in zip(batch.blocks, batch.req_ids):
            self._record(req_id, block.block_id, reason)

    def step_loads(self) -> StepLoads:
        """The loads of the step so far (settled at the step's end, ``take_errors``)."""
        return StepLoads(frozenset(self._errors | self._reported), tuple((batch.blocks, loaded) for batch, _, loaded in self._unsettled))

    def pool_failed(self, exc: Exception, batch: Batch) -> Loaded:
        logger.warning("vllm_aio: pool load failed: %s", exc)
        return Loaded([Status.ERROR] * len(batch.blocks))

    def take_errors(self) -> set[int]:
        """The step's failed block ids (after every load of the step has settled); logs them."""
        return self._take("them")[0]

    def take_failed_requests(self) -> set[str]:
        """The requests with a failed block (after every load so far has settled); logs them.

        For hybrid models: vLLM 0.32 cannot map block ids of several KV cache
        groups back to requests, and recomputes a request reported failed whole.
        """
        return set(self._take("the whole request")[1])

    def _take(self, recomputed: str) -> tuple[set[int], dict[str, Counter[str]]]:
        self._settle()
        for req_id, reasons in self._failed.items():
            logger.warning(
                "vllm_aio: request %s: %d pool blocks could not be loaded (%s); vLLM recomputes %s, "
                "and nothing the request computed in that step is stored",
                req_id,
                sum(reasons.values()),
                ", ".join(f"{n} {r}" for r, n in sorted(reasons.items())),
                recomputed,
            )
        if self._errors:  # a step that loaded nothing takes no lock
            self._add_stats(load_failures=len(self._errors))
        self._reported |= self._errors
        taken = self._errors, self._failed
        self._errors, self._failed = set(), {}
        return taken

    def _settle(self) -> None:
        unsettled, self._unsettled = self._unsettled, []
        for batch, unit, loaded in unsettled:
            ok = 0
            for block, req_id, status in zip(batch.blocks, batch.req_ids, loaded.settle()):
                if status is Status.OK:
                    ok += 1
                else:
                    self._record(req_id, block.block_id, status.value)
            self._add_stats(load_blocks=ok if unit is self._last_unit else 0, load_bytes=ok * self._io.value_bytes(unit))

    def _record(self, req_id: str, block_id: int, reason: str) -> None:
        if block_id not in self._errors:
            self._errors.add(block_id)
            self._failed.setdefault(req_id, Counter())[reason] += 1


class Loads:
    """The strategy interface; the base loads nothing at any hook."""

    def __init__(
        self, io: BlockIO, owner: Ownership, units: list[Unit], recv: TransferThread, report: LoadReport,
        timeout: float,
    ) -> None:
        self._io = io
        self._owner = owner
        self._units = units
        self._recv = recv
        self._report = report
        self._timeout = timeout

    def begin_step(self, meta: AioConnectorMetadata) -> None:
        """vLLM bound the step's metadata (before every forward)."""

    def start(self, meta: AioConnectorMetadata) -> None:
        """``start_load_kv``."""

    def wait_for_layer(self, layer_name: str) -> None:
        """Before the layer's attention reads its KV."""

    def finished(self) -> set[str]:
        """Requests whose background load ended (with or without errors)."""
        return set()

    def _batch(self, transfers: list[BlockTransfer]) -> Batch:
        # Every rank loads its shard of every block; replicas of a shard start
        # at different blocks so they do not all hit the same values at once.
        batch = Batch([], [])
        for t in transfers:
            for i in self._owner.read_order(range(len(t))):
                batch.blocks.append(BlockRef(t.block_ids[i], t.block_hash(i)))
                batch.req_ids.append(t.req_id)
        return batch

    def _submit(self, batch: Batch, unit: Unit, prepared: DistinctBlocks | None = None) -> _Load:
        blocks = batch.blocks if prepared is None else prepared
        return _Load(batch, unit, self._recv.submit(self._io.load, blocks, unit), time.perf_counter())

    def _load_now(self, meta: AioConnectorMetadata) -> None:
        if not meta.loads:
            return
        batch, unit, started = self._batch(meta.loads), self._units[0], time.perf_counter()
        try:
            loaded = self._io.load(batch.blocks, unit)
            self._io.device.wait(loaded.copied)  # the forward runs after the copies
        except Exception as exc:
            loaded = self._report.pool_failed(exc, batch)
        self._report.finish(batch, unit, loaded, started)


class BeforeForward(Loads):
    def start(self, meta: AioConnectorMetadata) -> None:
        self._load_now(meta)


class BeforeBuffer(Loads):
    def begin_step(self, meta: AioConnectorMetadata) -> None:
        if meta.buffer is not None:
            self._load_now(meta)


class InBackground(Loads):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._loads: dict[str, _Load] = {}

    def start(self, meta: AioConnectorMetadata) -> None:
        per_request: dict[str, list[BlockTransfer]] = {}  # a hybrid model's request loads one transfer per group
        for transfer in meta.loads:
            per_request.setdefault(transfer.req_id, []).append(transfer)
        for req_id, transfers in per_request.items():
            self._loads[req_id] = self._submit(self._batch(transfers), self._units[0])

    def finished(self) -> set[str]:
        done = set()
        for req_id, load in list(self._loads.items()):
            if not load.future.done():
                continue
            try:
                loaded = load.future.result()
                if not self._io.device.completed(loaded.copied):
                    continue  # still on its way to the device
            except Exception as exc:
                loaded = self._report.pool_failed(exc, load.batch)
            del self._loads[req_id]
            self._report.finish(load.batch, load.unit, loaded, load.started)
            done.add(req_id)
        return done


class Layerwise(Loads):
    def __init__(self, *args, layer_names: list[str], prefetch: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._unit_of_layer = dict(zip(layer_names, self._units))
        self._prefetch = prefetch
        # This step's state, reset by start (forward thread only).
        self._loads: dict[int, _Load] = {}
        self._retrieve: Iterator[_Load] | None = None
        self._stalled = False  # a load of this step overran transfer_timeout

    def start(self, meta: AioConnectorMetadata) -> None:
        if self._stalled:  # late copies of a timed-out step must not race this one
            self._recv.drain()
            self._stalled = False
        self._loads.clear()
        self._retrieve = self._retrieve_layers(self._batch(meta.loads)) if meta.loads else None
        for _ in range(1 + self._prefetch):
            self._advance()

    def wait_for_layer(self, layer_name: str) -> None:
        unit = self._unit_of_layer.get(layer_name)
        load = self._take(unit) if unit is not None else None
        if load is None:
            return
        if self._stalled:  # an earlier layer timed out: the whole step is being recomputed
            self._report.fail(load.batch, "timeout")
            return
        try:
            loaded = load.future.result(timeout=self._timeout)
            self._io.device.wait(loaded.copied)  # this layer's attention runs after its copies
        except FutureTimeout:
            self._stalled = True
            logger.warning(
                "vllm_aio: layer %d load exceeded transfer_timeout=%.1fs; this step's pool blocks are recomputed",
                unit.tag,
                self._timeout,
            )
            self._report.fail(load.batch, "timeout")
            return
        except Exception as exc:
            loaded = self._report.pool_failed(exc, load.batch)
        self._report.finish(load.batch, unit, loaded, load.started)

    def _retrieve_layers(self, batch: Batch) -> Iterator[_Load]:
        """Queues one layer's load each time it is advanced."""
        prepared = self._io.prepare(batch.blocks)  # once: every layer loads the same blocks
        for unit in self._units:
            yield self._submit(batch, unit, prepared)

    def _advance(self) -> bool:
        load = next(self._retrieve, None) if self._retrieve else None
        if load is not None:
            self._loads[load.unit.tag] = load
        return load is not None

    def _take(self, unit: Unit) -> _Load | None:
        while unit.tag not in self._loads:
            if not self._advance():
                return None
        load = self._loads.pop(unit.tag)
        self._advance()  # keep the prefetch window full
        return load
