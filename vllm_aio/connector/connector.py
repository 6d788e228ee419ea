"""``AioConnector``: the vLLM V1 connector facade.

vLLM builds it twice: once with the SCHEDULER role in the engine-core process
and once per worker with the WORKER role. This class only parses the config,
builds the half that matches the role, and routes vLLM's calls to it.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from vllm_aio import backends, vllm_compat
from vllm_aio.backends import Backend
from vllm_aio.config import parse_extra_config, transfer_mode_of
from vllm_aio.connector.scheduler.scheduler import AioScheduler
from vllm_aio.connector.stats import AioConnectorStats, AioPromMetrics
from vllm_aio.connector.vllm_events import SavedPartsMetadata, to_vllm
from vllm_aio.errors import ConfigError
from vllm_aio.log import get_logger
from vllm_aio.shared.deployment import build_deployment
from vllm_aio.shared.metadata import AioConnectorMetadata, WorkerFacts

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from vllm_aio.config import AioConfig
    from vllm_aio.connector.worker.worker import AioWorker
    from vllm_aio.device.block_layout import LayerCache
    from vllm_aio.shared.deployment import Deployment

logger = get_logger(__name__)


class AioConnector(KVConnectorBase_V1, SupportsHMA):
    """Declares ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on, and a
    hybrid model's groups (sliding window and full attention) reach this
    connector as they are (``Deployment.groups``) instead of all as full attention."""

    _cache_hit_source = vllm_compat.host_cache_hit_source()  # vLLM 0.32 labels prefix-cache hits by source

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = parse_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        dep = build_deployment(vllm_config, kv_cache_config, cfg)
        self._scheduler: AioScheduler | None = None
        self._worker: AioWorker | None = None
        self._exit_hook = shutdown_at_exit(self)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = AioScheduler.start(vllm_config, cfg, dep, self.open_backend(cfg, dep, True))
        else:
            # Imported only here: the worker half loads numba (llvmlite), which vLLM 0.32's CPU worker start
            # fails on when it scans loaded modules for Triton kernels (before the connector, with TP=1).
            from vllm_aio.connector.worker.worker import AioWorker

            self._worker = AioWorker.start(vllm_config, kv_cache_config, cfg, dep, self.open_backend(cfg, dep, False))

    @property
    def requires_kv_delivery(self) -> bool:
        """vLLM 0.27+ asks, and takes every producer (``kv_both`` included) for one that hands KV off:
        it then drops a preempted request's output in flight under async scheduling. The pool is a
        best-effort cache in every role: a save a preemption cuts short is a later miss, nothing more."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """vLLM asks before building the connector: modes whose work runs in the per-layer hooks need
        PIECEWISE graphs, which a FULL graph's replay would skip (``shared/graph_mode.py``). A config that
        names no valid mode answers False here and fails at the connector's start, naming the key."""
        try:
            return transfer_mode_of(extra_config or {}).runs_per_layer
        except ConfigError:
            return False

    def open_backend(self, cfg: "AioConfig", dep: "Deployment", for_scheduler: bool) -> Backend:
        """The pool store this half uses. The one seam for subclasses (the tests'
        fault-injecting and recording connectors wrap what it returns)."""
        return backends.open_backend(cfg.backend_settings, dep.pool_name, dep.value_bytes, for_scheduler=for_scheduler)

    # ---- worker side -------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, "LayerCache"]) -> None:
        # A tensor a layer from vLLM's runners, a tuple or list of them from vllm-ascend's (block_layout.py).
        self._worker.register_kv_caches(kv_caches, self._kv_cache_config.num_blocks, self._vllm_config)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, AioConnectorMetadata)
        self._worker.handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            from vllm.forward_context import get_forward_context, is_forward_context_available

            # vLLM binds inside the step's forward context, before the forward.
            self._worker.begin_step(self._meta(), get_forward_context() if is_forward_context_available() else None)

    # Each hook returns at once where no metadata is bound: vLLM's graph capture, and vllm-ascend's
    # MLA/SFA/DSA attention in capture and in idle data-parallel ranks' dummy runs, call the per-layer
    # hooks outside any scheduled step.
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self.has_connector_metadata():
            self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.has_connector_metadata():
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: "LayerCache", attn_metadata: Any, **kwargs: Any) -> None:
        # kv_layer goes unread: the layer's blocks are found by name in the registered caches. vllm-ascend
        # passes lists here (MLA, SFA, DSA) and, from its GDN layers, ("", []): a name no save knows.
        if self.has_connector_metadata():
            self._worker.save_kv_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker.wait_for_save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        # vLLM 0.32 asks this, with the requests whose load failed (a hybrid model's); older ones get_finished.
        done, failed = self._worker.get_finished()
        return vllm_compat.transfer_results(done, failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, _ = self._worker.get_finished()  # no failed requests before 0.32: hybrid models need it
        return None, done

    def get_handshake_metadata(self) -> WorkerFacts | None:
        """Asked of every worker once its KV cache is registered: what the scheduler keys by, where
        vLLM's config does not say it (before 0.32). Behind vLLM's MultiConnector only the first
        connector's answer travels: there, name NixlConnector before this one."""
        return self._worker.facts if self._worker else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> AioConnectorStats | None:
        return self._worker.take_stats() if self._worker else None

    def build_connector_worker_meta(self) -> SavedPartsMetadata | None:
        """The saves this rank settled since the last step (KV events on), for the scheduler's KV events."""
        parts = self._worker.take_saved_parts() if self._worker else None
        return SavedPartsMetadata([parts]) if parts is not None else None

    def shutdown(self) -> None:
        atexit.unregister(self._exit_hook)
        half = self._worker or self._scheduler
        if half is not None:
            half.close()

    def _meta(self) -> AioConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, AioConnectorMetadata)
        return meta

    # ---- scheduler side ----------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Every worker's ``WorkerFacts``, once at start before any request (the pipeline stages'
        arrive through ``set_xfer_handshake_metadata_pp_aware``). Another connector's payloads,
        behind vLLM's MultiConnector, are not ours to read."""
        self._scheduler.take_worker_facts(f for f in metadata.values() if isinstance(f, WorkerFacts))

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self.set_xfer_handshake_metadata(dict(enumerate(metadata.values())))

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        saved = connector_output.kv_connector_worker_meta  # every worker's, aggregated by vLLM
        self._scheduler.update_connector_output(
            connector_output.invalid_block_ids, vllm_compat.failed_recving(connector_output),
            saved.reports if isinstance(saved, SavedPartsMetadata) else (),
        )

    def take_events(self) -> Iterable["KVCacheEvent"]:
        return to_vllm(self._scheduler.take_events(), self._scheduler.event_medium)

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM calls this, never request_finished, on a SupportsHMA connector (one group or several).
        return self._scheduler.request_finished(request, block_ids)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> AioConnectorStats:
        return AioConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> AioPromMetrics:
        return AioPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No. vLLM 0.33 asks at start, only with ``enable_sleep_mode``, and refuses to start then.

        The workers build on the KV cache once, at registration: the direct path's copy plans and
        kernel address tables, the dynamic buffer's device buffers and the blocks it keeps resident
        there. vLLM's cumem backend keeps the addresses across sleep but drops the KV cache's
        contents, and other sleep backends (RFC #34303) need keep neither. Supporting sleep means
        rebuilding all of that in ``restore_kv_caches``, which no test here could run (no device).
        """
        logger.warning(
            "vllm_aio: AioConnector does not support vLLM's sleep mode: its workers build copy plans, kernel "
            "address tables and the dynamic buffer's resident blocks on the KV cache once, at registration, "
            "and nothing rebuilds them after sleep; start without enable_sleep_mode"
        )
        return False


def shutdown_at_exit(connector: AioConnector) -> Callable[[], None]:
    """Shut ``connector`` down when the interpreter exits, unless vLLM did first.

    vLLM's in-process engine (``LLM(...)`` with the engine core in the caller's
    process) never shuts its connector down: in vLLM 0.23.0's CUDA engine a
    tiered store's producer, its remote writes still queued, ended in
    libstdc++'s "terminate called without an active exception" (a store
    client's threads running as the interpreter tore down). Interpreter exit
    runs this while the transfer threads still run: the queued writes are
    flushed (bounded), the store clients closed. Holds the connector weakly.
    """
    ref = weakref.ref(connector)

    def hook() -> None:
        if (live := ref()) is not None:
            logger.info("vllm_aio: shutting the connector down at interpreter exit (vLLM did not)")
            live.shutdown()

    atexit.register(hook)
    return hook
