"""The dynamic buffer's host copy: the full KV of every layer, in host memory.

One allocation for every layer (page-locked on accelerators; page-locking costs
per call, and ``Device.host_memory`` takes exactly the bytes asked for), each
layer's region starting on a page and laid out as its device cache, so a block
is at the same place in both. Where the device maps host memory (CUDA), the
same bytes are also viewed as device tensors, for kernels that move scattered
blocks across the link without staging.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from vllm_aio.block_layout import BlockLayout
from vllm_aio.device import Device, HostMemory

# Each layer's region of the host copy starts on a page.
_HOST_ALIGN = 4096


class HostKV:
    def __init__(self, device: Device, device_caches: Mapping[str, torch.Tensor], layer_names: Sequence[str],
                 num_blocks: int, keep: int) -> None:
        """The first ``keep`` of the device caches' ``num_blocks`` blocks (vLLM's; the private ones stay
        on the device) of every layer."""
        self.memory, self.caches = _host_copy(
            device, {n: _first_blocks(device_caches[n], num_blocks, keep) for n in layer_names}, layer_names
        )
        self.layout = BlockLayout(self.caches, layer_names, keep)
        mapped = _device_views(self.memory, self.caches)
        # The host copy as the device's kernels see it, or None where unmapped.
        self.mapped_layout = None if mapped is None else BlockLayout(mapped, layer_names, keep)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.caches.values())

    def release(self) -> None:
        """After the device's last copy: the memory no longer page-locked (views stay readable)."""
        self.memory.release()


def _host_copy(
    device: Device, caches: Mapping[str, torch.Tensor], names: Sequence[str]
) -> tuple[HostMemory, dict[str, torch.Tensor]]:
    """One host allocation for every layer's full KV, viewed per layer (contiguous, the caches' shapes).

    One allocation, not one per layer: page-locking costs per call, and
    ``Device.host_memory`` takes exactly the bytes asked for.
    """
    offsets, end = [], 0
    for name in names:
        offsets.append(end)
        end += -(-caches[name].nbytes // _HOST_ALIGN) * _HOST_ALIGN
    memory = device.host_memory(end)
    views = {}
    for name, offset in zip(names, offsets):
        cache = caches[name]
        views[name] = memory.tensor[offset : offset + cache.nbytes].view(cache.dtype).view(cache.shape)
    return memory, views


def _device_views(memory: HostMemory, host_caches: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Each layer's host copy as a tensor on the device (same bytes, mapped), or None where unmapped."""
    whole = memory.device_view()
    if whole is None:
        return None
    base = memory.tensor.data_ptr()
    views = {}
    for name, t in host_caches.items():
        offset = t.data_ptr() - base
        views[name] = whole[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
    return views


def _first_blocks(cache: torch.Tensor, num_blocks: int, keep: int) -> torch.Tensor:
    """``cache``'s first ``keep`` of ``num_blocks`` blocks (``[num_blocks, ...]`` or ``[2, num_blocks, ...]``)."""
    if keep == num_blocks:
        return cache
    return cache[:keep] if cache.shape[0] == num_blocks else cache[:, :keep]


def words(rows: torch.Tensor) -> torch.Tensor:
    """``[..., n, bytes]`` rows as int64 words where they allow it: kernels reading or writing
    mapped host memory move 8 bytes per access instead of 1."""
    if rows.shape[-1] % 8 == 0 and all(s % 8 == 0 for s in rows.stride()[:-1]) and rows.data_ptr() % 8 == 0:
        return rows.view(torch.int64)
    return rows
