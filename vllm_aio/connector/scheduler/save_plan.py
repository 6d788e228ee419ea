"""``SavePlanner``: which blocks of each running request are saved, and when.

Saved blocks are copied out of the cache inside the step that filled them
(the worker's ``wait_for_save``), before vLLM can free or reuse a block; the
pool puts go on from staging. So a finished request never has to hold blocks
back: there is no pending state that could keep blocks alive forever.

Per running request (``RequestBlocks``) it follows vLLM's block lists (fresh
after a preemption), how many blocks were handed to saves, and how many blocks
a migration asked to have stored. Blocks computed before a request's (re)start
are never saved: vLLM's own prefix cache held them (another request computed,
and saved, them) or they were loaded from the pool (stored there already).
A preempted request's full blocks are *rescued*: saved before the
step writes anything, since vLLM may hand them to another request at once.

Hybrid models: a sliding-window group frees the blocks that leave its window
while the request runs and hands them to other requests, so its saves and
rescues name only the blocks vLLM still held at the step's start, and never
its null block (id 0).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_aio.connector.events import KVEvents
from vllm_aio.connector.scheduler.load_plan import first_held
from vllm_aio.shared.deployment import Deployment
from vllm_aio.shared.keying import PoolKeying
from vllm_aio.shared.metadata import BlockTransfer

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass
class RequestBlocks:
    """A running request: per KV cache group, its block ids and how many of its blocks were handed to saves."""

    request: "Request"
    num_groups: int = 1
    block_ids: list[list[int]] = field(default_factory=list)
    num_saved_blocks: list[int] = field(default_factory=list)
    # Blocks a migration asked to have stored, generated ones included (``migration/flushes.py``).
    flush_blocks: int = 0
    # Tokens whose KV the steps scheduled so far computed: what a preemption can save.
    computed_tokens: int = 0
    # Tokens computed when its latest step started: a sliding window held its blocks from there on.
    step_start_tokens: int = 0

    def __post_init__(self) -> None:
        self.restart()

    def restart(self, block_ids: "tuple[list[int], ...] | None" = None, held_blocks: int = 0) -> None:
        """A fresh block list (admitted, or resumed after a preemption) whose first ``held_blocks``
        blocks were computed before: by another request (vLLM's prefix cache) or by the pool (loaded)."""
        self.block_ids = [list(ids) for ids in block_ids] if block_ids else [[] for _ in range(self.num_groups)]
        self.num_saved_blocks = [held_blocks] * self.num_groups

    def rewind(self, num_computed_tokens: int, block_size: int) -> None:
        """vLLM took computed tokens back (a failed load): the blocks from there on are computed
        again, and saved then (the worker did not save what the failed step computed)."""
        if num_computed_tokens < self.computed_tokens:
            full = num_computed_tokens // block_size
            self.num_saved_blocks = [min(n, full) for n in self.num_saved_blocks]

    def reads(self, loaded: set[int], block_size: int) -> array:
        """The blocks of ``loaded`` that the latest step reads: those holding the tokens computed before it."""
        held = -(-self.step_start_tokens // block_size)
        return array("i", (b for ids in self.block_ids for b in ids[:held] if b in loaded))


@dataclass
class Scheduled:
    """A request in this step: its blocks, tokens computed before the step and tokens the step computes."""

    blocks: RequestBlocks
    computed_tokens: int
    new_tokens: int

    @property
    def done_tokens(self) -> int:
        return self.computed_tokens + self.new_tokens


class SavePlanner:
    def __init__(self, deployment: Deployment, keying: PoolKeying, events: KVEvents | None = None) -> None:
        self._dep = deployment
        self._keying = keying
        self._events = events  # told of every save planned
        self._running: dict[str, RequestBlocks] = {}

    def admit(self, request: "Request") -> bool:
        """Follow ``request`` from now on; whether it was followed already (preempted, or its async load done)."""
        known = request.request_id in self._running
        if not known:
            self._running[request.request_id] = RequestBlocks(request, len(self._dep.groups))
        return known

    def forget(self, req_id: str) -> None:
        self._running.pop(req_id, None)

    def running(self) -> Iterator[tuple[str, Sequence[bytes]]]:
        """Every followed request's id and block hashes (what a migration's flush names)."""
        return ((req_id, blocks.request.block_hashes) for req_id, blocks in self._running.items())

    def flush(self, req_id: str, num_blocks: int) -> None:
        """Store the first ``num_blocks`` full blocks of ``req_id``, generated ones included."""
        blocks = self._running[req_id]
        blocks.flush_blocks = max(blocks.flush_blocks, num_blocks)

    def schedule(self, scheduler_output: "SchedulerOutput") -> list[Scheduled]:
        """The step's requests, with vLLM's block lists brought up to date."""
        tokens, bs = scheduler_output.num_scheduled_tokens, self._dep.block_size
        scheduled = []
        for new in scheduler_output.scheduled_new_reqs:
            blocks = self._running[new.req_id]
            blocks.restart(new.block_ids, new.num_computed_tokens // bs)
            scheduled.append(Scheduled(blocks, new.num_computed_tokens, tokens[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            blocks = self._running[req_id]
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted: a fresh block list
                blocks.restart(new_ids, cached.num_computed_tokens[i] // bs)
            else:
                blocks.rewind(cached.num_computed_tokens[i], bs)
                for ids, added in zip(blocks.block_ids, new_ids or ()):
                    ids.extend(added)
            scheduled.append(Scheduled(blocks, cached.num_computed_tokens[i], tokens[req_id]))
        return scheduled

    def save(self, scheduled: list[Scheduled], loads: list[BlockTransfer]) -> list[BlockTransfer]:
        """The blocks this step fills, handed to the worker; the pool skips known ones.

        Each save names the blocks of this step's ``loads`` its request reads:
        if one fails to load, the worker leaves the request's save out.
        """
        loaded = {b for t in loads for b in t.block_ids}
        saves = []
        for s in scheduled:
            blocks = s.blocks
            blocks.step_start_tokens = s.computed_tokens
            if self._dep.save_enabled:
                wanted = s.done_tokens
                if not self._dep.save_decode_cache:  # a migration's flush stores generated blocks too
                    flushed = blocks.flush_blocks * self._dep.block_size
                    wanted = min(wanted, max(blocks.request.num_prompt_tokens, flushed))
                transfers = self._unsaved(blocks, wanted // self._dep.block_size)
                if loaded and transfers:
                    reads = blocks.reads(loaded, self._dep.block_size)
                    for t in transfers:
                        t.reads = reads
                saves.extend(transfers)
            blocks.computed_tokens = s.done_tokens
        return saves

    def rescue(self, req_id: str) -> list[BlockTransfer]:
        """Save a preempted request's full blocks, generated ones included, so
        that its resumption loads them instead of recomputing.

        vLLM has freed its blocks already and may hand them to another request
        in this very step, so these are not ordinary saves: the worker copies
        them out before the step writes anything (``handle_preemptions``).
        """
        blocks = self._running.get(req_id)
        if blocks is None or not self._dep.save_enabled:
            return []
        return self._unsaved(blocks, blocks.computed_tokens // self._dep.block_size)

    def _unsaved(self, blocks: RequestBlocks, full: int) -> list[BlockTransfer]:
        """Transfers of the request's blocks up to ``full`` not handed to a save
        yet, per group, less those a sliding window no longer held when the latest step started."""
        request = blocks.request
        transfers: list[BlockTransfer] = []
        for g, group in enumerate(self._dep.groups):
            block_ids = blocks.block_ids[g]
            end = min(full, len(request.block_hashes), len(block_ids))
            start = blocks.num_saved_blocks[g]
            if end <= start:
                continue
            blocks.num_saved_blocks[g] = end
            held = group.first_held_block(blocks.step_start_tokens, self._dep.block_size)
            start = first_held(block_ids, max(start, held), end)
            if start < end:
                transfers.append(BlockTransfer.of(
                    request.request_id, block_ids[start:end],
                    self._keying.group_hashes(request.block_hashes[start:end], g), start,
                    self._dep.retention_of(request.priority),
                ))
        if self._events is not None:
            for t in transfers:
                self._events.expect(request, t.first_index, t.first_index + len(t))
        return transfers
