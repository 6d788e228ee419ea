"""``PoolKeying``: the keys the scheduler half looks blocks up and plans transfers under.

A block hits only when every distinct shard of the deployment (and, layerwise,
every layer of it) is stored, so the keys of one block are its ``BlockParts``:
the namespace digest (model, shape, salt, weight version), the shards and the
units. The weight version changes at runtime (the migration control's
thread, ``set_weight_version``) while the scheduling thread reads the keys,
so the namespace and its parts are replaced together, as one object.

Hybrid models key each KV cache group's blocks apart (``group_block_hashes``);
a model of one group keys them by vLLM's hash alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_aio.pool.keys import BlockParts, Namespace, group_block_hashes
from vllm_aio.pool.ownership import Ownership
from vllm_aio.shared.deployment import Deployment


@dataclass(frozen=True)
class _Keys:
    namespace: Namespace
    parts: BlockParts


class PoolKeying:
    def __init__(self, deployment: Deployment) -> None:
        self._shards = tuple(Ownership(deployment.topology()).all_shard_ids())
        self._tags = tuple(unit.tag for unit in deployment.units())
        self._groups: list[int | None] = list(range(len(deployment.groups))) if deployment.hybrid else [None]
        self._keys = self._keys_of(deployment.namespace)

    def _keys_of(self, namespace: Namespace) -> _Keys:
        return _Keys(namespace, BlockParts(namespace.digest(), self._shards, self._tags))

    @property
    def namespace(self) -> Namespace:
        return self._keys.namespace

    @property
    def parts(self) -> BlockParts:
        return self._keys.parts

    def set_weight_version(self, version: str) -> None:
        """Key everything from now on under ``version``: KV of other weights stops hitting.

        The workers follow with the next step's metadata (``namespace_digest``).
        """
        self._rekey(weight_version=version)

    def set_kv_layout(self, layout: str) -> None:
        """Key under the KV cache layout the workers report (``WorkerFacts``), at start."""
        self._rekey(kv_layout=layout)

    def _rekey(self, **changes: str) -> None:
        self._keys = self._keys_of(dataclasses.replace(self._keys.namespace, **changes))

    def group_hashes(self, block_hashes: Sequence[bytes], group: int) -> list[bytes]:
        """The hashes KV cache group ``group``'s blocks are stored under."""
        return group_block_hashes(block_hashes, self._groups[group])
