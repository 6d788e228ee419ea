"""The pool's KV events in vLLM's types (``events.py`` decides them in plain Python): the ranks'
``SavedParts`` ride vLLM's worker -> scheduler metadata (``SavedPartsMetadata``), and ``to_vllm``
turns ``Stored`` / ``Removed`` into ``BlockStored`` / ``BlockRemoved`` with the backend's medium.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from vllm_aio.connector.events import Removed, SavedParts, Stored

# The KV cache group of every event: the connector serves models with one (``shared/deployment.py``).
_GROUP = 0


@dataclass
class SavedPartsMetadata(KVConnectorWorkerMetadata):
    """Ranks' settled saves of one step, from ``build_connector_worker_meta`` to the scheduler's
    ``update_connector_output``. vLLM's output aggregator folds the ranks' with ``aggregate``; every
    report counts (a rank stores only its shard), so there is no quorum over workers."""

    reports: list[SavedParts]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> SavedPartsMetadata:
        assert isinstance(other, SavedPartsMetadata)
        return SavedPartsMetadata(self.reports + other.reports)


def to_vllm(events: list[Stored | Removed], medium: str) -> list[KVCacheEvent]:
    """vLLM's events for ours; hashes as vLLM publishes its own (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    out: list[KVCacheEvent] = []
    for event in events:
        hashes = [maybe_convert_block_hash(h) for h in event.block_hashes]
        if isinstance(event, Removed):
            out.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=_GROUP))
            continue
        parent = event.parent_block_hash
        out.append(BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=medium,
            lora_name=event.lora_name,
            group_idx=_GROUP,
        ))
    return out
