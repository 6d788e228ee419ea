"""Which requests keep their KV on the device in every layer of the dynamic buffer.

With the dynamic buffer, every layer's K/V of a request lives in host memory
and streams through S device buffers each step. ``dynamic_buffer_resident_blocks``
(P) reserves, past vLLM's blocks, P private device blocks for every layer
(``private_blocks``). A request of the highest retention class
(``priority_cutoffs``) takes one private slot per block it uses, and the worker
reads and writes those blocks in place in every layer (it remaps vLLM's block
table and slot mapping to the layer's private blocks between layers), so they
are never streamed. Requests that do not fit stream as before.

Slots belong to vLLM block ids, not requests: requests sharing a prefix block
share its slot (the block table is remapped by value, for every request that
names the block). A resident block is still written back to the host copy every
step, so giving its slot up costs nothing; taking one costs one load of the
block in every layer (a *promotion*), once.

Plain Python, scheduler side: this module sees block ids, never bytes.
"""

from __future__ import annotations


def private_blocks(num_layers: int, buffers: int, resident: int) -> int:
    """Blocks per buffer past vLLM's: ``resident`` private blocks for each layer placed on it.

    Layer ``l`` keeps its private blocks at ``num_blocks + (l // buffers) * resident``
    (the worker remaps resident block ids there, ``buffer/remap.py``).
    """
    return -(-num_layers // buffers) * resident


class Residency:
    def __init__(self, slots: int) -> None:
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self._slot_of: dict[int, int] = {}  # block id -> its private slot
        self._refs: dict[int, int] = {}  # block id -> resident requests naming it
        self._held: dict[str, list[int]] = {}  # request -> its resident block ids, in order

    def place(self, req_id: str, block_ids: list[int], loaded: int) -> list[int]:
        """Keep ``block_ids`` (the blocks ``req_id`` uses this step) resident.

        The first ``loaded`` of them hold K/V from before the step. Returns
        the blocks that take a slot now and hold K/V already (their private
        copies are filled from the host copy this step). Blocks already
        resident keep their slot; a request whose blocks do not all fit
        gives up the ones it held and streams.
        """
        held = self._held.get(req_id, [])
        if block_ids[: len(held)] != held:  # not the blocks it held (it cannot happen while it holds them)
            self.release(req_id)
            held = []
        new = block_ids[len(held) :]
        if sum(b not in self._slot_of for b in new) > len(self._free):
            self.release(req_id)
            return []
        promoted = []
        for position, block in enumerate(new, start=len(held)):
            if block not in self._slot_of:
                self._slot_of[block] = self._free.pop()
                self._refs[block] = 0
                if position < loaded:
                    promoted.append(block)
            self._refs[block] += 1
        self._held[req_id] = list(block_ids)
        return promoted

    def release(self, req_id: str) -> None:
        """``req_id`` finished, was preempted or no longer fits: its blocks stream from now on
        (unless another resident request names them)."""
        for block in self._held.pop(req_id, ()):
            self._refs[block] -= 1
            if not self._refs[block]:
                del self._refs[block]
                self._free.append(self._slot_of.pop(block))

    def slot(self, block: int) -> int | None:
        return self._slot_of.get(block)

    @property
    def free_slots(self) -> int:
        return len(self._free)
