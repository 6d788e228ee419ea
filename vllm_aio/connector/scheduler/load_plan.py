"""``LoadPlanner``: which pool blocks each admitted request loads, and what came of the promise.

vLLM asks how many tokens beyond its own prefix cache the pool can supply
(``matched_tokens``), allocates blocks for them, and tells the connector
(``admit``); the blocks to load then travel with the next step's metadata.
What was promised is remembered per request (a *claim*) until the request
finishes, is preempted, or its load is reported failed, so that failed hits
are counted once, from the first block that failed: what vLLM recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_aio.config import TransferMode
from vllm_aio.connector.scheduler.leases import Leases
from vllm_aio.connector.scheduler.lookups import PoolLookups
from vllm_aio.shared.deployment import Deployment
from vllm_aio.shared.keying import PoolKeying
from vllm_aio.shared.metadata import BlockTransfer, LookupCounts

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class _Plan:
    local_tokens: int  # vLLM's own prefix-cache hit, block aligned


@dataclass
class _Claim:
    """Pool blocks a request was promised: loaded into ``block_ids`` (of every group) for tokens [start, end)."""

    block_ids: list[int]
    start_tokens: int  # block aligned: the first loaded block's first token
    end_tokens: int


class LoadPlanner:
    def __init__(self, deployment: Deployment, lookups: PoolLookups, leases: Leases, keying: PoolKeying) -> None:
        self._dep = deployment
        self._lookups = lookups
        self._leases = leases
        self._keying = keying
        self._plans: dict[str, _Plan] = {}  # the latest lookup answer; replaced on every call (idempotent)
        self._pending: list[BlockTransfer] = []  # loads for the next metadata
        self._claims: dict[str, _Claim] = {}
        self._counts = LookupCounts()
        # Requests whose pool load failed whole (hybrid models): vLLM recomputes
        # them from the start and asks again, and the pool must not be offered twice.
        self._recompute: set[str] = set()

    def matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """vLLM's ``get_num_new_matched_tokens``: pool tokens beyond its own hit, and whether they load async."""
        if not self._dep.load_enabled or request.request_id in self._recompute:
            return 0, False
        bs = self._dep.block_size
        hit_blocks = self._lookups.hit_blocks(request, num_computed_tokens // bs)
        hit_tokens = min(hit_blocks * bs, request.num_tokens - 1)  # the last token is always computed
        new_tokens = max(0, hit_tokens - num_computed_tokens)
        self._plans[request.request_id] = _Plan(num_computed_tokens)
        return new_tokens, new_tokens > 0 and self._dep.transfer_mode is TransferMode.ASYNC

    def admit(self, request: "Request", block_ids: "tuple[list[int], ...]", num_external_tokens: int,
              counted: bool) -> None:
        """Plan the load of the blocks vLLM allocated for the hit.

        ``counted``: the request's prompt lookup counts in the hit and miss tokens
        (not a resumed request's, whose lookup covers generated tokens too). What
        vLLM's own prefix cache held was never looked up: neither hit nor miss.
        """
        plan = self._plans.pop(request.request_id, None)
        if counted:
            local = plan.local_tokens if plan is not None else 0
            self._counts.hit_tokens += num_external_tokens
            self._counts.miss_tokens += request.num_prompt_tokens - local - num_external_tokens
        if num_external_tokens == 0 or plan is None:
            return
        bs = self._dep.block_size
        first = plan.local_tokens // bs
        last = -(-(plan.local_tokens + num_external_tokens) // bs)
        parts = self._keying.parts
        claimed = []
        for g, ids in enumerate(block_ids):
            start = first_held(ids, first, last)  # a sliding window's leading blocks are null
            keys = self._keying.group_hashes(request.block_hashes[start:last], g)
            self._leases.hold(parts, keys)
            self._pending.append(BlockTransfer.of(request.request_id, ids[start:last], keys, start))
            claimed.extend(ids[start:last])
        self._claims[request.request_id] = _Claim(claimed, first * bs, plan.local_tokens + num_external_tokens)

    def take(self, resumed: set[str]) -> tuple[list[BlockTransfer], LookupCounts]:
        """The loads and lookup counts of this step's metadata. A resumed request
        that loads nothing now was preempted since its claim: its old blocks may be another's."""
        loads, counts = self._pending, self._counts
        self._pending, self._counts = [], LookupCounts()
        for req_id in resumed - {t.req_id for t in loads}:
            self._claims.pop(req_id, None)
        return loads, counts

    def failed(self, invalid_block_ids: set[int], failed_req_ids: set[str]) -> None:
        """Count the hit tokens that the pool promised and the workers could not load.

        ``invalid_block_ids`` is the union over every worker: each failed
        request is counted once, from its first failed block on, which is
        what vLLM recomputes. ``failed_req_ids`` (hybrid models, whose loads
        fail per request): vLLM recomputes the whole request, and asks for it
        again as for a new one; it gets no pool hit then.
        """
        if not invalid_block_ids and not failed_req_ids:
            return
        self._recompute |= failed_req_ids
        bs = self._dep.block_size
        for req_id, claim in list(self._claims.items()):
            if req_id in failed_req_ids:
                self._counts.failed_hit_tokens += claim.end_tokens - claim.start_tokens
                del self._claims[req_id]
                continue
            bad = [i for i, b in enumerate(claim.block_ids) if b in invalid_block_ids]
            if bad:
                self._counts.failed_hit_tokens += claim.end_tokens - claim.start_tokens - bad[0] * bs
                del self._claims[req_id]

    def forget(self, req_id: str) -> None:
        """``req_id`` finished: its blocks are vLLM's to hand out again."""
        self._plans.pop(req_id, None)
        self._claims.pop(req_id, None)
        self._recompute.discard(req_id)


def first_held(block_ids: list[int], start: int, end: int) -> int:
    """The first block from ``start`` on that is not vLLM's null block (id 0).

    A sliding-window group's table starts with null blocks where its window
    has passed; they hold nothing of the request and must be neither loaded
    into nor saved from.
    """
    while start < end and block_ids[start] == 0:
        start += 1
    return start
