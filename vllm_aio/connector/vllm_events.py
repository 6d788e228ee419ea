"""The pool's KV events in vLLM's types (``events.py`` decides them in plain Python).

* ``SavedPartsEvents`` carries each rank's ``SavedParts`` through vLLM's
  worker -> scheduler channel for connector events
  (``get_kv_connector_kv_cache_events``; vLLM's output aggregator merges the
  workers' containers with ``add_events``).
* ``to_vllm`` turns ``Stored`` / ``Removed`` into ``BlockStored`` /
  ``BlockRemoved`` with the backend's medium, for ``take_events``.
"""

from __future__ import annotations

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from vllm_aio.connector.events import Removed, SavedParts, Stored

# The KV cache group of every event: the connector serves models with one (``shared/deployment.py``).
_GROUP = 0


class SavedPartsEvents(KVConnectorKVEvents):
    """Ranks' settled saves of one step. Every report counts (a rank stores only its shard),
    so there is no quorum over workers as in vLLM's own aggregators."""

    def __init__(self, reports: list[SavedParts]) -> None:
        self.reports = reports
        self._workers = 1

    def add_events(self, events: list) -> None:
        self.reports.extend(events)

    def aggregate(self) -> SavedPartsEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list:
        return self.reports

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self.reports = []


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
