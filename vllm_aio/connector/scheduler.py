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

Hybrid models (several KV cache groups, ``Deployment.groups``): every group's
blocks are stored under its own keys (``group_block_hashes``), loaded and saved
per group. A prefix hits when every full-attention group holds all its blocks
and every sliding-window group the blocks vLLM keeps for the hit (those in the
window of the next token), as vLLM's own prefix cache decides. A sliding-window
group frees the blocks that leave its window while the request runs and hands
them to other requests, so its saves and rescues name only the blocks vLLM
still held at the step's start, and never its null block (id 0).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_aio import vllm_compat
from vllm_aio.backends import Backend
from vllm_aio.connector.deployment import CacheGroup, Deployment
from vllm_aio.connector.events import KVEvents
from vllm_aio.connector.metadata import AioConnectorMetadata, BlockTransfer, BufferStep, LookupCounts
from vllm_aio.connector.residency import Residency
from vllm_aio.log import get_logger
from vllm_aio.pool.keys import BlockParts, group_block_hashes
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
    """Pool blocks a request was promised: loaded into ``block_ids`` (of every group) for tokens [start, end)."""

    block_ids: list[int]
    start_tokens: int  # block aligned: the first loaded block's first token
    end_tokens: int


@dataclass
class _Tracker:
    """A running request: per KV cache group, its block ids and how many of its blocks were handed to saves."""

    request: "Request"
    num_groups: int = 1
    block_ids: list[list[int]] = field(default_factory=list)
    num_saved_blocks: list[int] = field(default_factory=list)
    # Per group, block indices [start, end) loaded from the pool: already stored there.
    loaded: list[tuple[int, int]] = field(default_factory=list)
    # Blocks a migration asked to have stored, generated ones included (``flush``).
    flush_blocks: int = 0
    # Tokens whose KV the steps scheduled so far computed: what a preemption can save.
    computed_tokens: int = 0
    # Tokens computed when its latest step started: a sliding window held its blocks from there on.
    step_start_tokens: int = 0

    def __post_init__(self) -> None:
        self.restart()
        self.loaded = [(0, 0)] * self.num_groups

    def restart(self, block_ids: "tuple[list[int], ...] | None" = None) -> None:
        """A fresh block list (admitted, or resumed after a preemption): nothing of it saved yet."""
        self.block_ids = [list(ids) for ids in block_ids] if block_ids else [[] for _ in range(self.num_groups)]
        self.num_saved_blocks = [0] * self.num_groups


# A load is read in the step whose metadata carries it (one step later with async scheduling):
# four steps leave room; a second at least covers a pace not measured yet.
LEASE_STEPS = 4
LEASE_MIN_SECONDS = 1.0


class _StepClock:
    """The engine's recent pace: the median interval between the last metadata builds
    (an idle gap between requests is one sample, which the median ignores)."""

    def __init__(self, clock: Callable[[], float], samples: int = 16) -> None:
        self._clock = clock
        self._last: float | None = None
        self._intervals: deque[float] = deque(maxlen=samples)

    def tick(self) -> None:
        now = self._clock()
        if self._last is not None:
            self._intervals.append(now - self._last)
        self._last = now

    def step_seconds(self) -> float:
        return statistics.median(self._intervals) if self._intervals else 0.0


class AioScheduler:
    def __init__(self, deployment: Deployment, backend: Backend, events: KVEvents | None = None,
                 max_lease_seconds: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._dep = deployment
        self._backend = backend
        # The blocks promised to a load are leased for a few steps (``_lease``),
        # never longer than a load may take (transfer_timeout).
        self._max_lease_seconds = max_lease_seconds
        self._steps_clock = _StepClock(clock)
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
        # req_id -> what lookups found for it per group, while it waits; dropped
        # when it is admitted or finishes (update_state_after_alloc, request_finished).
        self._found: dict[str, dict[int, _Found]] = {}
        # Key hashes per group: a model of one group keys blocks by vLLM's hash alone.
        self._key_groups: list[int | None] = list(range(len(deployment.groups))) if deployment.hybrid else [None]
        # Loads decided by update_state_after_alloc, sent with the next metadata.
        self._pending_loads: list[BlockTransfer] = []
        self._trackers: dict[str, _Tracker] = {}
        # req_id -> its latest pool load, until the request finishes, is
        # preempted, or its load is reported failed (update_connector_output).
        self._claims: dict[str, _Claim] = {}
        self._lookups = LookupCounts()
        # Requests whose pool load failed whole (hybrid models): vLLM recomputes
        # them from the start and asks again, and the pool must not be offered twice.
        self._recompute: set[str] = set()
        # With dynamic_buffer_resident_blocks: the highest retention class's requests stay on the device.
        self._residency = Residency(deployment.resident_blocks) if deployment.resident_blocks else None

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
        if not self._dep.load_enabled or request.request_id in self._recompute:
            return 0, False
        bs = self._dep.block_size
        hit_blocks = self._hit_blocks(request, num_computed_tokens // bs)
        hit_tokens = min(hit_blocks * bs, request.num_tokens - 1)  # the last token is always computed
        new_tokens = max(0, hit_tokens - num_computed_tokens)
        if new_tokens == 0:
            self._plans.pop(request.request_id, None)
            return 0, False
        self._plans[request.request_id] = _LoadPlan(num_computed_tokens, hit_tokens)
        return new_tokens, self._dep.load_async

    def _hit_blocks(self, request: "Request", first: int) -> int:
        """The end of the leading blocks from ``first`` on that every group can load.

        Full-attention groups need every block; a sliding-window group only the
        blocks in the window of the hit's next token (vLLM nulls the others),
        so its hit may end before its first missing block. Repeated until no
        group shortens the hit, since a shorter hit moves each window back.
        """
        groups = list(enumerate(self._dep.groups))
        try:
            end = len(request.block_hashes)
            for g, group in groups:
                if group.window is None:
                    end = self._complete_blocks(request, g, first, end)
            sliding = [(g, group) for g, group in groups if group.window is not None]
            while sliding:
                shortened = end
                for g, group in sliding:
                    shortened = self._window_hit(request, g, group, first, shortened)
                if shortened == end:
                    break
                end = shortened
        except Exception as exc:  # the pool is down: serve everything by recompute
            logger.warning("vllm_aio: pool lookup failed, treating as a miss: %s", exc)
            self._found.pop(request.request_id, None)
            return first
        return end

    def _complete_blocks(self, request: "Request", g: int, first: int, end: int) -> int:
        """The end of the leading blocks of group ``g`` in [first, end) that the pool holds completely."""
        req_id, hashes, parts = request.request_id, request.block_hashes[:end], self.parts
        epoch = self._backend.presence_epoch()  # before the lookup: an eviction during it moves it
        found = self._found.get(req_id, {}).get(g)
        resume = first
        if (found is not None and epoch is not None and found.epoch == epoch and found.start <= first
                and found.digest == parts.namespace_digest):
            resume = min(max(first, found.end), end)  # blocks [first, found.end) are still complete
        keys = group_block_hashes(hashes[resume:], self._key_groups[g])
        complete = resume + self._backend.count_complete_blocks(parts, keys)
        if self._events is not None and complete < len(hashes):
            self._events.missing(hashes[complete])
        if epoch is not None:
            self._found.setdefault(req_id, {})[g] = _Found(first, complete, epoch, parts.namespace_digest)
        return complete

    def _window_hit(self, request: "Request", g: int, group: CacheGroup, first: int, end: int) -> int:
        """The longest hit ending at or before block ``end`` for which the pool holds the
        blocks of sliding-window group ``g`` that vLLM keeps (from ``first`` on: the
        earlier ones are vLLM's own hit)."""
        bs = self._dep.block_size
        while end > first:
            hit_tokens = min(end * bs, request.num_tokens - 1)
            start = max(first, group.first_held_block(hit_tokens, bs))
            keys = group_block_hashes(request.block_hashes[start:end], self._key_groups[g])
            complete = start + self._backend.count_complete_blocks(self.parts, keys)
            if complete == end:
                return end
            end = complete  # a hit past the missing block would need it
        return first

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        self._found.pop(req_id, None)  # admitted: no more lookups until it waits again
        known = req_id in self._trackers  # re-admitted: preempted, or its async load finished
        tracker = self._trackers.setdefault(req_id, _Tracker(request, len(self._dep.groups)))
        plan = self._plans.pop(req_id, None)
        prompt_tokens = request.num_prompt_tokens
        if num_external_tokens == 0 or plan is None:
            if not known:
                self._lookups.miss_tokens += prompt_tokens
            return
        bs = self._dep.block_size
        first = plan.local_tokens // bs
        last = -(-(plan.local_tokens + num_external_tokens) // bs)
        claimed: list[int] = []
        for g, block_ids in enumerate(blocks.get_block_ids()):
            start = _first_held(block_ids, first, last)  # a sliding window's leading blocks are null
            keys = group_block_hashes(request.block_hashes[start:last], self._key_groups[g])
            self._lease(keys)
            self._pending_loads.append(BlockTransfer.of(req_id, block_ids[start:last], keys, start))
            tracker.loaded[g] = (start, last)
            claimed.extend(block_ids[start:last])
        self._claims[req_id] = _Claim(claimed, first * bs, plan.local_tokens + num_external_tokens)
        if not known:  # the prompt's lookup; a resumed request's (generated tokens too) is not one
            self._lookups.hit_tokens += num_external_tokens
            self._lookups.miss_tokens += prompt_tokens - plan.local_tokens - num_external_tokens

    def lease_seconds(self) -> float:
        """How long a promised hit is kept: ``LEASE_STEPS`` steps of the engine's recent pace, at least
        ``LEASE_MIN_SECONDS``. Longer, leased values would crowd out what other requests save
        (and what a higher retention class should keep); a value gone before its load is recomputed."""
        return min(self._max_lease_seconds, max(LEASE_MIN_SECONDS, LEASE_STEPS * self._steps_clock.step_seconds()))

    def _lease(self, hashes: list[bytes]) -> None:
        """Keep the promised blocks from eviction until the worker has read them (where the
        store allows, ``Backend.lease_blocks``): without it, saves of this very step can
        evict them, and the load then fails and vLLM recomputes."""
        try:
            self._backend.lease_blocks(self.parts, hashes, self.lease_seconds())
        except Exception as exc:  # the load finds out what is gone, and vLLM recomputes that
            logger.warning("vllm_aio: pool lease failed, the load goes on unprotected: %s", exc)

    # ---- per step --------------------------------------------------------
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> AioConnectorMetadata:
        self._steps_clock.tick()
        for req_id in scheduler_output.finished_req_ids:
            self._trackers.pop(req_id, None)
            self._claims.pop(req_id, None)
            self._recompute.discard(req_id)
            self._release_residency(req_id)
        meta = AioConnectorMetadata(
            loads=self._pending_loads, lookups=self._lookups, namespace_digest=self.parts.namespace_digest
        )
        for req_id in scheduler_output.preempted_req_ids or ():
            self._plan_rescue(meta, req_id)  # first: it may be resumed in this same step
            self._release_residency(req_id)  # its blocks may be another's now
        loading = {t.req_id for t in self._pending_loads}
        for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids - loading:
            self._claims.pop(req_id, None)  # preempted since: its old blocks may be another's now
        self._pending_loads, self._lookups = [], LookupCounts()
        scheduled: list[tuple[_Tracker, int]] = []  # with their computed tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracker = self._trackers[new.req_id]
            tracker.restart(new.block_ids)
            scheduled.append((tracker, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._trackers[req_id]
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted: a fresh block list
                tracker.restart(new_ids)
            elif new_ids:
                for ids, added in zip(tracker.block_ids, new_ids):
                    ids.extend(added)
            scheduled.append((tracker, cached.num_computed_tokens[i]))
        self._take_flushes()
        for tracker, computed in scheduled:
            tracker.step_start_tokens = computed
            self._plan_save(meta, tracker, computed, scheduler_output)
            tracker.computed_tokens = computed + scheduler_output.num_scheduled_tokens[tracker.request.request_id]
        if self._dep.buffer_layers:
            meta.buffer = self._buffer_step(scheduled, scheduler_output)
        return meta

    def _buffer_step(
        self, scheduled: list[tuple[_Tracker, int]], scheduler_output: "SchedulerOutput"
    ) -> BufferStep:
        """The blocks the dynamic buffer streams through the device this step.

        Loaded (``resident``): only the blocks holding tokens from before the
        step's first computed token, ``block_ids[:ceil(computed / block_size)]``
        (the last of them may be partly full, and is written too). The step's
        brand-new blocks are not loaded: attention never reads a slot the step
        has not written yet (slots past the sequence are masked), and each
        layer writes its new K/V into the buffer before its attention, so
        loading them would copy bytes that are overwritten or never read (a
        prefill without a cached prefix loads nothing). Written back
        (``written``): every block the step's tokens land in.

        With ``dynamic_buffer_resident_blocks``, the blocks of requests of the
        highest retention class that fit stay on the device instead
        (``pinned``, ``residency.py``): not loaded, written back from their
        private place; a block taking its slot with K/V in it is ``promoted``.
        """
        step = BufferStep(
            zeroed=list(scheduler_output.new_block_ids_to_zero or []),
            copies=[(c.src_block_id, c.dst_block_id) for c in vllm_compat.kv_cache_block_copies(scheduler_output)],
        )
        bs = self._dep.block_size
        top = len(self._dep.priority_cutoffs)
        for tracker, computed in scheduled:
            end = -(-(computed + scheduler_output.num_scheduled_tokens[tracker.request.request_id]) // bs)
            block_ids = tracker.block_ids[0]  # the buffer refuses hybrid models (one group)
            loaded = -(-computed // bs)
            if self._residency is not None and self._dep.retention_of(tracker.request.priority) == top:
                step.promoted.extend(self._residency.place(tracker.request.request_id, block_ids[:end], loaded))
            step.resident.extend(block_ids[:loaded])
            step.written.extend(block_ids[computed // bs : end])
        if self._residency is not None:
            self._pin(step)
        return step

    def _pin(self, step: BufferStep) -> None:
        """Move the step's resident blocks from ``resident`` to ``pinned``; vLLM's
        zeroing or copy into a pinned block reaches the host copy only, so it is promoted again."""
        slots = {b: s for b in (*step.resident, *step.written) if (s := self._residency.slot(b)) is not None}
        step.pinned = sorted(slots.items())
        step.resident = [b for b in step.resident if b not in slots]
        updated = {*step.zeroed, *(dst for _, dst in step.copies)}
        step.promoted = sorted({*step.promoted, *(b for b in slots if b in updated)})

    def _release_residency(self, req_id: str) -> None:
        if self._residency is not None:
            self._residency.release(req_id)

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
        yet, per group, less those loaded from the pool (stored there already)
        and those a sliding window no longer held when the latest step started."""
        request = tracker.request
        transfers: list[BlockTransfer] = []
        for g, group in enumerate(self._dep.groups):
            block_ids = tracker.block_ids[g]
            end = min(full, len(request.block_hashes), len(block_ids))
            start = tracker.num_saved_blocks[g]
            if end <= start:
                continue
            tracker.num_saved_blocks[g] = end
            held = group.first_held_block(tracker.step_start_tokens, self._dep.block_size)
            start = _first_held(block_ids, max(start, held), end)
            transfers.extend(self._transfers(request, g, block_ids, start, end, tracker.loaded[g]))
        if self._events is not None:
            for t in transfers:
                self._events.expect(request, t.first_index, t.first_index + len(t))
        return transfers

    def _transfers(
        self, request: "Request", g: int, block_ids: list[int], start: int, end: int, loaded: tuple[int, int]
    ) -> list[BlockTransfer]:
        """Saves of group ``g``'s blocks [start, end), around the range ``loaded`` from the pool."""
        retention = self._dep.retention_of(request.priority)
        skip_start, skip_end = loaded
        return [
            BlockTransfer.of(
                request.request_id, block_ids[lo:hi],
                group_block_hashes(request.block_hashes[lo:hi], self._key_groups[g]), lo, retention,
            )
            for lo, hi in ((start, min(end, skip_start)), (max(start, skip_end), end))
            if lo < hi
        ]

    def update_connector_output(self, invalid_block_ids: set[int], failed_req_ids: set[str] = frozenset()) -> None:
        """Count the hit tokens that the pool promised and the workers could not load.

        ``invalid_block_ids`` is the union over every worker: each failed
        request is counted once, from its first failed block on, which is
        what vLLM recomputes. ``failed_req_ids`` (hybrid models, whose loads
        fail per request): vLLM recomputes the whole request, and asks for it
        again as for a new one; it gets no pool hit then (``_recompute``).
        """
        if not invalid_block_ids and not failed_req_ids:
            return
        self._recompute |= failed_req_ids
        bs = self._dep.block_size
        for req_id, claim in list(self._claims.items()):
            if req_id in failed_req_ids:
                self._lookups.failed_hit_tokens += claim.end_tokens - claim.start_tokens
                del self._claims[req_id]
                continue
            bad = [i for i, b in enumerate(claim.block_ids) if b in invalid_block_ids]
            if bad:
                self._lookups.failed_hit_tokens += claim.end_tokens - claim.start_tokens - bad[0] * bs
                del self._claims[req_id]

    def request_finished(self, request: "Request", block_ids: "list[int] | tuple[list[int], ...]") -> tuple[bool, None]:
        # Saves finished within the step that computed the blocks.
        self._trackers.pop(request.request_id, None)
        self._claims.pop(request.request_id, None)
        self._found.pop(request.request_id, None)
        self._recompute.discard(request.request_id)
        self._release_residency(request.request_id)
        return False, None

    def close(self) -> None:
        self._backend.close()


def _first_held(block_ids: list[int], start: int, end: int) -> int:
    """The first block from ``start`` on that is not vLLM's null block (id 0).

    A sliding-window group's table starts with null blocks where its window
    has passed; they hold nothing of the request and must be neither loaded
    into nor saved from.
    """
    while start < end and block_ids[start] == 0:
        start += 1
    return start
