"""``BufferPlanner``: the scheduler half's part of the dynamic buffer, one ``BufferStep`` per step.

Loaded (``resident``): only the blocks holding tokens from before the step's
first computed token, ``block_ids[:ceil(computed / block_size)]`` (the last of
them may be partly full, and is written too). The step's brand-new blocks are
not loaded: attention never reads a slot the step has not written yet (slots
past the sequence are masked), and each layer writes its new K/V into the
buffer before its attention, so loading them would copy bytes that are
overwritten or never read (a prefill without a cached prefix loads nothing).
Written back (``written``): every block the step's tokens land in.

With ``dynamic_buffer_resident_blocks``, the blocks of requests of the highest
retention class that fit stay on the device instead (``pinned``,
``residency.py``): not loaded, written back from their private place; a block
taking its slot with K/V in it is ``promoted``.

Plain Python, scheduler side: block ids, never bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from vllm_aio import vllm_compat
from vllm_aio.buffer.residency import Residency
from vllm_aio.shared.deployment import Deployment
from vllm_aio.shared.metadata import BufferStep

if TYPE_CHECKING:
    from vllm_aio.vllm_compat import SchedulerOutput


# What the planner reads of the step's requests, as Protocols: the scheduler half passes its
# ``connector/scheduler/save_plan.py`` ``Scheduled``, and the buffer imports nothing of the connector.
class _Request(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def priority(self) -> int: ...


class _RequestBlocks(Protocol):
    @property
    def request(self) -> _Request: ...

    @property
    def block_ids(self) -> Sequence[Sequence[int]]: ...  # per KV cache group


class ScheduledRequest(Protocol):
    """A request in this step: its blocks, tokens computed before the step and once it is done."""

    @property
    def blocks(self) -> _RequestBlocks: ...

    @property
    def computed_tokens(self) -> int: ...

    @property
    def done_tokens(self) -> int: ...


class BufferPlanner:
    def __init__(self, deployment: Deployment) -> None:
        self._dep = deployment
        self._residency = Residency(deployment.resident_blocks) if deployment.resident_blocks else None

    def step(self, scheduled: Sequence[ScheduledRequest], scheduler_output: SchedulerOutput) -> BufferStep:
        """The blocks the dynamic buffer streams through the device this step."""
        step = BufferStep(
            zeroed=list(scheduler_output.new_block_ids_to_zero or []),
            copies=[(c.src_block_id, c.dst_block_id) for c in vllm_compat.kv_cache_block_copies(scheduler_output)],
        )
        bs = self._dep.block_size
        for s in scheduled:
            block_ids = s.blocks.block_ids[0]  # the buffer refuses hybrid models (one group)
            step.resident.extend(block_ids[: -(-s.computed_tokens // bs)])
            step.written.extend(block_ids[s.computed_tokens // bs : -(-s.done_tokens // bs)])
        if self._residency is not None:
            self._pin(step, scheduled, self._residency)
        return step

    def _pin(self, step: BufferStep, scheduled: Sequence[ScheduledRequest], residency: Residency) -> None:
        """Keep the highest class's blocks that fit on the device: moved from ``resident`` to
        ``pinned``. vLLM's zeroing or copy into a pinned block reaches the host copy only, so it
        is promoted again."""
        bs, top = self._dep.block_size, len(self._dep.priority_cutoffs)
        for s in scheduled:
            request = s.blocks.request
            if self._dep.retention_of(request.priority) == top:
                block_ids = s.blocks.block_ids[0][: -(-s.done_tokens // bs)]
                step.promoted.extend(residency.place(request.request_id, block_ids, -(-s.computed_tokens // bs)))
        slots = {b: slot for b in (*step.resident, *step.written) if (slot := residency.slot(b)) is not None}
        step.pinned = sorted(slots.items())
        step.resident = [b for b in step.resident if b not in slots]
        updated = {*step.zeroed, *(dst for _, dst in step.copies)}
        step.promoted = sorted({*step.promoted, *(b for b in slots if b in updated)})

    def release(self, req_id: str) -> None:
        """``req_id`` finished or was preempted: its blocks may be another's now."""
        if self._residency is not None:
            self._residency.release(req_id)


class NoBuffer:
    """The planner without the dynamic buffer: the metadata carries no buffer step."""

    def step(self, scheduled: Sequence[ScheduledRequest], scheduler_output: SchedulerOutput) -> None:
        return None

    def release(self, req_id: str) -> None:
        pass


def buffer_planner(deployment: Deployment) -> BufferPlanner | NoBuffer:
    """The planner of ``deployment``'s transfer mode, chosen once."""
    return BufferPlanner(deployment) if deployment.buffer_count else NoBuffer()
