"""Facts about the vLLM deployment that both connector halves derive identically.

Both halves receive the same ``VllmConfig`` and ``KVCacheConfig``; deriving the
key namespace, block size and value size here, once, guarantees the scheduler
looks up exactly the keys the workers store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_aio import vllm_compat
from vllm_aio.config import AioConfig, TransferMode
from vllm_aio.errors import ConfigError
from vllm_aio.pool.entry import HEADER_BYTES
from vllm_aio.pool.keys import Namespace, Unit
from vllm_aio.pool.ownership import Topology
from vllm_aio.shared.graph_mode import refuse_full_graphs

if TYPE_CHECKING:  # the scheduler half imports this module, and no torch (vLLM imports it)
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# vLLM's xxhash variants seed each process randomly: a key stored by one
# process would never be found by another.
_PORTABLE_HASHES = ("sha256", "sha256_cbor")


@dataclass(frozen=True)
class CacheGroup:
    """One KV cache group of vLLM's hybrid memory allocator, as both halves see it.

    vLLM gives every group its own block table per request; a block id belongs
    to one group at a time. A sliding-window group frees (and nulls, id 0) the
    blocks that leave its window while the request runs.
    """

    layer_names: tuple[str, ...] = ()
    window: int | None = None  # sliding window in tokens; None: every block is kept (full attention, MLA)
    retained: int = 0  # tokens kept below the window (vLLM's ``extra_retained_tokens``)

    def first_held_block(self, computed_tokens: int, block_size: int) -> int:
        """The first block of a request with ``computed_tokens`` computed that vLLM still holds.

        vLLM's ``SlidingWindowManager.get_num_skipped_tokens``: blocks wholly
        before the window of the next token are freed and nulled.
        """
        if self.window is None:
            return 0
        return max(0, computed_tokens - self.window + 1 - self.retained) // block_size


@dataclass(frozen=True)
class Deployment:
    namespace: Namespace
    block_size: int  # tokens per block, as hashed by vLLM
    layer_names: tuple[str, ...]
    value_bytes: int  # one stored value: header + one rank's block of one or all layers
    load_enabled: bool
    save_enabled: bool
    save_decode_cache: bool
    pool_name: str  # the embedded pool's name unless local_pool_name is set: private to this engine
    num_kv_heads: int  # in the whole model (MLA: see use_mla)
    use_mla: bool
    priority_cutoffs: tuple[int, ...] = ()  # AioConfig.priority_cutoffs
    resident_blocks: int = 0  # AioConfig.dynamic_buffer_resident_blocks
    # AioConfig.transfer_mode as this deployment runs it: a hybrid model's whole-block
    # loads run async (see deployment()).
    transfer_mode: TransferMode = TransferMode.WHOLE_BLOCKS
    buffer_count: int = 0  # device buffers of the dynamic buffer; 0: off
    # vLLM's KV cache groups. With more than one (hybrid attention), ``layer_names``
    # are group 0's: every group's i-th layer aliases the same cache memory
    # (``AioWorker`` checks), so a block's bytes are read the same through any group.
    groups: tuple[CacheGroup, ...] = (CacheGroup(),)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    def retention_of(self, priority: int) -> int:
        """The retention class of a request's saves: how many cutoffs its vLLM priority is at or below."""
        return sum(priority <= cutoff for cutoff in self.priority_cutoffs)

    def units(self) -> list[Unit]:
        """The layer sets stored as one value each, in layer order."""
        if self.transfer_mode is TransferMode.LAYERWISE:
            return [Unit((i,), i) for i in range(len(self.layer_names))]
        return [Unit(tuple(range(len(self.layer_names))), None)]

    def topology(self, tp_rank: int = 0, pp_rank: int = 0, pcp_rank: int = 0, dcp_rank: int = 0) -> Topology:
        ns = self.namespace
        return Topology(
            tp_size=ns.tp_size, tp_rank=tp_rank, num_kv_heads=self.num_kv_heads, use_mla=self.use_mla,
            pcp_size=ns.pcp_size, pcp_rank=pcp_rank, dcp_size=ns.dcp_size, dcp_rank=dcp_rank,
            pp_size=ns.pp_size, pp_rank=pp_rank,
        )


def build_deployment(
    vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", cfg: AioConfig
) -> Deployment:
    cache = vllm_config.cache_config
    if cache.prefix_caching_hash_algo not in _PORTABLE_HASHES:
        raise ConfigError(
            f"prefix_caching_hash_algo: AioConnector needs one of {', '.join(_PORTABLE_HASHES)} "
            f"(got {cache.prefix_caching_hash_algo!r}); xxhash seeds differ per process, so "
            "no stored block could ever be found again"
        )
    groups = _cache_groups(kv_cache_config)
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    _check_features(groups, kv_cache_config, cfg, vllm_config)
    refuse_full_graphs(cfg.transfer_mode, vllm_config)
    layers = groups[0].layer_names
    parallel = vllm_config.parallel_config
    block_size = _block_size(kv_cache_config, vllm_config, spec, parallel.decode_context_parallel_size)
    namespace = Namespace(
        model=str(vllm_config.model_config.model),
        dtype=str(vllm_config.model_config.dtype),
        kv_cache_dtype=str(cache.cache_dtype),
        block_size=block_size,
        kv_layout=vllm_compat.kv_cache_layout(kv_cache_config, vllm_config),
        attn_isa=_attention_isa(vllm_config, spec),
        tp_size=parallel.tensor_parallel_size,
        pp_size=parallel.pipeline_parallel_size,
        pcp_size=parallel.prefill_context_parallel_size,
        dcp_size=parallel.decode_context_parallel_size,
        group=0,
        salt=cfg.salt,
        weight_version=cfg.weight_version,
        kv_groups=_describe_groups(groups) if len(groups) > 1 else (),
    )
    role = vllm_config.kv_transfer_config.kv_role
    return Deployment(
        namespace=namespace,
        block_size=block_size,
        layer_names=layers,
        transfer_mode=_effective_mode(cfg.transfer_mode, len(groups)),
        buffer_count=cfg.dynamic_buffer_count if cfg.transfer_mode is TransferMode.DYNAMIC_BUFFER else 0,
        value_bytes=HEADER_BYTES + spec.page_size_bytes * (
            1 if cfg.transfer_mode is TransferMode.LAYERWISE else len(layers)),
        load_enabled=role == "kv_both" or (role == "kv_consumer" and cfg.consumer_is_to_load),
        save_enabled=role in ("kv_both", "kv_producer")
        or (role == "kv_consumer" and cfg.consumer_is_to_put),
        save_decode_cache=cfg.save_decode_cache,
        pool_name=f"engine-{vllm_config.kv_transfer_config.engine_id}",
        num_kv_heads=vllm_config.model_config.get_total_num_kv_heads(),
        use_mla=bool(vllm_config.model_config.use_mla),
        priority_cutoffs=cfg.priority_cutoffs,
        resident_blocks=cfg.dynamic_buffer_resident_blocks,
        groups=groups,
    )


def _cache_groups(kv_cache_config: "KVCacheConfig") -> tuple[CacheGroup, ...]:
    """vLLM's KV cache groups; refuses the kinds this connector cannot store by block hash."""
    return tuple(
        _cache_group(tuple(g.layer_names), g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups
    )


def _cache_group(layer_names: tuple[str, ...], spec) -> CacheGroup:
    """Full attention and MLA keep every block of a request; a sliding window
    frees those before it, which the scheduler half never names (``CacheGroup``).

    Refused: state caches (Mamba, linear attention: one state per request, not
    a block per token prefix), chunked local attention and R-SWA (``RSWASpec`` is a
    ``FullAttentionSpec`` that frees blocks mid-sequence, hence exact types).
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    specs = list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
    kinds = {type(s) for s in specs}
    if kinds <= {FullAttentionSpec, MLAAttentionSpec}:
        return CacheGroup(layer_names)
    if kinds == {SlidingWindowSpec}:
        windows = {(s.sliding_window, vllm_compat.extra_retained_tokens(s)) for s in specs}
        if len(windows) == 1:
            return CacheGroup(layer_names, *windows.pop())
    refused = ", ".join(sorted(k.__name__ for k in kinds))
    raise ConfigError(
        f"AioConnector stores full-attention, MLA and sliding-window KV caches; this model has a group of "
        f"{refused}: state caches (Mamba, linear attention) hold one state per request rather than a block "
        "per token prefix, and local or R-SWA attention frees blocks in the middle of a request"
    )


def _check_features(
    groups: tuple[CacheGroup, ...], kv_cache_config: "KVCacheConfig", cfg: AioConfig, vllm_config: "VllmConfig"
) -> None:
    """What several KV cache groups, or a sliding window, support: every group alike in
    block and layer count, and none of the features whose bookkeeping names the blocks
    of one group, or every block of a request."""
    hybrid, sliding = len(groups) > 1, any(g.window is not None for g in groups)
    if not (hybrid or sliding):
        return
    if hybrid:
        vllm_compat.require(vllm_compat.reports_failed_requests(), f"a hybrid model ({len(groups)} KV cache groups)",
                            "a failed load reported per request, KVConnectorOutput.failed_recving")
        shapes = {(g.kv_cache_spec.block_size, g.kv_cache_spec.page_size_bytes, len(g.layer_names))
                  for g in kv_cache_config.kv_cache_groups}
        if len(shapes) > 1:
            raise ConfigError(
                "AioConnector needs the KV cache groups of a hybrid model to share block size, page size and "
                f"layer count (got {sorted(shapes)} as (block size, page bytes, layers))"
            )
    events = vllm_config.kv_events_config
    refused = {
        "transfer_mode layerwise": (hybrid and cfg.transfer_mode is TransferMode.LAYERWISE,
                                    "its loads run inside the forward, where vLLM 0.32 cannot take a failed "
                                    "block of a model with several KV cache groups"),
        "transfer_mode dynamic_buffer": (cfg.transfer_mode is TransferMode.DYNAMIC_BUFFER,
                                         "its KV cache plan has one group of one tensor, and it streams every "
                                         "block of a request"),
        "migration": (cfg.migration, "a flush and a transfer name every block of one group"),
        "kv_events_config": (hybrid and bool(events and events.enable_kv_cache_events),
                             "announced blocks are one group's (vLLM's block hashes)"),
    }
    model = f"a hybrid model ({len(groups)} KV cache groups)" if hybrid else "sliding-window attention"
    for name, (enabled, why) in refused.items():
        if enabled:
            raise ConfigError(f"{name} is not supported with {model}: {why}")


def _describe_groups(groups: tuple[CacheGroup, ...]) -> tuple[str, ...]:
    """Each group's kind and layers, for the key namespace: a block of one group layout
    must never load into another (which layers slide, and how far, changes the bytes)."""
    return tuple(
        f"{'full' if g.window is None else f'window{g.window}+{g.retained}'}:{','.join(g.layer_names)}"
        for g in groups
    )


def _block_size(kv_cache_config: "KVCacheConfig", vllm_config: "VllmConfig", spec, dcp_size: int) -> int:
    """Tokens per block of ``request.block_hashes`` and of the scheduler's block ids.

    vLLM 0.32 hashes at ``hash_block_size`` and its KV cache manager hands out
    block ids of the attention block size x DCP (a DCP-sharded block holds
    1/DCP of its tokens on each rank); PCP scales neither. The scheduler half
    indexes both lists with one block size, so they must agree.
    """
    block_id_tokens = spec.block_size * (dcp_size if vllm_compat.dcp_sharded(spec) else 1)
    hash_tokens = vllm_compat.hash_block_size(kv_cache_config, vllm_config)
    if hash_tokens != block_id_tokens:
        raise ConfigError(
            f"vLLM hashes blocks of {hash_tokens} tokens but its block ids cover "
            f"{block_id_tokens}; AioConnector needs them equal"
        )
    return block_id_tokens


def _attention_isa(vllm_config: "VllmConfig", spec) -> str:
    """The CPU attention kernel's packing of a block; "-" off the CPU."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "-"
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        return _get_attn_isa(
            vllm_config.model_config.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype
        )
    except (NotImplementedError, AttributeError):
        return "cpu"


def _effective_mode(mode: TransferMode, num_groups: int) -> TransferMode:
    # vLLM 0.32 takes a failed load of a model with several KV cache groups only
    # per request, for loads finished before the request is scheduled.
    if num_groups > 1 and mode is TransferMode.WHOLE_BLOCKS:
        return TransferMode.ASYNC
    return mode
