"""Re-plans vLLM's KV cache for ``transfer_mode: dynamic_buffer``: L layers on S buffers.

vLLM sizes its KV cache in ``get_kv_cache_configs`` (``vllm_compat`` finds it):
blocks = memory / (page x L). With the dynamic buffer only S layer buffers live
on the device, so the plan is made for L/S times the memory (L/S times the
blocks) and every layer is then placed on buffer ``l % S``, in the form this
vLLM's runners allocate (``vllm_compat.buffer_plan_form``): from vLLM 0.29 one
``KVCacheTensor`` per layer at offset ``(l % S) x region`` of one ``S x region``
allocation; on 0.23-0.28 S tensors, buffer ``b``'s ``shared_by`` naming the
layers ``l % S == b`` (vllm-ascend's runner gives those layers one ``(k, v)``
pair). Either way the device holds exactly the memory vLLM measured; the worker
(``buffer/layer_buffer.py``) streams each layer's blocks in from host memory
before it runs and writes new K/V back before the buffer is reused.

With ``dynamic_buffer_resident_blocks`` (P), each buffer also holds P private
blocks for every layer placed on it (``private_blocks``), and the scheduler's
block pool is that many blocks smaller, so vLLM never hands them out
(``buffer/residency.py`` does). ``patch_planner`` is called by the
``vllm_aio_buffer_plan`` plugin (``registration.register_buffer_plan``) in each vLLM
process before the KV cache is planned; it changes nothing unless the AioConnector
runs with the dynamic buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_aio import vllm_compat
from vllm_aio.buffer.residency import private_blocks
from vllm_aio.config import AioConfig, TransferMode
from vllm_aio.errors import ConfigError
from vllm_aio.log import get_logger
from vllm_aio.shared.graph_mode import refuse_full_graphs

logger = get_logger(__name__)


def patch_planner(aio_config: Callable[[Any], AioConfig | None]) -> None:
    """Patch vLLM's planner to plan for the buffer where ``aio_config(vllm_config)`` (the AioConnector's
    config, None where another connector runs: ``registration.aio_config``) turns it on. A no-op where
    an internal it needs is missing: the worker refuses the buffer at start then, naming it
    (``vllm_compat.require_buffer_internals``)."""
    vllm_compat.patch_kv_cache_planner(lambda original: _planner(original, aio_config), _scheduler_view)


def _planner(original: Callable, aio_config: Callable[[Any], AioConfig | None]) -> Callable:
    # ``more``: what else this vLLM's planner takes (0.33: the model's KV cache groups, made from the
    # specs alone, not the memory), handed on unchanged.
    def plan(vllm_config, kv_cache_specs, available_memory, *more):
        cfg = aio_config(vllm_config)
        buffers = buffer_count(cfg)
        if not buffers:
            return original(vllm_config, kv_cache_specs, available_memory, *more)
        refuse_unsupported(vllm_config)
        num_layers = max(len(specs) for specs in kv_cache_specs)
        if buffers >= num_layers:
            raise ConfigError(
                f"dynamic_buffer_count: {buffers} buffers for a model of {num_layers} layers saves nothing; "
                f"use 2..{num_layers - 1}"
            )
        scaled = [memory * num_layers // buffers for memory in available_memory]
        configs = [alias_layers(c, buffers) for c in original(vllm_config, kv_cache_specs, scaled, *more)]
        private = private_blocks(num_layers, buffers, cfg.dynamic_buffer_resident_blocks)
        for config in configs:
            reserve_private(config, private)
        logger.info(
            "vllm_aio: dynamic buffer: %d layers on %d device buffers, %d blocks (%.1fx the device-resident "
            "count); host memory holds every layer%s",
            num_layers,
            buffers,
            configs[0].num_blocks - private,
            num_layers / buffers,
            f"; {private} private blocks per buffer keep high-priority requests resident" if private else "",
        )
        return configs

    return plan


def _scheduler_view(original: Callable) -> Callable:
    def scheduler_view(kv_cache_configs):
        config = original(kv_cache_configs)
        config.num_blocks -= vllm_compat.private_blocks_of(kv_cache_configs[0])
        return config

    return scheduler_view


def buffer_count(cfg: AioConfig | None) -> int:
    """S from the AioConnector's config; 0 when off or another connector runs (``cfg`` None)."""
    if cfg is None or cfg.transfer_mode is not TransferMode.DYNAMIC_BUFFER:
        return 0
    return cfg.dynamic_buffer_count


def reserve_private(config: Any, private: int) -> None:
    """Keep ``private`` blocks of the workers' plan out of the scheduler's pool (``scheduler_view``)."""
    if private and private >= config.num_blocks // 2:
        raise ConfigError(
            f"dynamic_buffer_resident_blocks: {private} private blocks per buffer leave "
            f"{config.num_blocks - private} of {config.num_blocks} for the streamed requests; use fewer"
        )
    vllm_compat.set_private_blocks(config, private)


def refuse_unsupported(vllm_config: Any) -> None:
    """Features that run layers out of order or skip the per-layer hooks, and runners that cannot alias."""
    refuse_full_graphs(TransferMode.DYNAMIC_BUFFER, vllm_config)
    if vllm_compat.buffer_plan_form() == vllm_compat.LAYERS_FORM and vllm_compat.device_type() == "npu":
        raise ConfigError(
            f"transfer_mode dynamic_buffer: vllm-ascend on vLLM {vllm_compat.vllm_version()} allocates every "
            "layer's KV apart (the layers/layer_stride plan), so layers cannot share a buffer; it works on "
            "vllm-ascend with vLLM 0.23-0.28 (shared_by plans)"
        )
    if (speculative := vllm_config.speculative_config) is not None:
        raise ConfigError(
            f"transfer_mode dynamic_buffer: speculative decoding ({getattr(speculative, 'method', None) or 'a draft'}) "
            "is not supported (its verification steps and draft layers run outside the buffer's layer ring); "
            "use whole_blocks, layerwise or async with it"
        )
    if getattr(vllm_config.parallel_config, "enable_dbo", False):
        raise ConfigError("transfer_mode dynamic_buffer: micro-batching (enable_dbo) is not supported")


def alias_layers(config: Any, buffers: int) -> Any:
    """Put layer ``l`` of a one-group plan on buffer ``l % buffers``, in this vLLM's form."""
    if len(config.kv_cache_groups) != 1:
        raise ConfigError(
            f"transfer_mode dynamic_buffer: hybrid models are not supported ({len(config.kv_cache_groups)} KV cache "
            "groups): vLLM overlays the groups' layers in shared tensors, and the buffer's layer ring would have "
            "to stream the layers of every group that owns a block of the step; run it without the buffer"
        )
    if vllm_compat.buffer_plan_form() == vllm_compat.SHARED_BY_FORM:
        return _shared_by(config, buffers)
    return _at_offsets(config, buffers)


def _at_offsets(config: Any, buffers: int) -> Any:
    """vLLM 0.29+: the single layer-outermost tensor's layers at offsets of one ``buffers x region`` allocation."""
    if len(config.kv_cache_tensors) != 1:
        raise ConfigError(
            "transfer_mode dynamic_buffer: needs a model with one KV cache group of one layer shape "
            f"(got {len(config.kv_cache_tensors)} tensors)"
        )
    (tensor,) = config.kv_cache_tensors
    region = tensor.layer_stride
    if tensor.offset != 0 or tensor.block_stride * config.num_blocks > region:
        raise ConfigError(
            "transfer_mode dynamic_buffer: needs a layer-outermost KV cache layout (each layer one region); "
            "set VLLM_KV_CACHE_LAYOUT to a layer-outermost layout"
        )
    layers = [
        vllm_compat.kv_cache_tensor(buffers * region, name, region, tensor.block_stride, (i % buffers) * region)
        for i, name in enumerate(tensor.layers)
    ]
    return vllm_compat.with_kv_cache_tensors(config, layers)


def _shared_by(config: Any, buffers: int) -> Any:
    """vLLM 0.23-0.28: one tensor a layer becomes ``buffers`` tensors, each shared by every
    ``buffers``-th layer (packed layouts, 0.26+'s non-zero ``block_stride``, are left out)."""
    tensors = config.kv_cache_tensors
    if any(len(t.shared_by) != 1 or getattr(t, "block_stride", 0) or getattr(t, "offset", 0) for t in tensors):
        raise ConfigError(
            "transfer_mode dynamic_buffer: needs a plan of one KV cache tensor per layer (got a packed or shared "
            "layout); run it without the buffer"
        )
    if len({t.size for t in tensors}) != 1:
        raise ConfigError(
            "transfer_mode dynamic_buffer: needs a model with one KV cache group of one layer shape "
            f"(got layer tensors of {len({t.size for t in tensors})} sizes)"
        )
    names = list(config.kv_cache_groups[0].layer_names)  # the forward's order, as the worker's layer index
    if sorted(names) != sorted(t.shared_by[0] for t in tensors):
        raise ConfigError("transfer_mode dynamic_buffer: the plan's tensors are not the KV cache group's layers")
    shared = [vllm_compat.shared_kv_cache_tensor(tensors[0].size, names[b::buffers]) for b in range(buffers)]
    return vllm_compat.with_kv_cache_tensors(config, shared)
