"""A 128k-token prompt through the scheduler half and the worker half, over a fake forward.

No vLLM: the scheduler gets stand-ins of vLLM's request and scheduler output,
the worker a small CPU KV cache of 16-token blocks, both one embedded pool
(attached twice, as vLLM's engine-core and worker processes do). Layerwise,
so each block is one value per layer. The end-to-end counterpart on real vLLM
runs at the longest context the tiny model allows (``test_e2e_long_context.py``).
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from vllm_aio.backends.local import LocalBackend
from vllm_aio.config import AioConfig, TransferMode
from vllm_aio.connector.scheduler.scheduler import AioScheduler
from vllm_aio.connector.worker.worker import AioWorker
from vllm_aio.pool.entry import HEADER_BYTES
from vllm_aio.pool.keys import Namespace
from vllm_aio.pool.ownership import Ownership
from vllm_aio.shared.deployment import Deployment

BS = 16
PROMPT_BLOCKS = 8192  # 131,072 tokens
LAYERS = ("l0", "l1")
PAGE = (2, BS, 2)  # per block: K/V, tokens, channels (bf16): 128 bytes
PAGE_BYTES = 2 * BS * 2 * 2
NUM_BLOCKS = 2 * PROMPT_BLOCKS + 1  # block 0 unused, then where the prompt is computed, then where it loads
COMPUTED = list(range(1, PROMPT_BLOCKS + 2))  # the prompt's full blocks and its one-token tail
LOADED = list(range(PROMPT_BLOCKS + 1, 2 * PROMPT_BLOCKS + 1)) + [0]


@dataclass
class Request:
    request_id: str
    num_prompt_tokens: int = PROMPT_BLOCKS * BS + 1  # every block full, one token to compute
    num_output_tokens: int = 0
    block_hashes: list[bytes] = field(
        default_factory=lambda: [hashlib.sha256(f"prompt-{i}".encode()).digest() for i in range(PROMPT_BLOCKS)]
    )
    priority: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens


def scheduler_output(new: tuple[str, list[int], int, int] | None = None):
    """A SchedulerOutput stand-in, with one new request (id, block ids, computed, scheduled) or none."""
    return SimpleNamespace(
        finished_req_ids=set(),
        scheduled_new_reqs=[SimpleNamespace(req_id=new[0], block_ids=(new[1],), num_computed_tokens=new[2])]
        if new else [],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()),
        num_scheduled_tokens={new[0]: new[3]} if new else {},
        preempted_req_ids=None,
    )


@pytest.fixture
def halves():
    """(scheduler, worker, KV cache, the worker's backend) over one pool with room for the prompt and a little more."""
    ns = Namespace("m", "bf16", "auto", BS, "LBHNC", "amx", 1, 1, 1, 1, 0, "")
    dep = Deployment(
        namespace=ns, block_size=BS, layer_names=LAYERS, transfer_mode=TransferMode.LAYERWISE,
        value_bytes=HEADER_BYTES + PAGE_BYTES, load_enabled=True, save_enabled=True, save_decode_cache=False,
        pool_name="p", num_kv_heads=1, use_mla=False,
    )
    name, pool_bytes = f"long-{uuid.uuid4().hex[:8]}", (PROMPT_BLOCKS * len(LAYERS) + 64) * dep.value_bytes
    scheduler = AioScheduler(dep, LocalBackend(name, pool_bytes, dep.value_bytes, seal=False))
    cfg = AioConfig(transfer_mode="layerwise", staging_buffer_size=4 << 20)
    backend = LocalBackend(name, pool_bytes, dep.value_bytes, seal=True)
    worker = AioWorker(dep, backend, Ownership(dep.topology()), cfg)
    g = torch.Generator().manual_seed(0)
    caches = {n: torch.randn((NUM_BLOCKS, *PAGE), generator=g).to(torch.bfloat16) for n in LAYERS}
    worker.register_kv_caches(caches, NUM_BLOCKS)
    yield scheduler, worker, caches, backend
    worker.close()
    scheduler.close()


def step(scheduler: AioScheduler, worker: AioWorker, req: Request, block_ids: list[int]) -> tuple[int, set[int]]:
    """Lookup, allocation and one forward of the whole prompt; (tokens the pool served, load errors)."""
    hit, _ = scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (block_ids,)), hit)
    meta = scheduler.build_connector_meta(scheduler_output((req.request_id, block_ids, hit, req.num_tokens - hit)))
    worker.start_load_kv(meta)
    for name in LAYERS:  # the fake forward: the layer's KV is already in the cache
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, meta)
    worker.wait_for_save(meta)
    worker.drain()
    errors = worker.get_block_ids_with_load_errors()
    scheduler.update_connector_output(errors)
    return hit, errors


def test_a_fully_cached_128k_token_prompt_loads_every_part_of_every_block(halves):
    scheduler, worker, caches, _ = halves
    assert step(scheduler, worker, Request("cold"), COMPUTED) == (0, set())
    assert step(scheduler, worker, Request("warm"), LOADED) == (PROMPT_BLOCKS * BS, set())
    for name in LAYERS:
        assert torch.equal(caches[name][LOADED[:-1]], caches[name][COMPUTED[:-1]])
    assert worker.take_stats().data["load_bytes"] == PROMPT_BLOCKS * len(LAYERS) * (HEADER_BYTES + PAGE_BYTES)


def test_a_part_evicted_after_the_lookup_is_reported_for_recompute(halves):
    scheduler, worker, _, backend = halves
    step(scheduler, worker, Request("cold"), COMPUTED)
    pool = backend.pool
    lookup = scheduler.get_num_new_matched_tokens

    def lookup_then_evict(req, computed):
        answer = lookup(req, computed)
        usage = pool.usage()  # fill every free slot and one more: the oldest part (block 0, layer 0) goes
        pool.abandon(backend.slots().reserve([f"x{i}" for i in range(usage.num_slots - usage.num_ready + 1)]))
        return answer

    scheduler.get_num_new_matched_tokens = lookup_then_evict
    assert step(scheduler, worker, Request("warm"), LOADED) == (PROMPT_BLOCKS * BS, {LOADED[0]})
    assert scheduler.build_connector_meta(scheduler_output()).lookups.failed_hit_tokens == PROMPT_BLOCKS * BS
