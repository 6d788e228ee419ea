"""Stand-ins for vLLM's request and scheduler-output objects, and an in-memory backend, for the
scheduler half's unit tests (``test_scheduler.py``, ``test_scheduler_hybrid.py``, ``test_keying.py``,
``test_kv_events.py``): the end-to-end tests use the real ones.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from types import SimpleNamespace

from vllm_aio.backends import Backend, Status
from vllm_aio.config import TransferMode
from vllm_aio.connector.scheduler.scheduler import AioScheduler
from vllm_aio.pool.keys import Namespace, block_key
from vllm_aio.pool.ownership import Ownership
from vllm_aio.shared.deployment import Deployment

BS = 4


class DictBackend(Backend):
    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.exists_calls = 0
        self.leases: list[tuple[list[bytes], float]] = []

    def lease_blocks(self, parts, hashes, seconds):
        self.leases.append((list(hashes), seconds))

    def batch_exists(self, keys):
        self.exists_calls += 1
        return [k in self.keys for k in keys]

    def batch_put(self, keys, segments, retention=0):
        self.keys.update(keys)
        return [Status.OK] * len(keys)

    def batch_get(self, keys, segments):
        return [Status.OK if k in self.keys else Status.MISSING for k in keys]

    def close(self):
        pass


class DownBackend(DictBackend):
    def batch_exists(self, keys):
        raise ConnectionError("down")


@dataclass
class Req:
    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    priority: int = 0

    def __post_init__(self) -> None:
        self.block_hashes = [block_hash(self.request_id, i) for i in range(self.num_tokens // BS)]

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


def block_hash(req_id: str, index: int) -> bytes:
    """A stand-in for vLLM's chained block hash: fixed size, like sha256."""
    return hashlib.sha256(f"{req_id}-{index}".encode()).digest()


def deployment(
    tp: int = 1, load: bool = True, save: bool = True, decode: bool = False, heads: int = 8,
    transfer_mode: TransferMode = TransferMode.WHOLE_BLOCKS, buffer_count: int = 0,
) -> Deployment:
    ns = Namespace("m", "bf16", "auto", BS, "LBHNC", "amx", tp, 1, 1, 1, 0, "")
    return Deployment(
        namespace=ns, block_size=BS, layer_names=("l0", "l1"),
        value_bytes=64, load_enabled=load, save_enabled=save, save_decode_cache=decode, pool_name="p",
        num_kv_heads=heads, use_mla=False, transfer_mode=transfer_mode,
        buffer_count=buffer_count,
    )


def shards(dep: Deployment) -> list[str]:
    return Ownership(dep.topology()).all_shard_ids()


def store(backend: DictBackend, dep: Deployment, req: Req, num_blocks: int, only=None) -> None:
    for h in req.block_hashes[:num_blocks]:
        for shard in only or shards(dep):
            backend.keys.add(block_key(dep.namespace.digest(), shard, h))


def blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def step(new=(), cached=(), scheduled=None, finished=(), **extra):
    """A SchedulerOutput stand-in: new=(req_id, block_ids, num_computed),
    cached=(req_id, new_ids, num_computed, resumed)."""
    return SimpleNamespace(
        finished_req_ids=set(finished),
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),), num_computed_tokens=n) for r, b, n in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            new_block_ids=[(list(c[1]),) if c[1] is not None else None for c in cached],
            num_computed_tokens=[c[2] for c in cached],
            resumed_req_ids={c[0] for c in cached if c[3]},
        ),
        num_scheduled_tokens=scheduled or {},
        preempted_req_ids=set(extra.get("preempted", ())),
        new_block_ids_to_zero=extra.get("zero"),
        kv_cache_block_copies=extra.get("copies"),
    )



def decoded_for_a_while(sched: AioScheduler) -> Req:
    """Request "a": an 8-token prompt in blocks 1, 2, then 9 generated tokens (blocks 3, 4, 5)."""
    req = Req("a", 8)
    sched.update_state_after_alloc(req, blocks([1, 2]), 0)
    sched.build_connector_meta(step(new=[("a", [1, 2], 0)], scheduled={"a": 8}))
    for computed, new_block in ((8, [3]), (9, []), (10, []), (11, []), (12, [4]), (13, []), (14, []), (15, []),
                                (16, [5])):
        req.num_output_tokens = computed - 7
        req.block_hashes = [block_hash("a", i) for i in range(req.num_tokens // BS)]
        sched.build_connector_meta(step(cached=[("a", new_block, computed, False)], scheduled={"a": 1}))
    return req  # 17 tokens computed: blocks 1-4 full
