"""The scheduler half's start line: the role, store, transfer mode and key namespace a run uses, so
its log says which path it exercised; and a warning where a failed load fails its request."""

from __future__ import annotations

from typing import Any

from vllm_aio.backends import Backend
from vllm_aio.config import AioConfig, TransferMode
from vllm_aio.log import get_logger
from vllm_aio.shared.deployment import Deployment

logger = get_logger(__name__)


def log_start(cfg: AioConfig, dep: Deployment, transfer: Any, backend: Backend) -> None:
    """``transfer``: vLLM's ``KVTransferConfig``."""
    logger.info(
        "vllm_aio: AioConnector role=%s backend=%s %s load=%s save=%s transfer=%s "
        "save_decode_cache=%s block_size=%d value_bytes=%d kv_cache_groups=%s namespace=%s (%s)",
        transfer.kv_role,
        cfg.backend,
        backend.describe(),
        dep.load_enabled,
        dep.save_enabled,
        _transfer_mode(cfg, dep),
        dep.save_decode_cache,
        dep.block_size,
        dep.value_bytes,
        _describe_groups(dep),
        dep.namespace.digest(),
        dep.namespace,
    )
    if transfer.kv_load_failure_policy != "recompute":
        logger.warning(
            "vllm_aio: kv_load_failure_policy=%r: a block evicted between lookup and load fails "
            "its request; set \"kv_load_failure_policy\": \"recompute\" to recompute it instead",
            transfer.kv_load_failure_policy,
        )


def _describe_groups(dep: Deployment) -> str:
    kinds = ["full" if g.window is None else f"window {g.window}" for g in dep.groups]
    return f"{len(kinds)} ({', '.join(kinds)})" + (
        "; loads run in the background: vLLM takes a failed load of a hybrid model per request only then"
        if dep.hybrid else ""
    )


def _transfer_mode(cfg: AioConfig, dep: Deployment) -> str:
    if dep.transfer_mode is TransferMode.LAYERWISE:
        return f"layerwise(prefetch={cfg.layerwise_prefetch_layers})"
    if dep.transfer_mode is TransferMode.DYNAMIC_BUFFER:
        return f"dynamic_buffer(count={dep.buffer_count})"
    return str(dep.transfer_mode)
