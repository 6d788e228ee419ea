"""The vLLM internals that moved between the versions this package runs on (0.23 through 0.33), and
the vLLM internals the package reads (parallel ranks, the platform, attention layers) or the dynamic
buffer patches. Every seam detects the feature itself, never a version string; what only a newer
vLLM can do refuses at start (``require``), naming the setting and the version it needs. No torch
here: the scheduler half imports this module (seams import torch, vLLM and Triton only when
called). What differs between versions, and what each seam does: ``docs/architecture.md``,
"vLLM versions".
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from collections.abc import Callable, Iterable
from typing import Any

from vllm_aio.errors import ConfigError

NEWEST = "0.32"  # what the seams below that refuse need (per-request load failures, hybrid models)


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


def records_kv_cache_layout(kv_cache_config: Any) -> bool:
    """Whether the KV cache config records its layout (0.32), the same in every process."""
    return hasattr(kv_cache_config, "kv_cache_layout")


def kv_cache_layout(kv_cache_config: Any, vllm_config: Any) -> str:
    """The KV cache layout: 0.32 records it on the config; older versions derive it per process from
    the current config and the attention backend the process chose. The scheduler's process chose
    none, so it takes the workers' answer at start (``WorkerFacts``, through vLLM's handshake)."""
    if records_kv_cache_layout(kv_cache_config):
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


# The two forms of a plan in which layers share device memory (``buffer_plan_form``).
LAYERS_FORM = "layers"  # 0.29+: ``KVCacheTensor(size, layers, layer_stride, block_stride, offset)``
SHARED_BY_FORM = "shared_by"  # 0.23-0.28: ``KVCacheTensor(size, shared_by)``, one tensor for the layers named


def buffer_plan_form() -> str | None:
    """How this vLLM's plan lets layers share device memory; None where neither form exists."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    fields = _fields(KVCacheTensor)
    if {"size", "layers", "layer_stride", "block_stride", "offset"} <= fields:
        return LAYERS_FORM
    return SHARED_BY_FORM if {"size", "shared_by"} <= fields else None


def device_type() -> str:
    """The device type of vLLM's platform (``"npu"`` under vllm-ascend)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def on_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def parallel_ranks() -> dict[str, int]:
    """This worker's rank in each of vLLM's parallel groups (tensor, pipeline, prefill and decode context)."""
    from vllm.distributed import parallel_state as ps

    return {
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pp_group().rank_in_group,
        "pcp_rank": ps.get_pcp_group().rank_in_group,
        "dcp_rank": ps.get_dcp_group().rank_in_group,
    }


def attention_isas(vllm_config: Any, layer_names: Iterable[str]) -> list[str]:
    """The kernels vLLM's CPU attention chose for ``layer_names`` (its metadata builders set ``isa`` on
    each layer before the KV cache is registered), sorted; ``["none"]`` where no layer says."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    layers = get_layers_from_vllm_config(vllm_config, Attention, list(layer_names))
    return sorted({str(getattr(layer, "isa", "unknown")) for layer in layers.values()}) or ["none"]


def kv_cache_block_copies(scheduler_output: Any) -> list[Any]:
    """Blocks vLLM copies within the cache this step (0.23 has no such copies)."""
    return list(getattr(scheduler_output, "kv_cache_block_copies", None) or [])


# ---- the dynamic buffer's reach into vLLM and Triton ---------------------------------------------
# The KV cache planner: in ``kv_cache_planning`` from 0.33 (with the model's KV cache groups as a fourth
# parameter, made from the specs alone), in ``kv_cache_utils`` before; its scheduler view stayed there.
_PLANNER_MODULES = ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils")
_PLANNER = "get_kv_cache_configs"  # (vllm_config, kv_cache_specs, available_memory, ...) -> [KVCacheConfig]
_PLANNER_PARAMS = ("vllm_config", "kv_cache_specs", "available_memory")  # what the buffer's plan reads first
_SCHEDULER_VIEW_MODULE = "vllm.v1.core.kv_cache_utils"
_SCHEDULER_VIEW = "generate_scheduler_kv_cache_config"  # ([KVCacheConfig]) -> KVCacheConfig
_ENGINE_CORE = "vllm.v1.engine.core"  # imports both by name
_CONFIG_FIELDS = {"num_blocks", "kv_cache_tensors", "kv_cache_groups"}
# Written onto the workers' plans: the blocks per buffer kept out of the scheduler's pool.
_PRIVATE_ATTR = "vllm_aio_private_blocks"
_PATCHED = "__wrapped_by_vllm_aio__"
# The attention backends whose metadata's ``block_table`` and slot mapping are what their kernels read.
REMAPPABLE_BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN")


def _planner_module() -> Any:
    """The module that defines this vLLM's KV cache planner; None where neither does."""
    for name in _PLANNER_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the module is there and something it imports is not
                raise
            continue
        if callable(getattr(module, _PLANNER, None)):
            return module
    return None


def _planner_missing() -> list[str]:
    """What of the planner's place and leading parameters this vLLM lacks (none: it can be wrapped)."""
    module = _planner_module()
    if module is None:
        return [" or ".join(f"{name}.{_PLANNER}" for name in _PLANNER_MODULES)]
    params = tuple(inspect.signature(getattr(module, _PLANNER)).parameters)[:len(_PLANNER_PARAMS)]
    if params != _PLANNER_PARAMS:
        return [f"{module.__name__}.{_PLANNER}({', '.join(_PLANNER_PARAMS)}, ...) (it takes {', '.join(params)})"]
    return []


def buffer_internals_missing() -> list[str]:
    """The vLLM internals the dynamic buffer patches or reads that this vLLM lacks (none: it can run)."""
    try:
        missing = _planner_missing()
        utils = importlib.import_module(_SCHEDULER_VIEW_MODULE)
        from vllm.v1.kv_cache_interface import KVCacheConfig
    except ImportError as exc:
        return [f"{exc.name} (import)"]
    if not callable(getattr(utils, _SCHEDULER_VIEW, None)):
        missing.append(f"{_SCHEDULER_VIEW_MODULE}.{_SCHEDULER_VIEW}")
    if buffer_plan_form() is None:
        missing.append("KVCacheTensor.shared_by (0.23-0.28) or KVCacheTensor.layers and layer_stride (0.29+)")
    missing += [f"KVCacheConfig.{name}" for name in sorted(_CONFIG_FIELDS - _fields(KVCacheConfig))]
    return missing


def require_buffer_internals(setting: str) -> None:
    """Refuse ``setting`` at start where this vLLM lacks an internal the buffer needs, naming it."""
    missing = buffer_internals_missing()
    if missing:
        raise ConfigError(
            f"{setting}: the dynamic buffer needs vLLM internals this vLLM {vllm_version()} lacks: "
            f"{', '.join(missing)} (vllm_aio/vllm_compat.py is where they are adapted)"
        )


def patch_kv_cache_planner(wrap_planner: Callable[[Callable], Callable],
                           wrap_scheduler_view: Callable[[Callable], Callable]) -> bool:
    """Replace vLLM's KV cache planner and its scheduler view with ``wrap_*(original)``, where vLLM
    defines them and in the engine core's copies where it is imported already. ``wrap_planner``'s
    result is called as vLLM calls the planner: the parameters of ``_PLANNER_PARAMS`` first, then
    whatever else this vLLM passes (to hand on unchanged). Once per process (vLLM may load plugins
    again); False, patching nothing, where an internal is missing (the buffer refuses to start then,
    ``require_buffer_internals``)."""
    if buffer_internals_missing():
        return False
    targets = ((_planner_module(), _PLANNER, wrap_planner),
               (importlib.import_module(_SCHEDULER_VIEW_MODULE), _SCHEDULER_VIEW, wrap_scheduler_view))
    if getattr(getattr(targets[0][0], _PLANNER), _PATCHED, False):
        return True
    for module, name, wrap in targets:
        patched = wrap(getattr(module, name))
        setattr(patched, _PATCHED, True)
        setattr(module, name, patched)
        core = sys.modules.get(_ENGINE_CORE)
        if core is not None and hasattr(core, name):
            setattr(core, name, patched)
    return True


def kv_cache_tensor(size: int, layer: str, layer_stride: int, block_stride: int, offset: int) -> Any:
    """One layer's ``KVCacheTensor`` at ``offset`` of a backing allocation of ``size`` bytes (0.29+)."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    return KVCacheTensor(size=size, layers=[layer], layer_stride=layer_stride, block_stride=block_stride,
                         offset=offset)


def shared_kv_cache_tensor(size: int, layers: list[str]) -> Any:
    """One tensor of ``size`` bytes that every layer of ``layers`` uses (0.23-0.28)."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    return KVCacheTensor(size=size, shared_by=layers)


def with_kv_cache_tensors(kv_cache_config: Any, tensors: list[Any]) -> Any:
    return dataclasses.replace(kv_cache_config, kv_cache_tensors=tensors)


def set_private_blocks(kv_cache_config: Any, blocks: int) -> None:
    """Record on a worker's plan the blocks per buffer the scheduler's pool must not hand out."""
    setattr(kv_cache_config, _PRIVATE_ATTR, blocks)


def private_blocks_of(kv_cache_config: Any) -> int:
    return int(getattr(kv_cache_config, _PRIVATE_ATTR, 0))


def attention_backends(vllm_config: Any, layer_names: Iterable[str]) -> dict[str, str]:
    """The attention backend's name of each attention layer of ``layer_names``."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    layers = get_layers_from_vllm_config(vllm_config, Attention, list(layer_names))
    return {name: layer.get_attn_backend().get_name() for name, layer in layers.items()}


def block_tables(forward_context: Any, layer_names: Iterable[str]) -> list[tuple[Any, bool]] | None:
    """The distinct tensors of the forward's attention metadata that name blocks, each with whether
    it names token slots (a slot mapping) rather than block ids (a block table); None in a step
    without attention metadata (vLLM's steps that schedule no tokens read no table)."""
    import torch

    if forward_context is None or not isinstance(forward_context.attn_metadata, dict):
        return None
    metadata, slots = forward_context.attn_metadata, forward_context.slot_mapping
    found: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, bool]] = {}
    seen: set[tuple[int, int]] = set()  # the layers of a group share their metadata: look once
    for name in layer_names:
        meta = metadata[name]
        layer_slots = slots.get(name) if isinstance(slots, dict) else None
        if (id(meta), id(layer_slots)) in seen:
            continue
        seen.add((id(meta), id(layer_slots)))
        table = getattr(meta, "block_table", None)
        if not isinstance(table, torch.Tensor):
            raise RuntimeError(
                f"dynamic_buffer_resident_blocks: the {type(meta).__name__} attention metadata names no "
                "block_table to point at the private blocks; run without resident blocks"
            )
        for tensor, is_slots in ((table, False), (getattr(meta, "slot_mapping", None), True), (layer_slots, True)):
            if isinstance(tensor, torch.Tensor):
                found.setdefault((tensor.data_ptr(), tuple(tensor.shape)), (tensor, is_slots))
    return list(found.values())


# Triton's launcher: a compiled kernel (``JITFunction.warmup``) launched again with its arguments
# as integers skips the binding and specialization Triton's own launch repeats on every call.
_TRITON_LAUNCHER = (3, 2)  # from this version a compiled kernel's launcher takes every argument


def triton_launcher_missing() -> str | None:
    """What of Triton's launcher ABI this Triton lacks, or None."""
    import triton
    from triton.compiler import CompiledKernel

    version = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    if version < _TRITON_LAUNCHER:
        return f"Triton {triton.__version__}: a compiled kernel's launcher taking constexprs needs Triton 3.2"
    absent = [name for name in ("run", "__getitem__") if not hasattr(CompiledKernel, name)]
    return f"Triton {triton.__version__}: CompiledKernel lacks {', '.join(absent)}" if absent else None


def require_triton_launcher(setting: str) -> None:
    missing = triton_launcher_missing()
    if missing:
        raise ConfigError(f"{setting}: the swap kernel's launch needs Triton's launcher ABI ({missing}); "
                          "vllm_aio/vllm_compat.py is where it is adapted")


def compile_kernel(kernel: Any, grid: tuple[int, int, int], args: tuple, num_warps: int) -> Any:
    """``kernel`` compiled for ``args``' types (tensors where they are pointers)."""
    return kernel.warmup(*args, grid=grid, num_warps=num_warps)


def first_launch(compiled: Any, grid: tuple[int, int, int], stream: int, args: tuple) -> None:
    """The compiled kernel's first launch, through Triton (which also loads it onto the device)."""
    compiled[grid](*args, stream=stream)


def launch(compiled: Any, grid: tuple[int, int, int], stream: int, args: tuple) -> None:
    """A loaded compiled kernel launched with ``args`` as they are (integers for pointers), no hooks."""
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)
