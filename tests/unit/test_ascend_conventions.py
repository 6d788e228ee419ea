"""The worker half driven the way vllm-ascend's NPU runner and attention backends drive it.

vllm-ascend (v0.23.0) registers a tuple or list of tensors per layer, each a
separate allocation, and its MLA/SFA/DSA backends call ``save_kv_layer`` with
lists, its GDN layers with ``("", [])`` (``docs/ascend_layouts.md``). Here the
same structures and shapes, as CPU tensors over the real embedded pool: every
byte of every tensor of a block saved from one cache lands in another block of
another cache, and nothing else is written.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
import torch

from vllm_aio.backends.local import LocalBackend
from vllm_aio.device.block_layout import cache_tensors
from vllm_aio.config import AioConfig, TransferMode
from vllm_aio.connector.worker.worker import AioWorker
from vllm_aio.pool.entry import HEADER_BYTES
from vllm_aio.pool.keys import Namespace
from vllm_aio.pool.ownership import Ownership
from vllm_aio.shared.deployment import Deployment
from vllm_aio.shared.metadata import AioConnectorMetadata, BlockTransfer

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
NUM_BLOCKS, BLOCK = 12, 16


def _random(shape, dtype, g) -> torch.Tensor:
    if dtype in (torch.int8, torch.uint8):
        return torch.randint(-100, 100, shape, generator=g, dtype=torch.int8).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def standard(g) -> tuple[torch.Tensor, ...]:
    """(k, v), each [num_blocks, block_size, kv_heads, head_size]: K and V allocated apart."""
    return tuple(_random((NUM_BLOCKS, BLOCK, 2, 64), torch.bfloat16, g) for _ in range(2))


def mla(g) -> tuple[torch.Tensor, ...]:
    """(nope, rope): the latent [.., 1, kv_lora_rank] and the rope key [.., 1, qk_rope_head_dim]."""
    return (_random((NUM_BLOCKS, BLOCK, 1, 512), torch.bfloat16, g),
            _random((NUM_BLOCKS, BLOCK, 1, 64), torch.bfloat16, g))


def sparse(g) -> tuple[torch.Tensor, ...]:
    """(kv_lora, k_rope, indexer_k): a DSA/SFA layer with its lightning indexer's key."""
    return (*mla(g), _random((NUM_BLOCKS, BLOCK, 1, 128), torch.bfloat16, g))


def sparse_int8_indexer(g) -> tuple[torch.Tensor, ...]:
    """(kv_lora, k_rope, indexer_k int8, indexer_k_scale fp16), the last two views of one int8 allocation."""
    key_bytes, scale_bytes = NUM_BLOCKS * BLOCK * 128, NUM_BLOCKS * BLOCK * 2
    raw = _random((key_bytes + scale_bytes,), torch.int8, g)
    key = raw[:key_bytes].view(NUM_BLOCKS, BLOCK, 1, 128)
    scale = raw[key_bytes:].view(torch.float16).view(NUM_BLOCKS, BLOCK, 1, 1)
    return (*mla(g), key, scale)


def kernel_blocks(g) -> tuple[torch.Tensor, ...]:
    """(k, v) of a hybrid model's attention layer: each 32-token block as two 16-token kernel blocks."""
    return tuple(_random((NUM_BLOCKS * 2, BLOCK // 2, 2, 64), torch.bfloat16, g) for _ in range(2))


def strided_list(g) -> list[torch.Tensor]:
    """DeepSeek-V4's list of views whose blocks lie a padded page apart (stride(0) > one block)."""
    page = BLOCK * 1 * 128 + 256
    raw = _random((NUM_BLOCKS * page,), torch.bfloat16, g)
    return [torch.as_strided(raw, (NUM_BLOCKS, BLOCK, 1, 128), (page, 128, 128, 1))]


def hidden_states(g) -> torch.Tensor:
    """A hidden-state cache layer: one tensor, as vLLM's own runners register every layer."""
    return _random((NUM_BLOCKS, BLOCK, 3, 256), torch.bfloat16, g)


KINDS: dict[str, Callable] = {
    "standard_attention": standard, "mla": mla, "sparse_indexer": sparse,
    "sparse_int8_indexer": sparse_int8_indexer, "hybrid_kernel_blocks": kernel_blocks,
    "deepseek_v4_strided_list": strided_list, "hidden_states": hidden_states,
}


def caches(kind: str, seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {name: KINDS[kind](g) for name in LAYERS}


def block_bytes(layer_cache) -> int:
    return sum(t[0].numel() * t.element_size() * (t.shape[0] // NUM_BLOCKS) for t in cache_tensors(layer_cache))


def blocks(layer_cache, ids: list[int]) -> list[torch.Tensor]:
    """Each tensor's bytes of the blocks ``ids`` (a block is ``shape[0] // NUM_BLOCKS`` rows)."""
    out = []
    for t in cache_tensors(layer_cache):
        rows = t.shape[0] // NUM_BLOCKS
        out.append(torch.cat([t[i * rows:(i + 1) * rows].contiguous().view(torch.uint8).flatten() for i in ids]))
    return out


@pytest.fixture
def make_worker():
    made = []

    def make(kv_caches: dict, backend=None, **options):
        cfg = AioConfig(staging_buffer_size=1 << 20, **options)
        per_layer = block_bytes(kv_caches[LAYERS[0]])
        layers = 1 if cfg.transfer_mode is TransferMode.LAYERWISE else len(LAYERS)
        dep = Deployment(
            namespace=Namespace("m", "bf16", "auto", BLOCK, "NHD", "npu", 1, 1, 1, 1, 0, ""), block_size=BLOCK,
            layer_names=LAYERS, transfer_mode=cfg.transfer_mode,
            value_bytes=HEADER_BYTES + per_layer * layers, load_enabled=True, save_enabled=True,
            save_decode_cache=False, pool_name="p", num_kv_heads=2, use_mla=False,
        )
        backend = backend or LocalBackend(f"asc-{uuid.uuid4().hex[:8]}", 4 << 20, dep.value_bytes, seal=True)
        worker = AioWorker(dep, backend, Ownership(dep.topology(tp_rank=0)), cfg)
        worker.register_kv_caches(kv_caches, NUM_BLOCKS)
        made.append(worker)
        return worker, backend

    yield make
    for w in made:
        w.close()


def transfer(block_ids: list[int]) -> BlockTransfer:
    return BlockTransfer.of("r", block_ids, [f"h{i:04d}".encode() for i in range(len(block_ids))], 0)


def step(worker: AioWorker, meta: AioConnectorMetadata) -> None:
    """One forward as vllm-ascend's backends make it: every layer loaded and saved in order, a GDN layer's
    save under the empty name after each (the facade drops ``kv_layer``: a list, a tuple or ``[]``)."""
    worker.start_load_kv(meta)
    for name in LAYERS:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, meta)
        worker.save_kv_layer("", meta)
    worker.wait_for_save(meta)
    worker.drain()


@pytest.mark.parametrize("mode", [{}, {"transfer_mode": "layerwise"}], ids=["whole_blocks", "layerwise"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_tensor_of_a_block_round_trips_byte_for_byte(make_worker, kind, mode):
    source, target = caches(kind, 1), caches(kind, 2)
    untouched = {name: blocks(target[name], [i for i in range(NUM_BLOCKS) if i not in (7, 8, 9)]) for name in LAYERS}
    saver, backend = make_worker(source, **mode)
    step(saver, AioConnectorMetadata(saves=[transfer([2, 3, 4])]))
    loader, _ = make_worker(target, backend=backend, **mode)
    step(loader, AioConnectorMetadata(loads=[transfer([7, 8, 9])]))
    assert loader.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        for got, want in zip(blocks(target[name], [7, 8, 9]), blocks(source[name], [2, 3, 4])):
            assert torch.equal(got, want), f"{kind}: {name}"
        rest = blocks(target[name], [i for i in range(NUM_BLOCKS) if i not in (7, 8, 9)])
        assert all(torch.equal(a, b) for a, b in zip(rest, untouched[name])), f"{kind}: {name} written elsewhere"


def test_a_cache_split_into_rows_that_do_not_divide_into_blocks_is_refused(make_worker):
    g = torch.Generator().manual_seed(0)
    odd = {name: (_random((NUM_BLOCKS * 2 + 1, BLOCK // 2, 2, 64), torch.bfloat16, g),) for name in LAYERS}
    with pytest.raises(ValueError, match="no contiguous per-block region"):
        make_worker(odd)
