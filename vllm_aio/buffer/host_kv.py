"""The dynamic buffer's host copy: the full KV of every layer, in host memory.

One allocation for every layer (page-locked on accelerators; page-locking costs
per call, and ``Device.host_memory`` takes exactly the bytes asked for), each
cache tensor's region starting on a page and laid out as on the device, so a
block is at the same place in both; a layer's cache is a tensor (vLLM's) or a
tuple of them (vllm-ascend's ``(k, v)``, MLA's ``(nope, rope)``), and its host
copy takes the same form. Where the device maps host memory (CUDA), the same
bytes are also viewed as device tensors, for kernels that move scattered blocks
across the link without staging.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from vllm_aio.device.accelerator import Device, HostMemory
from vllm_aio.device.block_layout import BlockLayout, LayerCache, cache_tensors

# Each layer's region of the host copy starts on a page.
_HOST_ALIGN = 4096


class HostKV:
    def __init__(self, device: Device, device_caches: Mapping[str, LayerCache], layer_names: Sequence[str],
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
        return sum(t.nbytes for cache in self.caches.values() for t in cache_tensors(cache))

    def release(self) -> None:
        """After the device's last copy: the memory no longer page-locked (views stay readable)."""
        self.memory.release()


def _host_copy(
    device: Device, caches: Mapping[str, LayerCache], names: Sequence[str]
) -> tuple[HostMemory, dict[str, LayerCache]]:
    """One host allocation for every layer's full KV, viewed per layer as its cache is (each tensor
    contiguous, in its shape)."""
    offsets, end = [], 0
    for name in names:
        for t in cache_tensors(caches[name]):
            offsets.append(end)
            end += -(-t.nbytes // _HOST_ALIGN) * _HOST_ALIGN
    memory = device.host_memory(end)
    starts = iter(offsets)
    return memory, {name: _like(caches[name], lambda t: _view(memory.tensor, next(starts), t)) for name in names}


def _device_views(memory: HostMemory, host_caches: Mapping[str, LayerCache]) -> dict[str, LayerCache] | None:
    """Each layer's host copy as tensors on the device (same bytes, mapped), or None where unmapped."""
    whole = memory.device_view()
    if whole is None:
        return None
    base = memory.tensor.data_ptr()
    return {name: _like(cache, lambda t: _view(whole, t.data_ptr() - base, t)) for name, cache in host_caches.items()}


def _first_blocks(cache: LayerCache, num_blocks: int, keep: int) -> LayerCache:
    """``cache``'s first ``keep`` of ``num_blocks`` blocks (``[num_blocks x m, ...]`` or ``[2, num_blocks, ...]``)."""
    if keep == num_blocks:
        return cache
    return _like(cache, lambda t: t[:, :keep] if t.dim() > 1 and t.shape[:2] == (2, num_blocks)
                 else t[: keep * (t.shape[0] // num_blocks)])


def _view(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """``like``'s bytes at ``offset`` of ``flat`` (uint8), in ``like``'s dtype and shape."""
    return flat[offset : offset + like.nbytes].view(like.dtype).view(like.shape)


def _like(cache: LayerCache, make: Callable[[torch.Tensor], torch.Tensor]) -> LayerCache:
    """``make`` applied to each tensor of ``cache``, in its form (a tensor, or a tuple of them)."""
    return make(cache) if isinstance(cache, torch.Tensor) else tuple(make(t) for t in cache)


def words(rows: torch.Tensor) -> torch.Tensor:
    """``[..., n, bytes]`` rows as int64 words where they allow it: kernels reading or writing
    mapped host memory move 8 bytes per access instead of 1."""
    if rows.shape[-1] % 8 == 0 and all(s % 8 == 0 for s in rows.stride()[:-1]) and rows.data_ptr() % 8 == 0:
        return rows.view(torch.int64)
    return rows
