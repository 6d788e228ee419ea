"""Points vLLM's block table and slot mapping at a layer's private blocks.

vLLM shares one block table and one slot mapping across every layer of a KV
cache group, so a block id names the same place in each layer's cache. The
dynamic buffer keeps some blocks on the device in every layer (``pinned``,
the scheduler's residency): block ``b`` with slot ``j`` lives at private id
``num_blocks + (layer // S) * P + j`` of the layer's buffer (``buffer/plan.py``).
Before the layers of each buffer pass, the entries naming a pinned block are
rewritten in place to that id, by value, so every request naming the block
(prefix sharing) reads the private copy; after the step the tables get their
own values back (on the CPU build they are vLLM's own persistent arrays).

The rewrite is two small device kernels per table per S layers, from tensors
prepared once per step: ``base = table + offset[block]`` and
``step = P`` for pinned blocks, 0 elsewhere (in the table's units), then ``table = base + k * step``.
Only backends whose metadata carry the ``block_table`` their kernels read are
supported (``vllm_compat.REMAPPABLE_BACKENDS``: vLLM's CPU, FlashAttention and Triton attention);
``check_backends`` refuses others when the KV cache is registered. Which of the
attention metadata's tensors name blocks is ``vllm_compat.block_tables``'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_aio import vllm_compat
from vllm_aio.device.accelerator import Device
from vllm_aio.errors import ConfigError


@dataclass
class _Table:
    """One of vLLM's tensors naming blocks, in ``unit``s per vLLM block (1 for block ids,
    the block size for token slots)."""

    tensor: torch.Tensor
    original: torch.Tensor
    base: torch.Tensor
    step: torch.Tensor


class BlockRemap:
    def __init__(self, device: Device, num_blocks: int, resident: int, buffers: int, block_tokens: int) -> None:
        """``num_blocks``: vLLM's (the private ones follow); ``resident``: P; ``block_tokens``: slots per
        block. Block table entries are vLLM's block ids: the buffer's layouts refuse caches whose kernels
        split a block (``BlockLayout``)."""
        self._num_blocks = num_blocks
        self._resident = resident
        self._buffers = buffers
        self._block_tokens = block_tokens
        # Per vLLM block: [private id - block id, P] for pinned blocks, zeros elsewhere (one lookup
        # gives both of a table's tensors).
        self._lookup = torch.zeros(2, num_blocks, dtype=torch.int64, device=device.torch_device)
        self._blocks: torch.Tensor | None = None  # this step's pinned block ids, on the device
        self._tables: list[_Table] = []
        self._pass = -1  # the layer pass (layer // S) the tables point at now

    def private_base(self, layer: int) -> int:
        """Layer ``layer``'s first private block id."""
        return self._num_blocks + (layer // self._buffers) * self._resident

    def begin(self, blocks: torch.Tensor, slots: torch.Tensor) -> None:
        """This step's pinned ``blocks`` (device int64) and their private ``slots``; the same tensors
        as the last step's (a decode's pinned blocks): the lookup holds them already."""
        if blocks is self._blocks:
            return
        if self._blocks is not None:
            self._lookup.index_fill_(1, self._blocks, 0)
        self._blocks = blocks
        self._lookup[0].index_copy_(0, blocks, slots + self._num_blocks - blocks)
        self._lookup[1].index_fill_(0, blocks, self._resident)

    def attach(self, forward_context: Any, layer_names: Iterable[str]) -> None:
        """Take the forward's tables, pointed at the first pass's private blocks."""
        tables = vllm_compat.block_tables(forward_context, layer_names) if self._blocks is not None else None
        if tables is None:
            return
        for tensor, is_slots in tables:
            self._tables.append(self._prepare(tensor, self._block_tokens if is_slots else 1))
        self._pass = -1
        self.apply(0)

    def apply(self, layer: int) -> None:
        """Before layer ``layer`` writes its K/V: the tables point at its private blocks."""
        k = layer // self._buffers
        if k == self._pass:
            return
        for t in self._tables:
            torch.add(t.base, t.step, alpha=k, out=t.tensor)
        self._pass = k

    def end(self) -> None:
        """After the step: vLLM's tables as they were (the lookup keeps the pinned blocks for the next)."""
        for t in self._tables:
            t.tensor.copy_(t.original)
        self._tables.clear()

    def _prepare(self, tensor: torch.Tensor, unit: int) -> _Table:
        original = tensor.clone()
        # Padding (-1 slots) reads block 0, vLLM's null block, which is never pinned.
        block = torch.clamp(original, min=0)
        if unit > 1:
            block = block // unit
        offset, step = self._lookup[:, block] * unit if unit > 1 else self._lookup[:, block]
        return _Table(tensor, original, (original + offset).to(tensor.dtype), step.to(tensor.dtype))


def check_backends(backend_names: dict[str, str]) -> None:
    """Refuse, at start, layers whose attention backend (name by layer) reads blocks some other way."""
    supported = vllm_compat.REMAPPABLE_BACKENDS
    other = sorted({name for name in backend_names.values() if name not in supported})
    if other:
        raise ConfigError(
            f"dynamic_buffer_resident_blocks: attention backend {', '.join(other)} is not supported; it needs one "
            f"of {', '.join(supported)} (--attention-backend), or 0 resident blocks"
        )
