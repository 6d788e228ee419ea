"""The scheduler half: decides which blocks to load from and save to the pool.

It runs in vLLM's engine-core process, on its scheduling thread, and never
touches KV bytes. Per step it turns vLLM's scheduling decisions into an
``AioConnectorMetadata``: the blocks each request loads before its forward
(pool hits beyond vLLM's own prefix cache) and the blocks that become full
during the forward and get saved.

``AioScheduler.start`` builds what the half owns (KV events, migrations' flush requests and
service, the start line: ``start_log.py``); then it only routes vLLM's calls; each concern is a module of its own:
the keys (``shared/keying.py``), lookups (``lookups.py``), leases of promised blocks
(``leases.py``), loads and their failures (``load_plan.py``), saves and
rescues of running requests (``save_plan.py``), the dynamic buffer's step
(``buffer/planner.py``) and migrations' flushes (``migration/flushes.py``).

Hybrid models (several KV cache groups, ``Deployment.groups``): every group's
blocks are stored under its own keys, loaded and saved per group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from vllm_aio.backends import Backend
from vllm_aio.buffer.planner import buffer_planner
from vllm_aio.config import AioConfig
from vllm_aio.connector.events import KVEvents, Removed, SavedParts, Stored, kv_events_on
from vllm_aio.connector.scheduler.leases import Leases
from vllm_aio.connector.scheduler.load_plan import LoadPlanner
from vllm_aio.connector.scheduler.lookups import PoolLookups
from vllm_aio.connector.scheduler.save_plan import SavePlanner
from vllm_aio.connector.scheduler.start_log import log_start
from vllm_aio.errors import ConfigError
from vllm_aio.log import get_logger
from vllm_aio.migration.flushes import FlushRequests
from vllm_aio.pool.keys import BlockParts
from vllm_aio.shared.deployment import Deployment
from vllm_aio.shared.keying import PoolKeying
from vllm_aio.shared.metadata import AioConnectorMetadata, WorkerFacts

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from vllm_aio.migration.service import MigrationService

logger = get_logger(__name__)


class AioScheduler:
    def __init__(self, deployment: Deployment, backend: Backend, events: KVEvents | None = None,
                 max_lease_seconds: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 flushes: "FlushRequests | None" = None) -> None:
        """``events``: vLLM's KV cache events, told of saves planned and blocks found missing.
        ``max_lease_seconds``: the longest a promised block is leased (a load's transfer_timeout).
        ``flushes``: the queue the migration control asks running requests to be stored through."""
        self._backend = backend
        self.keying = PoolKeying(deployment)  # the migration control switches the weight version here
        self._leases = Leases(backend, max_lease_seconds, clock)
        self._lookups = PoolLookups(deployment, backend, self.keying, events)
        self._loads = LoadPlanner(deployment, self._lookups, self._leases, self.keying)
        self._saves = SavePlanner(deployment, self.keying, events)
        self._buffer = buffer_planner(deployment)
        self._flushes = flushes
        self._events = events
        self._migration: MigrationService | None = None

    @classmethod
    def start(cls, vllm_config: "VllmConfig", cfg: AioConfig, dep: Deployment, backend: Backend) -> AioScheduler:
        """The scheduler half as vLLM starts it, with what it owns: KV events, the migrations' flush
        requests and the migration service (``migration`` on)."""
        events = None
        if kv_events_on(vllm_config, dep.save_enabled):
            events = KVEvents(dep.block_size, backend.block_watch(), cfg.transfer_timeout)
        flushes = FlushRequests() if cfg.migration else None  # the migration control asks, the scheduler saves
        scheduler = cls(dep, backend, events, max_lease_seconds=cfg.transfer_timeout, flushes=flushes)
        transfer = vllm_config.kv_transfer_config
        log_start(cfg, dep, transfer, backend)
        if flushes is not None:
            from vllm_aio.migration.service import MigrationService  # numpy, an HTTP server: only when on

            scheduler._migration = MigrationService.start(
                scheduler.keying, flushes, backend, dep, cfg,
                vllm_config.cache_config.prefix_caching_hash_algo, transfer.kv_role, transfer.engine_id,
            )
        return scheduler

    @property
    def parts(self) -> BlockParts:
        """What each block is stored as now (the weight version may change at runtime)."""
        return self.keying.parts

    def take_worker_facts(self, facts: Iterable[WorkerFacts]) -> None:
        """The workers' layout keys every block from the first request on: the namespace must name
        the bytes the workers store, whatever this process derived (``WorkerFacts``)."""
        layouts = sorted({f.kv_layout for f in facts})
        if len(layouts) > 1:
            raise ConfigError(f"vllm_aio: the workers' KV cache layouts differ ({', '.join(layouts)}); "
                              "every rank must lay its KV cache out alike")
        if layouts and layouts[0] != self.keying.namespace.kv_layout:
            logger.info("vllm_aio: KV cache layout %s, as the workers' attention backend lays it out (this "
                        "process derived %s): keys name %s", layouts[0], self.keying.namespace.kv_layout, layouts[0])
            self.keying.set_kv_layout(layouts[0])

    # ---- lookup and admission ------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        return self._loads.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        self._lookups.forget(request.request_id)  # admitted: no more lookups until it waits again
        known = self._saves.admit(request)  # re-admitted: preempted, or its async load finished
        self._loads.admit(request, blocks.get_block_ids(), num_external_tokens, counted=not known)

    # ---- per step --------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> AioConnectorMetadata:
        self._leases.tick()
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        loads, lookups = self._loads.take(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        meta = AioConnectorMetadata(loads=loads, lookups=lookups, namespace_digest=self.keying.parts.namespace_digest)
        for req_id in scheduler_output.preempted_req_ids or ():
            meta.rescues.extend(self._saves.rescue(req_id))  # first: it may be resumed in this same step
            self._buffer.release(req_id)  # its blocks may be another's now
        scheduled = self._saves.schedule(scheduler_output)
        self._take_flushes()
        meta.saves = self._saves.save(scheduled, loads)
        meta.buffer = self._buffer.step(scheduled, scheduler_output)
        return meta

    def _take_flushes(self) -> None:
        """Mark the running requests that migrations asked to have stored."""
        if self._flushes is not None:
            for req_id, num_blocks in self._flushes.match(self._saves.running()).items():
                self._saves.flush(req_id, num_blocks)

    def update_connector_output(self, invalid_block_ids: set[int], failed_req_ids: set[str] = frozenset(),
                                saved: Iterable[SavedParts] = ()) -> None:
        """Count the hit tokens the pool promised and the workers could not load (``LoadPlanner.failed``);
        ``saved``: the ranks' settled saves, for KV events."""
        self._loads.failed(invalid_block_ids, failed_req_ids)
        if self._events is not None:
            self._events.saved(saved, self.parts)

    @property
    def event_medium(self) -> str:
        return self._backend.event_medium

    def take_events(self) -> list[Stored | Removed]:
        """The pool's blocks announced stored or removed since the last call (none with KV events off)."""
        return self._events.take(self.parts) if self._events is not None else []

    def request_finished(self, request: "Request", block_ids: "list[int] | tuple[list[int], ...]") -> tuple[bool, None]:
        # Saves finished within the step that computed the blocks: nothing holds them back.
        self._forget(request.request_id)
        return False, None

    def _forget(self, req_id: str) -> None:
        self._lookups.forget(req_id)
        self._loads.forget(req_id)
        self._saves.forget(req_id)
        self._buffer.release(req_id)

    def close(self) -> None:
        if self._migration is not None:
            self._migration.close()
        self._backend.close()

