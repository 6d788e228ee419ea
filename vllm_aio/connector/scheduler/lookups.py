"""``PoolLookups``: how many leading blocks of a waiting request the pool holds, per KV cache group.

Lookups cost one probe per block, not per part (``Backend.count_complete_blocks``),
and are incremental: vLLM asks again on every step while a request waits, so
the blocks already found complete are remembered with the pool's presence
epoch, and the next call resumes after them unless the epoch moved (a value
may have gone) or the keys changed (a new weight version). A store with no
epoch is asked again from the first block each time: one bounded round trip,
while a remembered answer could be seconds or minutes old and turn into a
burst of failed loads.

Hybrid models (several KV cache groups, ``Deployment.groups``): a prefix hits
when every full-attention group holds all its blocks and every sliding-window
group the blocks vLLM keeps for the hit (those in the window of the next
token), as vLLM's own prefix cache decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_aio.backends import Backend
from vllm_aio.connector.events import KVEvents
from vllm_aio.log import get_logger
from vllm_aio.shared.deployment import CacheGroup, Deployment
from vllm_aio.shared.keying import PoolKeying

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = get_logger(__name__)


@dataclass
class _Found:
    """Blocks [start, end) of a waiting request found complete while the presence epoch was ``epoch``."""

    start: int
    end: int
    epoch: int
    digest: str  # the namespace they were found under


class PoolLookups:
    def __init__(self, deployment: Deployment, backend: Backend, keying: PoolKeying,
                 events: KVEvents | None = None) -> None:
        self._dep = deployment
        self._backend = backend
        self._keying = keying
        self._events = events  # told of the first block found missing
        # req_id -> group -> what lookups found for it, while it waits.
        self._found: dict[str, dict[int, _Found]] = {}

    def forget(self, req_id: str) -> None:
        """``req_id`` was admitted or finished: no more lookups until it waits again."""
        self._found.pop(req_id, None)

    def hit_blocks(self, request: "Request", first: int) -> int:
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
            self.forget(request.request_id)
            return first
        return end

    def _complete_blocks(self, request: "Request", g: int, first: int, end: int) -> int:
        """The end of the leading blocks of group ``g`` in [first, end) that the pool holds completely."""
        req_id, hashes, parts = request.request_id, request.block_hashes[:end], self._keying.parts
        epoch = self._backend.presence_epoch()  # before the lookup: an eviction during it moves it
        found = self._found.get(req_id, {}).get(g)
        resume = first
        if (found is not None and epoch is not None and found.epoch == epoch and found.start <= first
                and found.digest == parts.namespace_digest):
            resume = min(max(first, found.end), end)  # blocks [first, found.end) are still complete
        keys = self._keying.group_hashes(hashes[resume:], g)
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
        parts = self._keying.parts
        while end > first:
            hit_tokens = min(end * bs, request.num_tokens - 1)
            start = max(first, group.first_held_block(hit_tokens, bs))
            keys = self._keying.group_hashes(request.block_hashes[start:end], g)
            complete = start + self._backend.count_complete_blocks(parts, keys)
            if complete == end:
                return end
            end = complete  # a hit past the missing block would need it
        return first
