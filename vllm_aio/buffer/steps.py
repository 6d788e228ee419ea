"""What one step of the dynamic buffer moves in every layer: the plan, without a device.

Every layer moves the same blocks in a step (vLLM's block ids name the same
place in each layer's cache), so a step is planned once: which blocks each
layer loads from the host copy before it runs, which it writes back after its
attention, and which of the step's pinned blocks (kept on the device at private
places, ``remap.py``) are filled from the host copy or written back once after
the forward. Runs of consecutive ids long enough to be worth one copy each are
split off; the rest move scattered.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_aio.shared.metadata import BufferStep

_NONE = np.empty(0, np.int64)


class PinnedSlots:
    """A step's pinned blocks (``BufferStep.pinned``) as sorted arrays, looked up without a dict
    (a long request pins thousands of blocks, every step)."""

    def __init__(self, pinned: Sequence[tuple[int, int]]) -> None:
        # fromiter: half the time of asarray on a list of pairs
        flat = np.fromiter(itertools.chain.from_iterable(pinned), dtype=np.int64, count=2 * len(pinned))
        pairs = flat.reshape(-1, 2)
        order = np.argsort(pairs[:, 0], kind="stable")
        self.blocks, self._slots = pairs[order, 0], pairs[order, 1]

    def holds(self, blocks: np.ndarray) -> np.ndarray:
        """Which of ``blocks`` are pinned."""
        at = np.minimum(np.searchsorted(self.blocks, blocks), max(len(self.blocks) - 1, 0))
        return self.blocks[at] == blocks if len(self.blocks) else np.zeros(len(blocks), dtype=bool)

    def slots(self, blocks: np.ndarray) -> np.ndarray:
        """The private slots of ``blocks``, every one pinned."""
        return self._slots[np.searchsorted(self.blocks, blocks)]


@dataclass(frozen=True)
class Blocks:
    """Blocks moved between the host copy and the same ids of each layer's buffer."""

    runs: list[tuple[int, int]]  # [start, stop) of consecutive ids, one copy each
    rest: np.ndarray  # the other ids, sorted, moved scattered

    def __bool__(self) -> bool:
        return bool(self.runs) or len(self.rest) > 0


@dataclass(frozen=True)
class Pinned:
    """Pinned blocks (sorted, distinct) and their private slots."""

    blocks: np.ndarray
    slots: np.ndarray

    def __len__(self) -> int:
        return len(self.blocks)

    def pairs(self) -> list[tuple[int, int]]:
        return list(zip(self.blocks.tolist(), self.slots.tolist()))


@dataclass(frozen=True)
class StepPlan:
    loads: Blocks  # blocks holding K/V from before the step: into each layer's buffer before it runs
    write_backs: Blocks  # blocks the step writes (not pinned): out of the buffer after each attention
    promoted: Pinned  # pinned blocks filled from the host copy, in every layer, with its load
    pinned_written: Pinned  # pinned blocks the step writes: back once, after the forward
    pinned: PinnedSlots  # every pinned block of the step
    pinned_changed: bool  # whether the pinned blocks differ from the last step's

    @property
    def moves_layers(self) -> bool:
        """Whether the layers move blocks: a step whose blocks are all pinned (and none promoted)
        needs no per-layer copies or events."""
        return bool(self.loads) or bool(self.write_backs) or len(self.promoted) > 0


class StepPlanner:
    def __init__(self, min_run: int) -> None:
        """``min_run``: the fewest consecutive ids copied as one run."""
        self._min_run = min_run
        self._pinned = PinnedSlots([])
        self._pinned_list: list[tuple[int, int]] = []  # as the last step named them

    def plan(self, step: BufferStep) -> StepPlan:
        changed = step.pinned != self._pinned_list  # a decode keeps its pinned blocks from step to step
        if changed:
            self._pinned, self._pinned_list = PinnedSlots(step.pinned), step.pinned
        pinned = self._pinned
        written = np.asarray(step.written, dtype=np.int64)
        kept = pinned.holds(written)
        promoted = np.unique(np.asarray(step.promoted, dtype=np.int64))
        rows = np.unique(written[kept])
        return StepPlan(
            loads=Blocks(*split_runs(step.resident, self._min_run)),
            write_backs=Blocks(*split_runs(written[~kept], self._min_run)),
            promoted=Pinned(promoted, pinned.slots(promoted) if len(promoted) else _NONE),
            pinned_written=Pinned(rows, pinned.slots(rows) if len(rows) else _NONE),
            pinned=pinned,
            pinned_changed=changed,
        )


def split_runs(block_ids: Sequence[int] | np.ndarray, min_run: int) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The distinct ids as [start, stop) runs of at least ``min_run`` consecutive ids, and the rest (sorted)."""
    ids = np.unique(np.asarray(block_ids, dtype=np.int64))
    if not len(ids):
        return [], _NONE
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [len(ids)]))
    long = stops - starts >= min_run
    runs = [(int(ids[a]), int(ids[b - 1]) + 1) for a, b in zip(starts[long], stops[long])]
    return runs, ids[np.repeat(~long, stops - starts)]

