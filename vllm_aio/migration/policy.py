"""Migration by priority: which in-flight request moves, and where (pure decisions; the router acts on them).

An instance is *pressured* when vLLM preempted requests since the last poll,
or requests waited at two polls running while they could not have started for
lack of KV: its cache nearly full (``KV_FULL``), or fewer blocks free than the
smallest of the router's requests there that has no token yet needs for its
prompt (``waiting_blocks``; vLLM admits a request only with blocks for its
whole first chunk). One poll alone would count a request in transit between
its arrival and its first scheduling step; and requests wait for the step's
token budget too (prefills of a burst of prompts, for seconds on a busy CPU),
which no move relieves: a CI run moved a low-priority request away from a
cache a quarter free before the high-priority one had even arrived. Another
saw two low-priority requests wait for seconds with 8 of 56 blocks free (86%
used) for 10-block prompts, never preempting: with ``KV_FULL`` alone nothing
moved. From each
pressured instance the most important in-flight request moves first, in
vLLM's own order: lowest ``priority`` value, then earliest arrival (what
``--scheduling-policy priority`` serves first and preempts last). It goes to
the calm instance with the most free KV blocks, provided that instance has
room for the request's blocks and more free blocks than the source; equal
targets go to the first in the router's instance order. One move per source
per poll, and none from or to an instance a move is already in flight on:
the next poll's figures show the last move's effect before another is chosen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

POLICIES = ("priority",)  # the router's --policy choices


@dataclass(frozen=True)
class Load:
    """One instance's KV figures at one poll of its ``/metrics``."""

    waiting: int  # vllm:num_requests_waiting
    preemptions: float  # vllm:num_preemptions_total, cumulative
    kv_usage: float  # vllm:kv_cache_usage_perc, 0..1
    kv_blocks: int  # num_gpu_blocks of vllm:cache_config_info

    @property
    def free_blocks(self) -> int:
        return int(self.kv_blocks * (1.0 - self.kv_usage))


# KV cache usage from which requests waiting at two polls count as pressure.
KV_FULL = 0.9


def pressured(before: Load | None, now: Load, waiting_need: int | None = None) -> bool:
    """``waiting_need``: the blocks the smallest request known to wait there needs (``waiting_blocks``), if any."""
    if before is None:  # a first poll has nothing to compare with
        return False
    no_room = min(before.kv_usage, now.kv_usage) >= KV_FULL or (
        waiting_need is not None and now.free_blocks < waiting_need)
    waiting = before.waiting > 0 and now.waiting > 0 and no_room
    return now.preemptions > before.preemptions or waiting


@dataclass(frozen=True)
class Candidate:
    """An in-flight request the router could move."""

    request_id: str
    instance: str
    priority: int  # vLLM's: lower is more important
    arrival: float
    tokens: int  # prompt + generated so far: the KV it takes on the target
    started: bool = True  # whether it has produced a token (else it may still wait to be scheduled)


def waiting_blocks(candidates: Sequence[Candidate], block_size: int) -> dict[str, int]:
    """Per instance, the blocks its smallest request without a token yet needs to start."""
    need: dict[str, int] = {}
    for c in candidates:
        if not c.started:
            blocks = -(-c.tokens // block_size)
            need[c.instance] = min(need.get(c.instance, blocks), blocks)
    return need


@dataclass(frozen=True)
class Move:
    request_id: str
    source: str
    target: str


def pick_moves(before: Mapping[str, Load], now: Mapping[str, Load], candidates: Sequence[Candidate],
               block_size: int, busy: Set[str] = frozenset()) -> list[Move]:
    """The moves to start now; ``now`` lists the instances in the router's order, ``busy`` the
    instances a move is in flight from or to."""
    free = {url: load.free_blocks for url, load in now.items()}
    needs = waiting_blocks(candidates, block_size)
    under = {url for url, load in now.items() if pressured(before.get(url), load, needs.get(url))}
    calm = [url for url in now if url not in busy and url not in under]
    moves = []
    for source in now:
        if source in busy or source not in under:
            continue
        mine = [c for c in candidates if c.instance == source]
        if not mine:
            continue
        best = min(mine, key=lambda c: (c.priority, c.arrival))
        need = -(-(best.tokens + 1) // block_size)  # its blocks, and the next token's
        fits = [url for url in calm if url != source and free[url] >= need and free[url] > free[source]]
        if not fits:
            continue
        target = max(fits, key=lambda url: free[url])  # max keeps the first of equals
        free[target] -= need
        moves.append(Move(best.request_id, source, target))
    return moves
