"""Facts about the vLLM deployment that both connector halves derive identically.

Both halves receive the same ``VllmConfig`` and ``KVCacheConfig``; deriving the
key namespace, block size and value size here, once, guarantees the scheduler
looks up exactly the keys the workers store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_aio.config import AioConfig, ConfigError
from vllm_aio.pool.entry import HEADER_BYTES
from vllm_aio.pool.keys import Namespace, Unit
from vllm_aio.pool.ownership import Topology

if TYPE_CHECKING:  # the scheduler half imports this module, and no torch (vLLM imports it)
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# vLLM's xxhash variants seed each process randomly: a key stored by one
# process would never be found by another.
_PORTABLE_HASHES = ("sha256", "sha256_cbor")


@dataclass(frozen=True)
class Deployment:
    namespace: Namespace
    block_size: int  # tokens per block, as hashed by vLLM
    layer_names: tuple[str, ...]
    layerwise: bool  # one value per (block, layer) instead of per block
    load_async: bool  # loads finish before the request is scheduled
    buffer_layers: int  # device layer buffers of the dynamic buffer; 0: off
    value_bytes: int  # one stored value: header + one rank's block of one or all layers
    load_enabled: bool
    save_enabled: bool
    save_decode_cache: bool
    pool_name: str  # the embedded pool's name unless local_pool_name is set: private to this engine
    num_kv_heads: int  # in the whole model (MLA: see use_mla)
    use_mla: bool
    priority_cutoffs: tuple[int, ...] = ()  # AioConfig.priority_cutoffs

    def retention_of(self, priority: int) -> int:
        """The retention class of a request's saves: how many cutoffs its vLLM priority is at or below."""
        return sum(priority <= cutoff for cutoff in self.priority_cutoffs)

    def units(self) -> list[Unit]:
        """The layer sets stored as one value each, in layer order."""
        if self.layerwise:
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
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"AioConnector supports models with one KV cache group; this model has {len(groups)} "
            "(hybrid attention)"
        )
    spec = groups[0].kv_cache_spec
    _check_keeps_every_block(spec)
    layers = tuple(groups[0].layer_names)
    parallel = vllm_config.parallel_config
    block_size = _block_size(kv_cache_config, spec, parallel.decode_context_parallel_size)
    namespace = Namespace(
        model=str(vllm_config.model_config.model),
        dtype=str(vllm_config.model_config.dtype),
        kv_cache_dtype=str(cache.cache_dtype),
        block_size=block_size,
        kv_layout=str(kv_cache_config.kv_cache_layout),
        attn_isa=_attention_isa(vllm_config, spec),
        tp_size=parallel.tensor_parallel_size,
        pp_size=parallel.pipeline_parallel_size,
        pcp_size=parallel.prefill_context_parallel_size,
        dcp_size=parallel.decode_context_parallel_size,
        group=0,
        salt=cfg.salt,
        weight_version=cfg.weight_version,
    )
    role = vllm_config.kv_transfer_config.kv_role
    return Deployment(
        namespace=namespace,
        block_size=block_size,
        layer_names=layers,
        layerwise=cfg.use_layerwise,
        load_async=cfg.load_async,
        buffer_layers=cfg.dynamic_buffer_layers,
        value_bytes=HEADER_BYTES + spec.page_size_bytes * (1 if cfg.use_layerwise else len(layers)),
        load_enabled=role == "kv_both" or (role == "kv_consumer" and cfg.consumer_is_to_load),
        save_enabled=role in ("kv_both", "kv_producer")
        or (role == "kv_consumer" and cfg.consumer_is_to_put),
        save_decode_cache=cfg.save_decode_cache,
        pool_name=f"engine-{vllm_config.kv_transfer_config.engine_id}",
        num_kv_heads=vllm_config.model_config.get_total_num_kv_heads(),
        use_mla=bool(vllm_config.model_config.use_mla),
        priority_cutoffs=cfg.priority_cutoffs,
    )


def _check_keeps_every_block(spec) -> None:
    """Refuse KV caches whose manager frees a running request's blocks early.

    A sliding window (or local, or R-SWA) attention manager frees the blocks
    that leave the window while the request runs and hands them to other
    requests; this connector's block lists would then name blocks holding
    another request's KV (a preemption's rescue, a migration's flush would
    store it under this request's hashes). Exact types: ``RSWASpec`` is a
    ``FullAttentionSpec`` that frees blocks too.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs

    specs = list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
    refused = sorted({type(s).__name__ for s in specs if type(s) not in (FullAttentionSpec, MLAAttentionSpec)})
    if refused:
        raise ConfigError(
            f"AioConnector supports full-attention and MLA KV caches; this model's is {', '.join(refused)}, "
            "whose blocks are freed while a request runs (sliding window, local attention, state caches)"
        )


def _block_size(kv_cache_config: "KVCacheConfig", spec, dcp_size: int) -> int:
    """Tokens per block of ``request.block_hashes`` and of the scheduler's block ids.

    vLLM 0.32 hashes at ``hash_block_size`` and its KV cache manager hands out
    block ids of the attention block size x DCP (a DCP-sharded block holds
    1/DCP of its tokens on each rank); PCP scales neither. The scheduler half
    indexes both lists with one block size, so they must agree.
    """
    block_id_tokens = spec.block_size * (dcp_size if spec.dcp_sharded else 1)
    if kv_cache_config.hash_block_size != block_id_tokens:
        raise ConfigError(
            f"vLLM hashes blocks of {kv_cache_config.hash_block_size} tokens but its block ids cover "
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
