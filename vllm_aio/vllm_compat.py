"""The vLLM internals that moved between the versions this package runs on: 0.23 (vllm-ascend
v0.23) through 0.27.1 (vllm-ascend main) to 0.32.

Every seam detects the feature itself, never a version string, and the rest of the package asks
here instead of reaching into vLLM where the versions differ. What only a newer vLLM can do
refuses at start (``require``), naming the setting and the version it needs.

What differs, and what each side does:

* Async load completions: 0.32 asks ``get_transfer_results`` (with per-request failures); older
  versions ask ``get_finished``. The connector answers both (``transfer_results`` builds 0.32's).
* Per-request load failures (``KVConnectorOutput.failed_recving``): 0.32 only. Without them a
  hybrid model's failed load could not be reported, so hybrid models need 0.32.
* ``KVCacheConfig.hash_block_size`` and ``kv_cache_layout``, ``AttentionSpec.dcp_sharded``,
  ``SlidingWindowSpec.extra_retained_tokens``: 0.32 fields, derived as older vLLM does.
* ``SchedulerOutput.kv_cache_block_copies``: absent in 0.23 (no copies to follow).
* ``KVCacheTensor.layers`` / ``layer_stride``: 0.32's one-tensor-for-many-layers plan, which the
  dynamic buffer's aliasing needs.
* ``vllm.v1.metrics.cache_hit_source``: 0.32 labels prefix hits by source; older versions do not.
* Hooks that run at other times there (``start_load_kv`` always before the forward, no
  ``wait_for_save`` on steps without one) need nothing: the worker is correct in either order.

No torch here: the scheduler half imports this module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_aio.backends.settings import ConfigError

NEWEST = "0.32"  # what the seams below that refuse need


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def require(available: bool, setting: str, what: str) -> None:
    """Refuse ``setting`` at start where this vLLM lacks ``what``."""
    if not available:
        raise ConfigError(f"{setting} needs vLLM {NEWEST} or later ({what}); this is vLLM {vllm_version()}")


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


# ---- the connector's results -----------------------------------------------------------------------
def transfer_results(finished_recving: set[str], failed_recving: set[str]) -> Any:
    """vLLM 0.32's ``KVConnectorTransferResults`` (only 0.32 asks for it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    return KVConnectorTransferResults(finished_recving=finished_recving, failed_recving=failed_recving)


def reports_failed_requests() -> bool:
    """Whether the connector's output carries per-request load failures (``failed_recving``)."""
    from vllm.v1.outputs import KVConnectorOutput

    return "failed_recving" in _fields(KVConnectorOutput)


def failed_recving(connector_output: Any) -> set[str]:
    return getattr(connector_output, "failed_recving", None) or set()


def host_cache_hit_source() -> Any:
    """The label vLLM 0.32's prefix-cache metrics give hits from host memory; None before it."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return CacheHitSource.HOST


# ---- the KV cache plan -------------------------------------------------------------------------------
def hash_block_size(kv_cache_config: Any, vllm_config: Any) -> int:
    """Tokens per ``request.block_hashes`` entry: 0.32 records it on the config; older versions derive
    it as their engine core does (``resolve_kv_cache_block_sizes``)."""
    size = getattr(kv_cache_config, "hash_block_size", None)
    if size:
        return int(size)
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])


def kv_cache_layout(kv_cache_config: Any, vllm_config: Any) -> str:
    """The KV cache layout: 0.32 records it on the config; older versions derive it per process from
    the current config (which the scheduler's process has not set when it builds the connector)."""
    if hasattr(kv_cache_config, "kv_cache_layout"):
        return str(kv_cache_config.kv_cache_layout)
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    with set_current_vllm_config(vllm_config):
        return str(get_kv_cache_layout())


def dcp_sharded(spec: Any) -> bool:
    """Whether the group's blocks are sharded over DCP ranks (before 0.32 every attention group was)."""
    return bool(getattr(spec, "dcp_sharded", True))


def extra_retained_tokens(spec: Any) -> int:
    """Tokens a sliding window keeps beyond the window (0.32's field; none before it)."""
    return int(getattr(spec, "extra_retained_tokens", 0))


def aliases_layers() -> bool:
    """Whether one ``KVCacheTensor`` describes several layers (0.32), which the dynamic buffer needs."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    return {"layers", "layer_stride"} <= _fields(KVCacheTensor)


def kv_cache_block_copies(scheduler_output: Any) -> list[Any]:
    """Blocks vLLM copies within the cache this step (0.23 has no such copies)."""
    return list(getattr(scheduler_output, "kv_cache_block_copies", None) or [])
