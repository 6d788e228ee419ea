"""The worker half: moves KV bytes between vLLM's cache and the pool.

One instance per worker process, with one receiving and one sending thread
(``transfer.py``); the copies themselves are ``block_io.py``'s. vLLM drives it
through its hooks, in this order per step:

* ``start_load_kv``: before the forward when a request loads synchronously.
  Whole-block values load right here. With ``use_layerwise`` it only starts
  the *retrieve* generator: layer 0 (plus ``layerwise_prefetch_layers``) is
  queued on the receiving thread, and each ``wait_for_layer_load(i)`` waits
  for layer i alone and queues the next, so layer i+1 arrives while layer i
  computes. With ``load_async`` whole prefixes load in the background and
  ``get_finished`` reports them; vLLM keeps those requests waiting meanwhile.
* ``save_kv_layer(i)`` (layerwise): the *store* generator hands layer i's new
  full blocks to the sending thread right after the layer's attention.
* ``wait_for_save``: (whole-block values: hands every layer over now) waits
  until the sending thread has copied the step's blocks out of the cache; the
  pool puts go on in the background from staging.

Every wait is bounded by ``transfer_timeout``. A block that cannot be loaded
(missing, evicted mid-read, short, foreign header, pool down, too slow) is
reported through ``get_block_ids_with_load_errors`` and vLLM, with
``kv_load_failure_policy: recompute``, recomputes from the first bad block; a
failed save is counted and logged once per kind; the request goes on.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Generator, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from vllm_aio.backends import Backend, Status
from vllm_aio.config import AioConfig
from vllm_aio.connector.block_io import BlockIO, BlockRef, CopyHandoff, open_block_io
from vllm_aio.connector.deployment import Deployment
from vllm_aio.connector.layer_buffer import LayerBuffer
from vllm_aio.connector.metadata import AioConnectorMetadata, BlockTransfer
from vllm_aio.connector.stats import AioConnectorStats
from vllm_aio.connector.transfer import TransferThread
from vllm_aio.log import get_logger
from vllm_aio.pool.entry import EntryHeader
from vllm_aio.pool.keys import Unit
from vllm_aio.pool.ownership import Ownership

logger = get_logger(__name__)


@dataclass
class _Batch:
    """Blocks of several requests moved together, with the request of each."""

    blocks: list[BlockRef]
    req_ids: list[str]


@dataclass
class _Load:
    batch: _Batch
    unit: Unit
    future: "Future[tuple[list[Status], torch.Event | None]]"
    started: float


class AioWorker:
    def __init__(self, deployment: Deployment, backend: Backend, ownership: Ownership, cfg: AioConfig) -> None:
        self._dep = deployment
        self._backend = backend
        self._owner = ownership
        self._cfg = cfg
        self._units = deployment.units()
        # Layer name -> its unit; empty unless layerwise (the layer hooks do nothing).
        self._unit_of_layer = dict(zip(deployment.layer_names, self._units)) if deployment.layerwise else {}
        t = ownership.topology
        # The first rank speaks for the scheduler, so TP does not multiply lookups.
        self._reports_lookups = not (t.tp_rank or t.pp_rank or t.pcp_rank or t.dcp_rank)
        self._io: BlockIO | None = None
        self._buffer: LayerBuffer | None = None  # with dynamic_buffer_layers
        self._layer_index = {name: i for i, name in enumerate(deployment.layer_names)}
        self._recv = TransferThread("vllm_aio-recv")
        self._send = TransferThread("vllm_aio-send")
        # This step's state, reset by start_load_kv (forward thread only).
        self._layer_loads: dict[int, _Load] = {}
        self._retrieve: Iterator[_Load] | None = None
        self._store: Generator[None, Unit, None] | None = None
        self._handoffs: list[CopyHandoff] = []
        self._stalled = False  # a load of this step overran transfer_timeout
        self._async_loads: dict[str, _Load] = {}
        # Failed blocks per request, reported and logged once per step.
        self._failed: dict[str, Counter[str]] = {}
        self._load_errors: set[int] = set()
        self._save_failures_logged: set[Status] = set()
        self._stats_lock = threading.Lock()  # the sending thread adds save stats
        self.stats = AioConnectorStats()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        if self._dep.buffer_layers:
            # The pool moves blocks to and from the buffer's host copy of every layer.
            self._buffer = LayerBuffer(
                kv_caches, self._dep.layer_names, num_blocks, self._dep.buffer_layers, self._cfg.staging_buffer_size
            )
            kv_caches = self._buffer.host_caches
            logger.info(
                "vllm_aio: dynamic buffer: %d layers on %d device buffers; host copy of every layer %.2f GiB%s",
                len(self._dep.layer_names),
                self._dep.buffer_layers,
                self._buffer.host_bytes / 2**30,
                "" if self._buffer.device.is_host else " (page-locked)",
            )
        header = EntryHeader(self._dep.namespace.digest(), self._owner.shard_id, -1, self._dep.block_size, 0)
        self._io = open_block_io(
            kv_caches, self._dep.layer_names, num_blocks, self._backend, header,
            self._cfg.staging_buffer_size, self._cfg.transfer_timeout,
        )
        if self._io.value_bytes(self._units[0]) != self._dep.value_bytes:
            raise ValueError(
                f"KV cache blocks make values of {self._io.value_bytes(self._units[0])} bytes but the KV "
                f"cache config promises {self._dep.value_bytes}; padded or mixed layouts are not supported"
            )

    # ---- loads -------------------------------------------------------------
    def begin_step(self, meta: AioConnectorMetadata) -> None:
        """Before every forward (vLLM binds the metadata), unlike ``start_load_kv``.

        The dynamic buffer must fill its first layers before every step, and
        blocks loaded from the pool must reach its host copy before that.
        """
        if self._buffer is None or meta.buffer is None:
            return
        self._start_loads(meta)
        self._buffer.begin_step(meta.buffer)

    def start_load_kv(self, meta: AioConnectorMetadata) -> None:
        if self._buffer is None:  # with the buffer, begin_step started them
            self._start_loads(meta)

    def _start_loads(self, meta: AioConnectorMetadata) -> None:
        if self._stalled:  # late copies of a timed-out step must not race this one
            self._recv.drain()
            self._stalled = False
        if self._reports_lookups:
            lookups = meta.lookups
            self._add_stats(
                hit_tokens=lookups.hit_tokens,
                miss_tokens=lookups.miss_tokens,
                failed_hit_tokens=lookups.failed_hit_tokens,
            )
        self._layer_loads.clear()
        self._retrieve = None
        if not meta.loads:
            return
        if self._cfg.load_async:
            for transfer in meta.loads:
                batch = self._load_batch([transfer])
                self._async_loads[transfer.req_id] = self._submit_load(batch, self._units[0])
        elif self._dep.layerwise:
            self._retrieve = self._retrieve_layers(self._load_batch(meta.loads))
            for _ in range(1 + self._cfg.layerwise_prefetch_layers):
                self._advance_retrieve()
        else:
            batch, started = self._load_batch(meta.loads), time.perf_counter()
            try:
                statuses, copied = self._io.load(batch.blocks, self._units[0])
                self._io.device.wait(copied)  # the forward runs after the copies
            except Exception as exc:
                statuses = self._pool_failed(exc, batch)
            self._finish_load(batch, self._units[0], statuses, started)

    def _load_batch(self, transfers: list[BlockTransfer]) -> _Batch:
        # Every rank loads its shard of every block; replicas of a shard start
        # at different blocks so they do not all hit the same values at once.
        batch = _Batch([], [])
        for t in transfers:
            for i in self._owner.read_order(range(len(t.block_ids))):
                batch.blocks.append(BlockRef(t.block_ids[i], t.block_hashes[i]))
                batch.req_ids.append(t.req_id)
        return batch

    def _submit_load(self, batch: _Batch, unit: Unit) -> _Load:
        return _Load(batch, unit, self._recv.submit(self._io.load, batch.blocks, unit), time.perf_counter())

    def _retrieve_layers(self, batch: _Batch) -> Iterator[_Load]:
        """Queues one layer's load each time it is advanced."""
        for unit in self._units:
            yield self._submit_load(batch, unit)

    def _advance_retrieve(self) -> bool:
        load = next(self._retrieve, None) if self._retrieve else None
        if load is not None:
            self._layer_loads[load.unit.tag] = load
        return load is not None

    def _take_layer_load(self, unit: Unit) -> _Load | None:
        while unit.tag not in self._layer_loads:
            if not self._advance_retrieve():
                return None
        load = self._layer_loads.pop(unit.tag)
        self._advance_retrieve()  # keep the prefetch window full
        return load

    def wait_for_layer_load(self, layer_name: str) -> None:
        unit = self._unit_of_layer.get(layer_name)
        load = self._take_layer_load(unit) if unit is not None else None
        if load is None:
            return
        if self._stalled:  # an earlier layer timed out: the whole step is being recomputed
            self._fail_load(load.batch, "timeout")
            return
        try:
            statuses, copied = load.future.result(timeout=self._cfg.transfer_timeout)
            self._io.device.wait(copied)  # this layer's attention runs after its copies
        except FutureTimeout:
            self._stalled = True
            logger.warning(
                "vllm_aio: layer %d load exceeded transfer_timeout=%.1fs; this step's pool blocks are recomputed",
                unit.tag,
                self._cfg.transfer_timeout,
            )
            self._fail_load(load.batch, "timeout")
            return
        except Exception as exc:
            statuses = self._pool_failed(exc, load.batch)
        self._finish_load(load.batch, unit, statuses, load.started)

    def get_finished(self) -> set[str]:
        """Requests whose background load ended (with or without errors)."""
        done = set()
        for req_id, load in list(self._async_loads.items()):
            if not load.future.done():
                continue
            try:
                statuses, copied = load.future.result()
                if not self._io.device.completed(copied):
                    continue  # still on its way to the device
            except Exception as exc:
                statuses = self._pool_failed(exc, load.batch)
            del self._async_loads[req_id]
            self._finish_load(load.batch, load.unit, statuses, load.started)
            done.add(req_id)
        return done

    def _pool_failed(self, exc: Exception, batch: _Batch) -> list[Status]:
        logger.warning("vllm_aio: pool load failed: %s", exc)
        return [Status.ERROR] * len(batch.blocks)

    def _fail_load(self, batch: _Batch, reason: str) -> None:
        for block, req_id in zip(batch.blocks, batch.req_ids):
            self._record_failure(req_id, block.block_id, reason)

    def _finish_load(self, batch: _Batch, unit: Unit, statuses: list[Status], started: float) -> None:
        ok = 0
        for block, req_id, status in zip(batch.blocks, batch.req_ids, statuses):
            if status is Status.OK:
                ok += 1
            else:
                self._record_failure(req_id, block.block_id, status.value)
        self._add_stats(
            load_blocks=ok if unit is self._units[-1] else 0,
            load_bytes=ok * self._io.value_bytes(unit),
            load_seconds=time.perf_counter() - started,
        )

    def _record_failure(self, req_id: str, block_id: int, reason: str) -> None:
        if block_id not in self._load_errors:
            self._load_errors.add(block_id)
            self._failed.setdefault(req_id, Counter())[reason] += 1

    def get_block_ids_with_load_errors(self) -> set[int]:
        for req_id, reasons in self._failed.items():
            logger.warning(
                "vllm_aio: request %s: %d pool blocks could not be loaded (%s); vLLM recomputes them",
                req_id,
                sum(reasons.values()),
                ", ".join(f"{n} {r}" for r, n in sorted(reasons.items())),
            )
        self._add_stats(load_failures=len(self._load_errors))
        errors, self._load_errors, self._failed = self._load_errors, set(), {}
        return errors

    # ---- saves -------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, meta: AioConnectorMetadata) -> None:
        if self._buffer is not None and meta.buffer is not None and layer_name in self._layer_index:
            layer = self._layer_index[layer_name]
            self._buffer.layer_done(layer)
            self._buffer.before_layer(layer + 1)
        unit = self._unit_of_layer.get(layer_name)
        if unit is None or not meta.saves:
            return
        if self._store is None:
            self._store = self._store_layers(self._save_batch(meta.saves))
            next(self._store)
        self._store.send(unit)

    def _store_layers(self, batch: _Batch) -> Generator[None, Unit, None]:
        """Hands the step's blocks of each layer it is sent to the sending thread."""
        while True:
            self._submit_save(batch, (yield))

    def wait_for_save(self, meta: AioConnectorMetadata) -> None:
        if self._buffer is not None and meta.buffer is not None:
            self._buffer.end_step()  # saves read the host copy
        if meta.saves and not self._dep.layerwise:
            self._submit_save(self._save_batch(meta.saves), self._units[0])
        deadline = time.monotonic() + self._cfg.transfer_timeout
        handoffs, self._handoffs, self._store = self._handoffs, [], None
        for handoff in handoffs:
            if not handoff.wait(max(0.0, deadline - time.monotonic())):
                self._log_save_failure(Status.ERROR, f"copy out of the KV cache exceeded transfer_timeout="
                                       f"{self._cfg.transfer_timeout}s, save abandoned")

    def _save_batch(self, transfers: list[BlockTransfer]) -> _Batch:
        batch = _Batch([], [])
        for t in transfers:
            first = t.first_index
            for i in self._owner.owned_blocks(range(first, first + len(t.block_ids))):
                batch.blocks.append(BlockRef(t.block_ids[i - first], t.block_hashes[i - first]))
                batch.req_ids.append(t.req_id)
        return batch

    def _submit_save(self, batch: _Batch, unit: Unit) -> None:
        if not batch.blocks:
            return
        handoff = CopyHandoff()
        computed = self._io.device.record()  # after this layer's attention wrote its KV
        self._send.submit(self._save, batch, unit, computed, handoff)
        self._handoffs.append(handoff)

    def _save(self, batch: _Batch, unit: Unit, computed: torch.Event | None, handoff: CopyHandoff) -> None:
        """Runs on the sending thread."""
        started = time.perf_counter()
        try:
            statuses = self._io.save(batch.blocks, unit, computed, handoff)
        except Exception as exc:
            statuses = [Status.ERROR] * len(batch.blocks)
            self._log_save_failure(Status.ERROR, str(exc))
        counts = Counter(statuses)
        for status in (Status.NO_SPACE, Status.ERROR):
            if counts[status]:
                self._log_save_failure(status, f"{counts[status]} blocks")
        last = unit is self._units[-1]
        self._add_stats(
            save_blocks=counts[Status.OK] if last else 0,
            save_bytes=counts[Status.OK] * self._io.value_bytes(unit),
            save_seconds=time.perf_counter() - started,
            save_skipped=counts[Status.EXISTS] if last else 0,
            save_failures=counts[Status.NO_SPACE] + counts[Status.ERROR],
        )

    def _log_save_failure(self, status: Status, detail: str) -> None:
        if status in self._save_failures_logged:
            return
        self._save_failures_logged.add(status)
        logger.warning(
            "vllm_aio: pool save failed (%s: %s); requests continue, later failures of this "
            "kind are only counted in the KV Transfer metrics",
            status.value,
            detail,
        )

    # ---- stats and shutdown ------------------------------------------------
    def _add_stats(self, **counts: float) -> None:
        with self._stats_lock:
            self.stats.add(**counts)

    def take_stats(self) -> AioConnectorStats | None:
        with self._stats_lock:
            if self.stats.is_empty():
                return None
            stats, self.stats = self.stats, AioConnectorStats()
            return stats

    def close(self) -> None:
        self._recv.close()
        self._send.close()
        self._backend.close()
