"""The worker half: moves KV bytes between vLLM's cache and the pool.

One instance per worker process. Loads run in ``start_load_kv``, which vLLM
calls before the forward whenever a scheduled request loads synchronously, so
the blocks are in place before attention reads them. Saves run in
``wait_for_save`` after the forward, before the step returns: the blocks
cannot be freed or reused while we read them.

A block that cannot be loaded (missing, evicted mid-read, short, pool down) is
reported through ``get_block_ids_with_load_errors``; vLLM, with
``kv_load_failure_policy: recompute``, recomputes from the first bad block. A
failed save is counted and logged once per kind; the request goes on.
"""

from __future__ import annotations

import time
from collections import Counter
import torch

from vllm_aio.backends import Backend, Status
from vllm_aio.connector.block_layout import BlockLayout
from vllm_aio.connector.deployment import Deployment
from vllm_aio.connector.metadata import AioConnectorMetadata, BlockTransfer
from vllm_aio.connector.stats import AioConnectorStats
from vllm_aio.log import get_logger
from vllm_aio.pool.keys import block_key
from vllm_aio.pool.ownership import Ownership

logger = get_logger(__name__)


class AioWorker:
    def __init__(self, deployment: Deployment, backend: Backend, ownership: Ownership) -> None:
        self._dep = deployment
        self._backend = backend
        self._digest = deployment.namespace.digest()
        self._owner = ownership
        t = ownership.topology
        # The first rank speaks for the scheduler, so TP does not multiply lookups.
        self._reports_lookups = not (t.tp_rank or t.pp_rank or t.pcp_rank or t.dcp_rank)
        self._layout: BlockLayout | None = None
        self._load_errors: set[int] = set()
        self._save_failures_logged: set[Status] = set()
        self.stats = AioConnectorStats()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        layout = BlockLayout(kv_caches, self._dep.layer_names, num_blocks)
        if layout.block_bytes != self._dep.value_bytes:
            raise ValueError(
                f"KV cache blocks hold {layout.block_bytes} bytes but the KV cache config "
                f"promises {self._dep.value_bytes}; padded or mixed layouts are not supported"
            )
        for address, size in layout.memory_spans():
            self._backend.register_memory(address, size)
        self._layout = layout

    def _keys(self, transfer: BlockTransfer, positions: list[int]) -> list[str]:
        return [block_key(self._digest, self._owner.shard_id, transfer.block_hashes[i]) for i in positions]

    def _segments(self, transfer: BlockTransfer, positions: list[int]) -> list:
        assert self._layout is not None, "register_kv_caches was not called"
        return [self._layout.segments(transfer.block_ids[i]) for i in positions]

    def _owned(self, transfer: BlockTransfer) -> list[int]:
        """Positions of the blocks this rank stores (one replica of each shard does)."""
        first = transfer.first_index
        return [i - first for i in self._owner.owned_blocks(range(first, first + len(transfer.block_ids)))]

    # ---- loads -----------------------------------------------------------
    def start_load_kv(self, meta: AioConnectorMetadata) -> None:
        if self._reports_lookups:
            self.stats.add(hit_tokens=meta.lookups.hit_tokens, miss_tokens=meta.lookups.miss_tokens)
        for transfer in meta.loads:
            self._load(transfer)

    def _load(self, transfer: BlockTransfer) -> None:
        # Every rank loads its shard of every block; replicas of a shard start
        # at different blocks so they do not all hit the same values at once.
        positions = self._owner.read_order(range(len(transfer.block_ids)))
        start = time.perf_counter()
        try:
            statuses = self._backend.batch_get(self._keys(transfer, positions), self._segments(transfer, positions))
        except Exception as exc:  # the pool failed as a whole: every block is lost
            statuses = [Status.ERROR] * len(positions)
            logger.warning("vllm_aio: load for request %s failed: %s", transfer.req_id, exc)
        elapsed = time.perf_counter() - start
        failed = [transfer.block_ids[i] for i, s in zip(positions, statuses) if s is not Status.OK]
        loaded = len(statuses) - len(failed)
        self.stats.add(
            load_blocks=loaded,
            load_bytes=loaded * self._dep.value_bytes,
            load_seconds=elapsed,
            load_failures=len(failed),
        )
        if failed:
            self._load_errors.update(failed)
            reasons = Counter(s.value for s in statuses if s is not Status.OK)
            logger.warning(
                "vllm_aio: request %s: %d of %d pool blocks could not be loaded (%s); "
                "vLLM recomputes them",
                transfer.req_id,
                len(failed),
                len(statuses),
                ", ".join(f"{n} {r}" for r, n in sorted(reasons.items())),
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- saves -----------------------------------------------------------
    def wait_for_save(self, meta: AioConnectorMetadata) -> None:
        if not meta.saves:
            return
        owned = [(t, self._owned(t)) for t in meta.saves]
        keys = [k for t, positions in owned for k in self._keys(t, positions)]
        segments = [s for t, positions in owned for s in self._segments(t, positions)]
        if not keys:
            return
        start = time.perf_counter()
        try:
            statuses = self._backend.batch_put(keys, segments)
        except Exception as exc:
            statuses = [Status.ERROR] * len(keys)
            self._log_save_failure(Status.ERROR, str(exc))
        elapsed = time.perf_counter() - start
        counts = Counter(statuses)
        for status in (Status.NO_SPACE, Status.ERROR):
            if counts[status]:
                self._log_save_failure(status, f"{counts[status]} blocks")
        self.stats.add(
            save_blocks=counts[Status.OK],
            save_bytes=counts[Status.OK] * self._dep.value_bytes,
            save_seconds=elapsed,
            save_skipped=counts[Status.EXISTS],
            save_failures=counts[Status.NO_SPACE] + counts[Status.ERROR],
        )

    def _log_save_failure(self, status: Status, detail: str) -> None:
        if status in self._save_failures_logged:
            return
        self._save_failures_logged.add(status)
        logger.warning(
            "vllm_aio: pool save failed (%s: %s); requests continue, later failures of this "
            "kind are only counted in the KV Transfer metrics",
            status.value,
            detail,
        )

    def take_stats(self) -> AioConnectorStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, AioConnectorStats()
        return stats

    def close(self) -> None:
        self._backend.close()
