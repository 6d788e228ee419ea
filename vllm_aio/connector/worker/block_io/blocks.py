"""The blocks one batch moves, and their reduction to one block per pool key."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_aio.backends import Status


@dataclass(frozen=True)
class BlockRef:
    block_id: int
    block_hash: bytes


@dataclass
class Batch:
    """Blocks of several requests moved together, with the request of each."""

    blocks: list[BlockRef]
    req_ids: list[str]
    retention: int = 0  # of the requests saving them (``Backend.batch_put``)
    # Saves with KV events: positions whose value failed for an earlier layer
    # (a layerwise batch is saved once per layer; ``saves.py``).
    unsaved: set[int] = field(default_factory=set)
    # Saves: per request, the blocks loaded in this step that its forward read (``BlockTransfer.reads``).
    reads: dict[str, Sequence[int]] = field(default_factory=dict)


class DistinctBlocks:
    """A batch's blocks reduced to one per block hash, i.e. per pool key (``BlockIO.prepare``).

    Blocks of one batch may share a key (requests with a common prefix moved
    in one step, each in blocks of its own): each key is read from or put into
    the pool once. ``firsts``: the first block of each distinct hash, in batch
    order; ``targets``: per distinct hash, the block ids of every block naming
    it (its first block's id first). ``plans`` keeps what the direct path
    derives from them once per batch, for every layer that loads it.
    """

    def __init__(self, blocks: Sequence[BlockRef]) -> None:
        self.plans: dict[tuple[int, int], object] = {}
        index: dict[bytes, int] = {}
        self.firsts: list[BlockRef] = []
        self.targets: list[list[int]] = []
        self._which: list[int] = []  # per block: its distinct hash's position
        for b in blocks:
            j = index.setdefault(b.block_hash, len(self.firsts))
            if j == len(self.firsts):
                self.firsts.append(b)
                self.targets.append([])
            self.targets[j].append(b.block_id)
            self._which.append(j)

    def spread(self, statuses: list[Status], repeat: Callable[[Status], Status] = lambda s: s) -> list[Status]:
        """Per block, the status of its hash; ``repeat`` maps it for blocks after the first."""
        if len(self.firsts) == len(self._which):  # no hash twice: the statuses as they are
            return list(statuses)
        seen: set[int] = set()
        out = []
        for j in self._which:
            out.append(statuses[j] if j not in seen else repeat(statuses[j]))
            seen.add(j)
        return out
