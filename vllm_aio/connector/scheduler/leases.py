"""``Leases``: how long the pool keeps the blocks promised to a load from eviction.

Between the lookup that promised a hit and the worker's read of it, saves of
the same step can evict the promised values; the load then fails and vLLM
recomputes. Where the store allows (``Backend.lease_blocks``), the promised
blocks are leased for a few steps of the engine's recent pace: longer, leased
values would crowd out what other requests save (and what a higher retention
class should keep), and a value gone before its load is merely recomputed.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

from vllm_aio.backends import Backend
from vllm_aio.log import get_logger
from vllm_aio.pool.keys import BlockParts

logger = get_logger(__name__)

# A load is read in the step whose metadata carries it (one step later with async scheduling):
# four steps leave room; a second at least covers a pace not measured yet.
LEASE_STEPS = 4
LEASE_MIN_SECONDS = 1.0


class StepClock:
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


class Leases:
    def __init__(self, backend: Backend, max_seconds: float, clock: Callable[[], float]) -> None:
        self._backend = backend
        self._max_seconds = max_seconds  # never longer than a load may take (transfer_timeout)
        self._steps = StepClock(clock)

    def tick(self) -> None:
        """A step's metadata is being built."""
        self._steps.tick()

    def seconds(self) -> float:
        """``LEASE_STEPS`` steps of the recent pace, at least ``LEASE_MIN_SECONDS``, at most the maximum."""
        return min(self._max_seconds, max(LEASE_MIN_SECONDS, LEASE_STEPS * self._steps.step_seconds()))

    def hold(self, parts: BlockParts, hashes: list[bytes]) -> None:
        """Keep the promised blocks from eviction until the worker has read them."""
        try:
            self._backend.lease_blocks(parts, hashes, self.seconds())
        except Exception as exc:  # the load finds out what is gone, and vLLM recomputes that
            logger.warning("vllm_aio: pool lease failed, the load goes on unprotected: %s", exc)
