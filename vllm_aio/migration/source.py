"""The source side of a migration: have the request's blocks in the pool, then write them into the target's slots.

``flush``: a migration moves every full block of the request, those filled by
generated tokens included, but a deployment stores only the prompt's blocks
unless ``save_decode_cache`` is on. So the scheduler half is asked to store
the running request's full blocks (``FlushRequests.ask``: the next step's
metadata saves them, from vLLM's cache, like any save), and the call
waits until the pool holds all of them. The request keeps running meanwhile:
a migration that fails later leaves it where it was, nothing lost.

``write``: the source pins its own slots of the blocks the target reserved,
writes them peer to peer into the target's slots (``transport.PeerLink``),
and rechecks the pins afterwards: a slot of this pool evicted and rewritten
during the write may have sent torn bytes, so the transfer fails rather than
let the target commit them (the target's header check would not see a torn
payload). No write starts after the allocation's deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from vllm_aio.backends.base import Backend, KeyedSlotStore
from vllm_aio.migration.flushes import FlushRequests
from vllm_aio.migration.target import MigrationRefused
from vllm_aio.pool.keys import BlockParts

_POLL_S = 0.02
# A running request is scheduled on every step, so its flush is matched (or not)
# within two; an engine that runs no step at all for this long runs no request.
IDLE_S = 5.0


def flush(flushes: FlushRequests, backend: Backend, parts: BlockParts, hashes: Sequence[bytes], deadline: float,
          clock: Callable[[], float] = time.monotonic) -> int:
    """Wait until the pool holds every block of ``hashes`` (stored as ``parts``); the number of blocks."""
    if not hashes:
        return 0
    if backend.count_complete_blocks(parts, hashes) == len(hashes):
        return len(hashes)
    flushes.ask(hashes[-1], len(hashes))
    idle_until = clock() + IDLE_S
    try:
        while True:
            have = backend.count_complete_blocks(parts, hashes)
            if have == len(hashes):
                return have
            now = clock()
            state = flushes.state(hashes[-1])
            if state is False or (state is None and now >= idle_until):
                raise MigrationRefused(
                    409, f"the source holds {have} of the sequence's {len(hashes)} full blocks and runs no "
                    "request holding the rest (it finished, or never ran here)"
                )
            if now >= deadline:
                raise MigrationRefused(
                    504, f"the source stored {have} of the sequence's {len(hashes)} full blocks within the "
                    "flush timeout (the pool is failing its puts, or the request was preempted)"
                )
            time.sleep(_POLL_S)
    finally:
        flushes.forget(hashes[-1])


def spans(store: KeyedSlotStore, parts: BlockParts, hashes: Sequence[bytes], remote_slots: Sequence[Sequence[int]],
          remote_base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(local addresses, remote addresses, pinned slots, their versions) of every part the target reserved.

    ``remote_slots`` is the allocation's answer: per block of ``hashes``, per
    part (``parts.keys`` order), the target's slot or -1 where it holds the
    part already. Raises if this pool lacks a part that is to be sent.
    """
    keys, targets = [], []
    for block_hash, slots in zip(hashes, remote_slots):
        for key, slot in zip(parts.keys(block_hash), slots):
            if slot >= 0:
                keys.append(key)
                targets.append(slot)
    pins = store.pin_for_read(keys)
    missing = [k for k, p in zip(keys, pins) if p is None]
    if missing:
        raise MigrationRefused(409, f"the source pool lost {len(missing)} values since the flush (evicted), e.g. {missing[0]}")
    local = np.array([slot for slot, _ in pins], dtype=np.int64)
    versions = np.array([version for _, version in pins], dtype=np.int64)
    base, size = store.region()[0], store.slot_size
    return base + local * size, remote_base + np.asarray(targets, dtype=np.int64) * size, local, versions
