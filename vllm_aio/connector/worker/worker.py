"""The worker half: routes vLLM's per-step hooks to the parts that move KV bytes.

One instance per worker process, with one receiving and one sending thread
(``transfer.py``). What happens at each hook is decided once, when the KV
cache is registered, by choosing three participants:

* a load strategy (``loads.py``): before the forward, before the dynamic
  buffer fills, layer by layer, or in the background;
* a save strategy (``saves.py``): whole blocks at the end of the step, or
  each layer right after its attention;
* the dynamic buffer's hooks (``buffer/participant.py``), or none.

vLLM's hooks per step, in order: ``handle_preemptions`` (the previous step's
saves done copying out of the cache, blocks of requests preempted at this
step's scheduling copied out), ``bind_connector_metadata`` (``begin_step``:
loads that the buffer needs, then the buffer's first layers),
``start_load_kv``, per layer ``wait_for_layer_load`` and ``save_kv_layer``,
``wait_for_save`` (the buffer's write-backs, then saves handed to the sending
thread; their copies out of the cache are waited for at the next step's start), then ``get_finished`` and ``get_block_ids_with_load_errors``. The
copies themselves are ``block_io/``'s.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm_aio import vllm_compat
from vllm_aio.backends import Backend
from vllm_aio.buffer.participant import BufferHooks, NoBuffer, open_buffer
from vllm_aio.config import AioConfig, TransferMode
from vllm_aio.connector.worker.block_io import BlockIO, open_block_io
from vllm_aio.connector.events import SavedParts, SettledSaves, kv_events_on
from vllm_aio.connector.worker.loads import BeforeBuffer, BeforeForward, InBackground, Layerwise, LoadReport, Loads
from vllm_aio.connector.worker.saves import LayerwiseSaves, Saves, WholeBlockSaves
from vllm_aio.connector.stats import AioConnectorStats
from vllm_aio.connector.worker.transfer import TransferThread
from vllm_aio.device.amx_permission import AmxPermission, ensure_amx_for_cpu_attention
from vllm_aio.device.block_layout import LayerCache, check_groups_alias
from vllm_aio.log import get_logger
from vllm_aio.pool.entry import EntryHeader
from vllm_aio.pool.ownership import Ownership
from vllm_aio.shared.deployment import Deployment
from vllm_aio.shared.metadata import AioConnectorMetadata, WorkerFacts

logger = get_logger(__name__)


class AioWorker:
    def __init__(
        self, deployment: Deployment, backend: Backend, ownership: Ownership, cfg: AioConfig, kv_events: bool = False,
        amx: AmxPermission | None = None, facts: WorkerFacts | None = None,
    ) -> None:
        """``amx``: the tile permission asked for vLLM's CPU attention (logged at registration).
        ``facts``: what this worker tells the scheduler at start, where vLLM's config does not say it."""
        self._dep = deployment
        self._backend = backend
        self._owner = ownership
        self._cfg = cfg
        self._units = deployment.units()
        t = ownership.topology
        # The first rank speaks for the scheduler, so TP does not multiply lookups.
        self._reports_lookups = not (t.tp_rank or t.pp_rank or t.pcp_rank or t.dcp_rank)
        self._recv = TransferThread("vllm_aio-recv")
        self._send = TransferThread("vllm_aio-send")
        self._stats_lock = threading.Lock()  # the sending thread adds save stats
        self.stats = AioConnectorStats()
        # With vLLM's KV cache events: the saves this rank settled, reported each step.
        self._settled = SettledSaves(ownership.shard_id) if kv_events else None
        # Chosen by register_kv_caches, once the KV cache exists.
        self._io: BlockIO | None = None
        self._buffer: BufferHooks | NoBuffer | None = None
        self._report: LoadReport | None = None
        self._loads: Loads | None = None
        self._saves: Saves | None = None
        self._amx = amx
        self.facts = facts

    @classmethod
    def start(cls, vllm_config: Any, kv_cache_config: Any, cfg: AioConfig, dep: Deployment,
              backend: Backend) -> AioWorker:
        """The worker half as vLLM starts it: its ranks, the AMX permission on vLLM's CPU platform (asked
        before the first forward), and its facts. Built after the model, so after its attention backend
        chose the KV cache layout that ``facts`` carries where vLLM's config records none (before 0.32)."""
        amx = ensure_amx_for_cpu_attention() if vllm_compat.on_cpu_platform() else None
        facts = None
        if not vllm_compat.records_kv_cache_layout(kv_cache_config):
            facts = WorkerFacts(kv_layout=dep.namespace.kv_layout)
        ownership = Ownership(dep.topology(**vllm_compat.parallel_ranks()))
        return cls(dep, backend, ownership, cfg, kv_events_on(vllm_config, dep.save_enabled), amx, facts)

    def register_kv_caches(self, kv_caches: dict[str, LayerCache], num_blocks: int, vllm_config: Any = None) -> None:
        """``vllm_config``: where the dynamic buffer finds the attention layers (resident blocks)."""
        if self._amx is not None:  # which kernels vLLM's CPU attention chose: the log says which path ran
            isas = vllm_compat.attention_isas(vllm_config, kv_caches)
            logger.info("vllm_aio: CPU attention kernels %s; AMX tiles %s%s", "/".join(isas), self._amx.state.value,
                        f" ({self._amx.reason})" if self._amx.reason else "")
        if self._dep.hybrid:  # blocks of every group are read through group 0's layers
            check_groups_alias(kv_caches, [g.layer_names for g in self._dep.groups])
        self._buffer = open_buffer(self._dep, self._cfg.staging_buffer_size, kv_caches, num_blocks, vllm_config)
        kv_caches, num_blocks = self._buffer.pool_caches
        header = EntryHeader(self._dep.namespace.digest(), self._owner.shard_id, -1, self._dep.block_size, 0)
        self._io = open_block_io(
            kv_caches, self._dep.layer_names, num_blocks, self._backend, header,
            self._cfg.staging_buffer_size, self._cfg.transfer_timeout,
        )
        logger.info("vllm_aio: KV cache on %s: values move %s", self._io.device.torch_device,
                    "between the pool's slots and the cache directly" if self._io.direct
                    else "through page-locked staging buffers")
        if self._io.value_bytes(self._units[0]) != self._dep.value_bytes:
            raise ValueError(
                f"KV cache blocks make values of {self._io.value_bytes(self._units[0])} bytes but the KV "
                f"cache config promises {self._dep.value_bytes}; padded or mixed layouts are not supported"
            )
        self._io.warm_up({unit.layers for unit in self._units})
        self._report = LoadReport(self._io, self._units[-1], self._add_stats)
        self._loads = self._choose_loads()
        self._saves = self._choose_saves()

    def _choose_loads(self) -> Loads:
        common = (self._io, self._owner, self._units, self._recv, self._report, self._cfg.transfer_timeout)
        mode = self._dep.transfer_mode
        if mode is TransferMode.DYNAMIC_BUFFER:
            return BeforeBuffer(*common)
        if mode is TransferMode.LAYERWISE:
            layers = list(self._dep.layer_names)
            return Layerwise(*common, layer_names=layers, prefetch=self._cfg.layerwise_prefetch_layers)
        return InBackground(*common) if mode is TransferMode.ASYNC else BeforeForward(*common)

    def _choose_saves(self) -> Saves:
        common = (self._io, self._owner, self._units, self._send, self._add_stats, self._cfg.transfer_timeout,
                  self._report.step_loads)
        if self._dep.transfer_mode is TransferMode.LAYERWISE:
            return LayerwiseSaves(*common, settled=self._settled, layer_names=list(self._dep.layer_names))
        return WholeBlockSaves(*common, settled=self._settled)

    # ---- vLLM's hooks, in step order -------------------------------------------
    def handle_preemptions(self, meta: AioConnectorMetadata) -> None:
        """First in the step, before vLLM zeroes or writes any block: the previous step's saves
        finish their copies out of the cache, then the blocks of requests preempted at this
        step's scheduling are copied out (they may be another's now)."""
        self._saves.open_step()
        if meta.rescues:
            self._saves.rescue(meta.rescues)

    def begin_step(self, meta: AioConnectorMetadata, forward_context: object = None) -> None:
        """Before every forward (vLLM binds the metadata), unlike ``start_load_kv`` (vLLM 0.32 calls
        it after the forward unless a load must finish first). ``forward_context``: the forward's,
        where one is set (its attention metadata, for the dynamic buffer's resident blocks)."""
        if meta.namespace_digest and meta.namespace_digest != self._io.namespace_digest:
            logger.info("vllm_aio: key namespace %s -> %s (weight version changed)",
                        self._io.namespace_digest, meta.namespace_digest)
            self._io.rename(meta.namespace_digest)
        self._report.begin_step()
        self._loads.begin_step(meta)
        self._buffer.begin_step(meta, forward_context)

    def start_load_kv(self, meta: AioConnectorMetadata) -> None:
        lookups = meta.lookups
        if self._reports_lookups and (lookups.hit_tokens or lookups.miss_tokens or lookups.failed_hit_tokens):
            self._add_stats(
                hit_tokens=lookups.hit_tokens,
                miss_tokens=lookups.miss_tokens,
                failed_hit_tokens=lookups.failed_hit_tokens,
            )
        self._loads.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._loads.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, meta: AioConnectorMetadata) -> None:
        self._buffer.after_layer(layer_name, meta)
        self._saves.after_layer(layer_name, meta)

    def wait_for_save(self, meta: AioConnectorMetadata) -> None:
        self._buffer.end_step(meta)
        self._saves.end_step(meta)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Requests whose background load ended (with or without errors), and, for a
        hybrid model, those of them with a failed block (vLLM recomputes them whole)."""
        done = self._loads.finished()
        return done, self._report.take_failed_requests() if self._dep.hybrid else set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        # A hybrid model's failures went with get_finished: vLLM 0.32 refuses block ids of several groups.
        return set() if self._dep.hybrid else self._report.take_errors()

    # ---- stats and shutdown ------------------------------------------------
    def _add_stats(self, **counts: float) -> None:
        with self._stats_lock:
            self.stats.add(**counts)

    def take_stats(self) -> AioConnectorStats | None:
        with self._stats_lock:
            self.stats.add(**self._backend.take_counters())
            if self.stats.is_empty():
                return None
            self.stats.set_gauges(self._backend.gauges())
            stats, self.stats = self.stats, AioConnectorStats()
            return stats

    def take_saved_parts(self) -> SavedParts | None:
        """The saves settled since the last call (KV events; None when off or nothing settled)."""
        return self._settled.take() if self._settled is not None else None

    def drain(self) -> None:
        """Wait until every transfer queued so far has run (its pool put included)."""
        self._recv.drain()
        self._send.drain()
        self._io.drain()  # the puts the sending thread's saves handed on

    def close(self) -> None:
        self._recv.close()
        self._send.close()
        if self._buffer is not None:  # None where registration refused the cache
            self._buffer.close()
        if self._io is not None:
            self._io.close()  # unmaps the pool's slots before the pool goes
        self._backend.close()
