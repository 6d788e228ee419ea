"""The scheduler half: decides which blocks to load from and save to the pool.

It runs in vLLM's engine-core process, on its scheduling thread, and never
touches KV bytes. Per step it turns vLLM's scheduling decisions into an
``AioConnectorMetadata``: the blocks each request loads before its forward
(pool hits beyond vLLM's own prefix cache) and the blocks that become full
during the forward and get saved.

Saved blocks are copied out of the cache inside the step that filled them
(the worker's ``wait_for_save``), before vLLM can free or reuse a block; the
pool puts go on from staging. So ``request_finished`` never has to hold blocks
back: there is no pending state that could keep blocks alive forever.

Lookups cost one probe per block, not per part (``Backend.count_complete_blocks``),
and are incremental: vLLM asks again on every step while a request waits, so
the blocks already found complete are remembered with the pool's presence
epoch, and the next call resumes after them unless the epoch moved (a value
may have gone). A store with no epoch is asked again from the first block each
time: one bounded round trip, while a remembered answer could be seconds or
minutes old and turn into a burst of failed loads.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_aio.backends import Backend
from vllm_aio.connector.deployment import Deployment
from vllm_aio.connector.events import KVEvents
from vllm_aio.connector.metadata import AioConnectorMetadata, BlockTransfer, BufferStep, LookupCounts
from vllm_aio.log import get_logger
from vllm_aio.pool.keys import BlockParts
from vllm_aio.pool.ownership import Ownership

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)


@dataclass
class _LoadPlan:
    local_tokens: int  # vLLM's own prefix-cache hit, block aligned
    hit_tokens: int  # tokens available once the pool blocks are loaded


@dataclass
class _Found:
    """Blocks [start, end) of a waiting request found complete while the presence epoch was ``epoch``."""

    start: int
    end: int
    epoch: int
    digest: str  # the namespace they were found under


@dataclass
class _Claim:
    """Pool blocks a request was promised: loaded into ``block_ids`` for tokens [start, end)."""

    block_ids: list[int]
    start_tokens: int  # block aligned: the first loaded block's first token
    end_tokens: int


@dataclass
class _Tracker:
    """A running request: its block ids and how many of its blocks were handed to saves."""

    request: "Request"
    block_ids: list[int] = field(default_factory=list)
    num_saved_blocks: int = 0
    # Block indices [start, end) loaded from the pool: already stored there.
    loaded: tuple[int, int] = (0, 0)
    # Blocks a migration asked to have stored, generated ones included (``flush``).
    flush_blocks: int = 0
    # Tokens whose KV the steps scheduled so far computed: what a preemption can save.
    computed_tokens: int = 0


class AioScheduler:
    def __init__(self, deployment: Deployment, backend: Backend, events: KVEvents | None = None,
                 lease_seconds: float = 30.0) -> None:
        self._dep = deployment
        self._backend = backend
        # How long the blocks promised to a load are kept from eviction: the
        # worker reads them in the next step, bounded by transfer_timeout.
        self._lease_seconds = lease_seconds
        self._events = events  # with vLLM's KV cache events: told of saves planned and blocks found missing
        self.namespace = deployment.namespace
        # A block hits only when every distinct shard of the deployment (and,
        # layerwise, every layer of it) is stored. Replaced as a whole when the
        # weight version changes (another thread: the migration control).
        self.parts = self._parts_of(deployment.namespace)
        # Migrations' flush requests: last block hash -> blocks to store
        # (``request_flush``, from the control thread; taken at the next step).
        self._flush_lock = threading.Lock()
        self._flushes: dict[bytes, tuple[int, int]] = {}  # -> (blocks, step when asked)
        self._flushing: set[bytes] = set()  # those matched to a running request
        self._unmatched: set[bytes] = set()  # those no running request held for two steps
        self._steps = 0  # build_connector_meta calls so far
        # req_id -> latest lookup answer; replaced on every call (idempotent).
        self._plans: dict[str, _LoadPlan] = {}
        # req_id -> what lookups found for it, while it waits; dropped when it
        # is admitted or finishes (update_state_after_alloc, request_finished).
        self._found: dict[str, _Found] = {}
        # Loads decided by update_state_after_alloc, sent with the next metadata.
        self._pending_loads: list[BlockTransfer] = []
        self._trackers: dict[str, _Tracker] = {}
        # req_id -> its latest pool load, until the request finishes, is
        # preempted, or its load is reported failed (update_connector_output).
        self._claims: dict[str, _Claim] = {}
        self._lookups = LookupCounts()

    def _parts_of(self, namespace) -> BlockParts:
        return BlockParts(
            namespace.digest(),
            tuple(Ownership(self._dep.topology()).all_shard_ids()),
            tuple(unit.tag for unit in self._dep.units()),
        )

    # ---- runtime changes (the migration control's thread) -----------------
    def set_weight_version(self, version: str) -> None:
        """Key everything from now on under ``version``: KV of other weights stops hitting.

        The workers follow with the next step's metadata. Lookups remembered
        for waiting requests are forgotten (they were under the old keys).
        """
        namespace = dataclasses.replace(self.namespace, weight_version=version)
        self.namespace, self.parts = namespace, self._parts_of(namespace)
        self._found.clear()

    def request_flush(self, last_hash: bytes, num_blocks: int) -> None:
        """Store the first ``num_blocks`` full blocks of the running request whose
        ``num_blocks``-th block hash is ``last_hash`` (block hashes are chained, so
        one hash names the whole prefix), generated tokens included."""
        with self._flush_lock:
            blocks, _ = self._flushes.get(last_hash, (0, 0))
            self._flushes[last_hash] = (max(num_blocks, blocks), self._steps)

    def flush_state(self, last_hash: bytes) -> bool | None:
        """True: a step found the running request a flush names; False: two steps
        ran without it (it finished, or never ran here); None: not known yet.

        Counted in steps, not seconds: a loaded machine makes steps slow, not rare."""
        with self._flush_lock:
            if last_hash in self._flushing:
                return True
            return False if last_hash in self._unmatched else None

    def forget_flush(self, last_hash: bytes) -> None:
        with self._flush_lock:
            self._flushes.pop(last_hash, None)
            self._flushing.discard(last_hash)
            self._unmatched.discard(last_hash)

    def _take_flushes(self) -> None:
        """Mark the running requests that migrations asked to have stored."""
        with self._flush_lock:
            self._steps += 1
            if not self._flushes:
                return
            wanted = dict(self._flushes)
        matched = set()
        for tracker in self._trackers.values():
            hashes = tracker.request.block_hashes
            for last_hash, (count, _) in wanted.items():
                if len(hashes) >= count and hashes[count - 1] == last_hash:
                    tracker.flush_blocks = max(tracker.flush_blocks, count)
                    matched.add(last_hash)
        with self._flush_lock:
            self._flushing |= matched & set(self._flushes)
            self._unmatched |= {h for h, (_, asked) in self._flushes.items()
                                if h not in self._flushing and self._steps - asked >= 2}

    # ---- lookup ----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        if not self._dep.load_enabled:
            return 0, False
        bs = self._dep.block_size
        hit_blocks = self._complete_blocks(request, num_computed_tokens // bs)
        hit_tokens = min(hit_blocks * bs, request.num_tokens - 1)  # the last token is always computed
        new_tokens = max(0, hit_tokens - num_computed_tokens)
        if new_tokens == 0:
            self._plans.pop(request.request_id, None)
            return 0, False
        self._plans[request.request_id] = _LoadPlan(num_computed_tokens, hit_tokens)
        return new_tokens, self._dep.load_async

    def _complete_blocks(self, request: "Request", first: int) -> int:
        """The end of the leading blocks from ``first`` on that the pool holds completely."""
        req_id, hashes, parts = request.request_id, request.block_hashes, self.parts
        try:
            epoch = self._backend.presence_epoch()  # before the lookup: an eviction during it moves it
            found = self._found.get(req_id)
            resume = first
            if (found is not None and epoch is not None and found.epoch == epoch and found.start <= first
                    and found.digest == parts.namespace_digest):
                resume = max(first, found.end)  # blocks [first, found.end) are still complete
            end = resume + self._backend.count_complete_blocks(parts, hashes[resume:])
            if self._events is not None and end < len(hashes):
                self._events.missing(hashes[end])
        except Exception as exc:  # the pool is down: serve everything by recompute
            logger.warning("vllm_aio: pool lookup failed, treating as a miss: %s", exc)
            self._found.pop(req_id, None)
            return first
        if epoch is not None:
            self._found[req_id] = _Found(first, end, epoch, parts.namespace_digest)
        return end

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        self._found.pop(req_id, None)  # admitted: no more lookups until it waits again
        known = req_id in self._trackers  # re-admitted: preempted, or its async load finished
        tracker = self._trackers.setdefault(req_id, _Tracker(request))
        plan = self._plans.pop(req_id, None)
        prompt_tokens = request.num_prompt_tokens
        if num_external_tokens == 0 or plan is None:
            if not known:
                self._lookups.miss_tokens += prompt_tokens
            return
        bs = self._dep.block_size
        first = plan.local_tokens // bs
        last = -(-(plan.local_tokens + num_external_tokens) // bs)
        block_ids = blocks.get_block_ids()[0]
        self._lease(request.block_hashes[first:last])
        self._pending_loads.append(
            BlockTransfer.of(req_id, block_ids[first:last], request.block_hashes[first:last], first)
        )
        tracker.loaded = (first, last)
        self._claims[req_id] = _Claim(list(block_ids[first:last]), first * bs, plan.local_tokens + num_external_tokens)
        if not known:  # the prompt's lookup; a resumed request's (generated tokens too) is not one
            self._lookups.hit_tokens += num_external_tokens
            self._lookups.miss_tokens += prompt_tokens - plan.local_tokens - num_external_tokens

    def _lease(self, hashes: list[bytes]) -> None:
        """Keep the promised blocks from eviction until the worker has read them (where the
        store allows, ``Backend.lease_blocks``): without it, saves of this very step can
        evict them, and the load then fails and vLLM recomputes."""
        try:
            self._backend.lease_blocks(self.parts, hashes, self._lease_seconds)
        except Exception as exc:  # the load finds out what is gone, and vLLM recomputes that
            logger.warning("vllm_aio: pool lease failed, the load goes on unprotected: %s", exc)

    # ---- per step --------------------------------------------------------
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> AioConnectorMetadata:
        for req_id in scheduler_output.finished_req_ids:
            self._trackers.pop(req_id, None)
            self._claims.pop(req_id, None)
        meta = AioConnectorMetadata(
            loads=self._pending_loads, lookups=self._lookups, namespace_digest=self.parts.namespace_digest
        )
        for req_id in scheduler_output.preempted_req_ids or ():
            self._plan_rescue(meta, req_id)  # first: it may be resumed in this same step
        loading = {t.req_id for t in self._pending_loads}
        for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids - loading:
            self._claims.pop(req_id, None)  # preempted since: its old blocks may be another's now
        self._pending_loads, self._lookups = [], LookupCounts()
        scheduled: list[tuple[_Tracker, int]] = []  # with their computed tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracker = self._trackers[new.req_id]
            tracker.block_ids = list(new.block_ids[0])
            tracker.num_saved_blocks = 0
            scheduled.append((tracker, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._trackers[req_id]
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted: a fresh block list
                tracker.block_ids = list(new_ids[0]) if new_ids else []
                tracker.num_saved_blocks = 0
            elif new_ids:
                tracker.block_ids.extend(new_ids[0])
            scheduled.append((tracker, cached.num_computed_tokens[i]))
        self._take_flushes()
        for tracker, computed in scheduled:
            self._plan_save(meta, tracker, computed, scheduler_output)
            tracker.computed_tokens = computed + scheduler_output.num_scheduled_tokens[tracker.request.request_id]
        if self._dep.buffer_layers:
            meta.buffer = self._buffer_step(scheduled, scheduler_output)
        return meta

    def _buffer_step(
        self, scheduled: list[tuple[_Tracker, int]], scheduler_output: "SchedulerOutput"
    ) -> BufferStep:
        """The blocks the dynamic buffer streams through the device this step.

        The one decision point for residency: every scheduled request streams
        all its blocks through the S buffers. A policy keeping some requests
        resident in every layer (e.g. high-priority
        requests) would change the set chosen here and the KV cache plan.

        Loaded (``resident``): only the blocks holding tokens from before the
        step's first computed token, ``block_ids[:ceil(computed / block_size)]``
        (the last of them may be partly full, and is written too). The step's
        brand-new blocks are not loaded: attention never reads a slot the step
        has not written yet (slots past the sequence are masked), and each
        layer writes its new K/V into the buffer before its attention, so
        loading them would copy bytes that are overwritten or never read (a
        prefill without a cached prefix loads nothing). Written back
        (``written``): every block the step's tokens land in.
        """
        step = BufferStep(
            zeroed=list(scheduler_output.new_block_ids_to_zero or []),
            copies=[(c.src_block_id, c.dst_block_id) for c in scheduler_output.kv_cache_block_copies or []],
        )
        bs = self._dep.block_size
        for tracker, computed in scheduled:
            end = -(-(computed + scheduler_output.num_scheduled_tokens[tracker.request.request_id]) // bs)
            step.resident.extend(tracker.block_ids[: -(-computed // bs)])
            step.written.extend(tracker.block_ids[computed // bs : end])
        return step

    def _plan_save(
        self,
        meta: AioConnectorMetadata,
        tracker: _Tracker,
        num_computed_tokens: int,
        scheduler_output: "SchedulerOutput",
    ) -> None:
        """Hand the blocks this step fills to the worker; the pool skips known ones."""
        if not self._dep.save_enabled:
            return
        request = tracker.request
        bs = self._dep.block_size
        done_tokens = num_computed_tokens + scheduler_output.num_scheduled_tokens[request.request_id]
        wanted = done_tokens
        if not self._dep.save_decode_cache:  # a migration's flush stores generated blocks too
            wanted = min(done_tokens, max(request.num_prompt_tokens, tracker.flush_blocks * bs))
        meta.saves.extend(self._unsaved(tracker, wanted // bs))

    def _plan_rescue(self, meta: AioConnectorMetadata, req_id: str) -> None:
        """Save a preempted request's full blocks, generated ones included, so
        that its resumption loads them instead of recomputing.

        vLLM has freed its blocks already and may hand them to another request
        in this very step, so these are not ordinary saves: the worker copies
        them out before the step writes anything (``handle_preemptions``).
        """
        tracker = self._trackers.get(req_id)
        if tracker is None or not self._dep.save_enabled:
            return
        meta.rescues.extend(self._unsaved(tracker, tracker.computed_tokens // self._dep.block_size))

    def _unsaved(self, tracker: _Tracker, full: int) -> list[BlockTransfer]:
        """Transfers of the request's blocks up to ``full`` not handed to a save
        yet, less those loaded from the pool (stored there already)."""
        request = tracker.request
        full = min(full, len(request.block_hashes), len(tracker.block_ids))
        start = tracker.num_saved_blocks
        if full <= start:
            return []
        tracker.num_saved_blocks = full
        skip_start, skip_end = tracker.loaded
        retention = self._dep.retention_of(request.priority)
        transfers = [
            BlockTransfer.of(request.request_id, tracker.block_ids[lo:hi], request.block_hashes[lo:hi], lo, retention)
            for lo, hi in ((start, min(full, skip_start)), (max(start, skip_end), full))
            if lo < hi
        ]
        if self._events is not None:
            for t in transfers:
                self._events.expect(request, t.first_index, t.first_index + len(t))
        return transfers

    def update_connector_output(self, invalid_block_ids: set[int]) -> None:
        """Count the hit tokens that the pool promised and the workers could not load.

        ``invalid_block_ids`` is the union over every worker: each failed
        request is counted once, from its first failed block on, which is
        what vLLM recomputes.
        """
        if not invalid_block_ids:
            return
        bs = self._dep.block_size
        for req_id, claim in list(self._claims.items()):
            bad = [i for i, b in enumerate(claim.block_ids) if b in invalid_block_ids]
            if bad:
                self._lookups.failed_hit_tokens += claim.end_tokens - claim.start_tokens - bad[0] * bs
                del self._claims[req_id]

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, None]:
        # Saves finished within the step that computed the blocks.
        self._trackers.pop(request.request_id, None)
        self._claims.pop(request.request_id, None)
        self._found.pop(request.request_id, None)
        return False, None

    def close(self) -> None:
        self._backend.close()
