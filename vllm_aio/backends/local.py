"""The embedded backend: a host-memory pool private to one vLLM instance.

It needs no service: the pool lives in shared memory that the engine-core
process (scheduler) and every worker process map (see ``pool/host_pool.py``
for the mechanism and its cost). Instances on one host share a pool by giving
it the same ``local_pool_name``; otherwise its name is the instance's engine id
and it is sealed (unlinked) once the last of its processes has attached.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_aio.backends.base import Backend, Segment, Status
from vllm_aio.backends.segments import gather, scatter, total
from vllm_aio.pool.host_pool import SharedHostPool, slots_for


class LocalBackend(Backend):
    def __init__(self, name: str, pool_bytes: int, value_bytes: int, seal: bool) -> None:
        self.pool = SharedHostPool(name, value_bytes, slots_for(pool_bytes, value_bytes))
        if seal:
            self.pool.seal()

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self.pool.contains(keys)

    def batch_put(
        self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]
    ) -> list[Status]:
        out: list[Status] = []
        filled: list[int] = []  # positions in `keys` copied into a reserved slot
        slots = self.pool.reserve(keys)
        for i, (segs, slot) in enumerate(zip(segments, slots)):
            if slot is None:
                out.append(Status.EXISTS)
            elif slot < 0:
                out.append(Status.NO_SPACE)
            elif total(segs) != self.pool.slot_size:
                self.pool.abandon([slot])
                out.append(Status.ERROR)
            else:
                gather(segs, self.pool.slot_address(slot))
                filled.append(i)
                out.append(Status.OK)
        won = self.pool.commit([keys[i] for i in filled], [slots[i] for i in filled])
        for i, stored in zip(filled, won):
            if not stored:  # another writer (or an earlier copy in this batch) got there first
                out[i] = Status.EXISTS
        return out

    def batch_get(
        self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]
    ) -> list[Status]:
        out: list[Status] = []
        for segs, pinned in zip(segments, self.pool.pin_for_read(keys)):
            if pinned is None:
                out.append(Status.MISSING)
            elif total(segs) != self.pool.slot_size:
                out.append(Status.CORRUPT)
            else:
                slot, version = pinned
                scatter(self.pool.slot_address(slot), segs)
                # Evicted and rewritten while we copied: the bytes are torn.
                ok = self.pool.still_valid(slot, version)
                out.append(Status.OK if ok else Status.CORRUPT)
        return out

    def close(self) -> None:
        self.pool.close()

