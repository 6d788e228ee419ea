"""The dynamic buffer's host copy as a store sees it: blocks saved from one buffer's host copy and
loaded into another's through the embedded pool, for vLLM's one tensor a layer and vllm-ascend's
tuples (``(k, v)``, MLA's ``(nope, rope)``: each buffer's tensors separate allocations, handed to
every layer of its ``shared_by``), as the worker moves them (``BlockLayout`` segments, one value a
block of every layer)."""

from __future__ import annotations

import uuid

import pytest
import torch

from vllm_aio.backends import Status, open_backend
from vllm_aio.backends.local_settings import LocalSettings
from vllm_aio.device.block_layout import BlockLayout, cache_tensors
from vllm_aio.buffer.layer_buffer import LayerBuffer

LAYERS, BUFFERS, BLOCKS = 6, 2, 16
FORMS = {"tensor": ((2, 16, 32),), "kv": ((16, 32), (16, 32)), "mla": ((16, 32), (16, 8))}  # one block's parts


def _buffer(form: str) -> tuple[LayerBuffer, list[str]]:
    """A buffer over caches laid out as the form's runner lays out a shared_by plan."""
    names = [f"layer.{i}" for i in range(LAYERS)]
    shared = [tuple(torch.zeros(BLOCKS, *shape, dtype=torch.bfloat16) for shape in FORMS[form])
              for _ in range(BUFFERS)]
    caches = {n: shared[i % BUFFERS][0] if form == "tensor" else shared[i % BUFFERS] for i, n in enumerate(names)}
    return LayerBuffer(caches, names, BLOCKS, BUFFERS, 1 << 20), names


@pytest.mark.parametrize("form", FORMS)
def test_blocks_saved_from_one_host_copy_load_into_another_through_the_pool(form):
    source, names = _buffer(form)
    target, _ = _buffer(form)
    for t in (t for cache in target.host_caches.values() for t in cache_tensors(cache)):
        t.zero_()  # host memory comes as it is
    generator = torch.Generator().manual_seed(1)
    for t in (t for cache in source.host_caches.values() for t in cache_tensors(cache)):
        t.copy_(torch.randn(t.shape, generator=generator).to(t.dtype))
    put, get = BlockLayout(source.host_caches, names, BLOCKS), BlockLayout(target.host_caches, names, BLOCKS)
    layers = range(LAYERS)
    backend = open_backend(LocalSettings(local_pool_size=64 * put.payload_bytes(layers)),
                           f"buffer-{uuid.uuid4().hex[:12]}", put.payload_bytes(layers), for_scheduler=False)
    try:
        blocks = [3, 4, 9]
        keys = [f"block-{b}" for b in blocks]
        assert backend.batch_put(keys, [put.segments(b, layers) for b in blocks]) == [Status.OK] * 3
        assert backend.batch_get(keys, [get.segments(b, layers) for b in blocks]) == [Status.OK] * 3
    finally:
        backend.close()
    for name in names:
        for got, want in zip(cache_tensors(target.host_caches[name]), cache_tensors(source.host_caches[name])):
            assert torch.equal(got[blocks], want[blocks])
            assert not got[[0, 5]].any(), "blocks not loaded stay as they were"
    source.close()
    target.close()
