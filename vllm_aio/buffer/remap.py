"""Points vLLM's block table and slot mapping at a layer's private blocks.

vLLM shares one block table and one slot mapping across every layer of a KV
cache group, so a block id names the same place in each layer's cache. The
dynamic buffer keeps some blocks on the device in every layer (``pinned``,
``connector/residency.py``): block ``b`` with slot ``j`` lives at private id
``num_blocks + (layer // S) * P + j`` of the layer's buffer (``buffer_plan``).
Before the layers of each buffer pass, the entries naming a pinned block are
rewritten in place to that id, by value, so every request naming the block
(prefix sharing) reads the private copy; after the step the tables get their
own values back (on the CPU build they are vLLM's own persistent arrays).

The rewrite is two small device kernels per table per S layers, from tensors
prepared once per step: ``base = table + offset[block]`` and
``step = P`` for pinned blocks, 0 elsewhere (in the table's units), then ``table = base + k * step``.
Only backends whose metadata carry the ``block_table`` their kernels read are
supported (``BACKENDS``: vLLM's CPU, FlashAttention and Triton attention);
``check_backends`` refuses others when the KV cache is registered.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_aio.config import ConfigError
from vllm_aio.device import Device

# Attention backends whose metadata's ``block_table`` and slot mapping are what their kernels read.
BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN")


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
        # A step without attention metadata (vLLM's steps that schedule no tokens) reads no table.
        if self._blocks is None or forward_context is None or not isinstance(forward_context.attn_metadata, dict):
            return
        for tensor, unit in _tables_of(forward_context, layer_names, self._block_tokens):
            self._tables.append(self._prepare(tensor, unit))
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


def _tables_of(forward_context: Any, layer_names: Iterable[str], block_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """The distinct block tables and slot mappings the layers read, with their units per vLLM block."""
    metadata, slots = forward_context.attn_metadata, forward_context.slot_mapping
    found: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, int]] = {}
    seen: set[tuple[int, int]] = set()  # the layers of a group share their metadata: look once
    for name in layer_names:
        meta = metadata[name]
        layer_slots = slots.get(name) if isinstance(slots, dict) else None
        if (id(meta), id(layer_slots)) in seen:
            continue
        seen.add((id(meta), id(layer_slots)))
        table = getattr(meta, "block_table", None)
        if not isinstance(table, torch.Tensor):
            raise RuntimeError(
                f"dynamic_buffer_resident_blocks: the {type(meta).__name__} attention metadata names no "
                "block_table to point at the private blocks; run without resident blocks"
            )
        pairs = [(table, 1), (getattr(meta, "slot_mapping", None), block_tokens), (layer_slots, block_tokens)]
        for tensor, unit in pairs:
            if isinstance(tensor, torch.Tensor):
                found.setdefault((tensor.data_ptr(), tuple(tensor.shape)), (tensor, unit))
    return list(found.values())


def check_backends(backend_names: dict[str, str]) -> None:
    """Refuse, at start, layers whose attention backend (name by layer) reads blocks some other way."""
    other = sorted({name for name in backend_names.values() if name not in BACKENDS})
    if other:
        raise ConfigError(
            f"dynamic_buffer_resident_blocks: attention backend {', '.join(other)} is not supported; it needs one "
            f"of {', '.join(BACKENDS)} (--attention-backend), or 0 resident blocks"
        )
