"""The worker half's unit-test setting: CPU tensors shaped like vLLM's KV cache, their deployment, and
how vLLM drives a step (``test_worker.py``, ``test_kv_events.py``).
"""

from __future__ import annotations

import torch

from vllm_aio.config import AioConfig, TransferMode
from vllm_aio.connector.worker.worker import AioWorker
from vllm_aio.pool.entry import HEADER_BYTES
from vllm_aio.pool.keys import Namespace
from vllm_aio.shared.deployment import Deployment
from vllm_aio.shared.metadata import AioConnectorMetadata, BlockTransfer

LAYERS, NUM_BLOCKS, PAGE = ("l0", "l1"), 16, (2, 4, 8)  # [blocks, heads, tokens, channels]
PAGE_BYTES = 2 * 4 * 8 * 2
VALUE_BYTES = HEADER_BYTES + PAGE_BYTES * len(LAYERS)


def kv_caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn((NUM_BLOCKS, *PAGE), generator=g).to(torch.bfloat16) for n in LAYERS}


def deployment(cfg: AioConfig, tp_size: int = 1, heads: int = 4, salt: str = "") -> Deployment:
    ns = Namespace("m", "bf16", "auto", 8, "LBHNC", "amx", tp_size, 1, 1, 1, 0, salt)
    layers = 1 if cfg.transfer_mode is TransferMode.LAYERWISE else len(LAYERS)
    return Deployment(
        namespace=ns, block_size=8, layer_names=LAYERS, transfer_mode=cfg.transfer_mode,
        value_bytes=HEADER_BYTES + PAGE_BYTES * layers, load_enabled=True, save_enabled=True,
        save_decode_cache=False, pool_name="p", num_kv_heads=heads, use_mla=False,
    )


def saved(worker: AioWorker, meta: AioConnectorMetadata) -> None:
    """A step's saves, through to the pool (puts finish in the background)."""
    worker.wait_for_save(meta)
    worker.drain()


def transfer(block_ids, tag="x", first_index=0):
    hashes = [f"{tag}{first_index + i:04d}".encode() for i in range(len(block_ids))]  # one size, as vLLM's
    return BlockTransfer.of("r", block_ids, hashes, first_index)


def forward(worker: AioWorker, meta: AioConnectorMetadata, compute=lambda layer: None) -> set[int]:
    """One step as vLLM drives a layerwise connector; returns the load errors."""
    worker.start_load_kv(meta)
    for layer, name in enumerate(LAYERS):
        worker.wait_for_layer_load(name)
        compute(layer)
        worker.save_kv_layer(name, meta)
    worker.wait_for_save(meta)
    return worker.get_block_ids_with_load_errors()
