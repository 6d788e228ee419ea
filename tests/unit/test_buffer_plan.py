"""``vllm_aio.buffer.plan``: vLLM's KV cache plan re-laid for the dynamic buffer (real vLLM types)."""

from __future__ import annotations

import dataclasses
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from harness.prerequisites import require
from vllm_aio.errors import ConfigError


@pytest.fixture(scope="module")
def kv():
    require("vllm")
    from vllm.v1 import kv_cache_interface

    return kv_cache_interface


def _config(kv, layers: int, num_blocks: int = 10, page: int = 4096):
    """A one-group plan in the installed vLLM's form, as its planner makes it: one tensor of every
    layer at ``layer_stride`` (0.29+), or one tensor a layer (0.23-0.28)."""
    spec = kv.FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    names = [f"layer.{i}" for i in range(layers)]
    if _shared_by_form():
        tensors = [kv.KVCacheTensor(size=num_blocks * page, shared_by=[name]) for name in names]
    else:
        tensors = [kv.KVCacheTensor(size=layers * num_blocks * page, layers=names, layer_stride=num_blocks * page,
                                    block_stride=page)]
    return kv.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                            kv_cache_groups=[kv.KVCacheGroupSpec(names, spec)])


def _shared_by_form() -> bool:
    from vllm_aio import vllm_compat

    return vllm_compat.buffer_plan_form() == vllm_compat.SHARED_BY_FORM


def _placement(config) -> list[tuple[int, list[str], int]]:
    """(bytes, layers, offset) of each tensor of a plan of either form."""
    return [(t.size, list(getattr(t, "shared_by", None) or t.layers), getattr(t, "offset", 0))
            for t in config.kv_cache_tensors]


def test_layers_are_placed_round_robin_on_the_buffers(kv):
    from vllm_aio.buffer.plan import alias_layers

    planned = alias_layers(_config(kv, layers=5), buffers=2)
    region = 10 * 4096
    if _shared_by_form():  # two tensors of one region, each shared by every other layer
        assert _placement(planned) == [(region, ["layer.0", "layer.2", "layer.4"], 0),
                                       (region, ["layer.1", "layer.3"], 0)]
    else:  # one backing allocation of two regions, each layer at its buffer's
        assert _placement(planned) == [(2 * region, [f"layer.{i}"], (i % 2) * region) for i in range(5)]


def test_private_blocks_stay_out_of_the_schedulers_pool(kv):
    from vllm.v1.core import kv_cache_utils

    from vllm_aio.buffer.plan import reserve_private
    from vllm_aio.buffer.residency import private_blocks
    from vllm_aio.registration import register_buffer_plan

    register_buffer_plan()
    config = _config(kv, layers=5, num_blocks=40)
    private = private_blocks(5, 2, resident=4)  # layers 0, 2, 4 share buffer 0: 3 passes x 4 blocks
    reserve_private(config, private)
    assert private == 12
    assert kv_cache_utils.generate_scheduler_kv_cache_config([config]).num_blocks == 28
    assert config.num_blocks == 40  # the workers' views cover the private blocks


def test_private_blocks_that_leave_too_few_for_vllm_are_refused(kv):
    from vllm_aio.buffer.plan import reserve_private

    with pytest.raises(ConfigError,
                       match="dynamic_buffer_resident_blocks: 20 private blocks per buffer leave 20 of 40"):
        reserve_private(_config(kv, layers=4, num_blocks=40), 20)


def test_a_plan_whose_layers_do_not_each_own_a_region_is_refused(kv):
    """0.29+: a block-outermost layout (each block a slab of every layer); 0.23-0.28: a tensor
    already shared by several layers (packed)."""
    from vllm_aio.buffer.plan import alias_layers

    config = _config(kv, layers=4)
    if _shared_by_form():
        first, second, *rest = config.kv_cache_tensors
        config.kv_cache_tensors = [kv.KVCacheTensor(size=first.size, shared_by=first.shared_by + second.shared_by),
                                   *rest]
        message = "one KV cache tensor per layer"
    else:
        (t,) = config.kv_cache_tensors
        config.kv_cache_tensors = [kv.KVCacheTensor(size=t.size, layers=t.layers, layer_stride=4096,
                                                    block_stride=4 * 4096)]
        message = "layer-outermost"
    with pytest.raises(ConfigError, match=message):
        alias_layers(config, 2)


def test_layers_of_different_sizes_are_refused_in_the_shared_by_form(kv, monkeypatch):
    """0.23-0.28 plan layers of one type but different hidden sizes as tensors of their own sizes."""
    from vllm_aio import vllm_compat
    from vllm_aio.buffer import plan

    monkeypatch.setattr(vllm_compat, "buffer_plan_form", lambda: vllm_compat.SHARED_BY_FORM)
    names = ["layer.0", "layer.1", "layer.2"]
    tensors = [SimpleNamespace(size=size, shared_by=[n]) for n, size in zip(names, (4096, 8192, 4096))]
    config = SimpleNamespace(num_blocks=1, kv_cache_tensors=tensors,
                             kv_cache_groups=[SimpleNamespace(layer_names=names)])
    with pytest.raises(ConfigError, match="one layer shape .got layer tensors of 2 sizes."):
        plan.alias_layers(config, 2)


def test_vllm_ascend_on_a_vllm_that_allocates_each_layer_apart_is_refused_naming_the_versions_that_work(
        monkeypatch):
    from vllm_aio import vllm_compat
    from vllm_aio.buffer.plan import refuse_unsupported

    monkeypatch.setattr(vllm_compat, "buffer_plan_form", lambda: vllm_compat.LAYERS_FORM)
    monkeypatch.setattr(vllm_compat, "device_type", lambda: "npu")
    monkeypatch.setattr(vllm_compat, "vllm_version", lambda: "0.29.0")
    config = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=None), speculative_config=None,
                             parallel_config=SimpleNamespace(enable_dbo=False))
    with pytest.raises(ConfigError, match=r"vllm-ascend on vLLM 0\.29\.0 allocates every layer's KV apart .*"
                                          r"vllm-ascend with vLLM 0\.23-0\.28"):
        refuse_unsupported(config)
    monkeypatch.setattr(vllm_compat, "buffer_plan_form", lambda: vllm_compat.SHARED_BY_FORM)
    refuse_unsupported(config)


def test_a_hybrid_model_is_refused_with_the_reason(kv):
    from vllm_aio.buffer.plan import alias_layers

    config = _config(kv, layers=4)
    full, sliding = config.kv_cache_groups[0].kv_cache_spec, kv.SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, sliding_window=64)
    config.kv_cache_groups = [kv.KVCacheGroupSpec(["layer.0", "layer.2"], sliding),
                              kv.KVCacheGroupSpec(["layer.1", "layer.3"], full)]
    with pytest.raises(ConfigError, match="hybrid models are not supported .2 KV cache groups.: vLLM overlays"):
        alias_layers(config, 2)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"speculative_config": object()}, "speculative decoding"),
        ({"parallel_config": SimpleNamespace(enable_dbo=True)}, "micro-batching"),
        ({"compilation_config": SimpleNamespace(cudagraph_mode=SimpleNamespace(
            name="FULL", has_full_cudagraphs=lambda: True))}, "cudagraph_mode FULL"),
    ],
)
def test_features_that_break_the_layer_order_are_refused(change, message):
    from vllm_aio.buffer.plan import refuse_unsupported

    config = {
        "compilation_config": SimpleNamespace(cudagraph_mode=None),
        "speculative_config": None,
        "parallel_config": SimpleNamespace(enable_dbo=False),
    }
    with pytest.raises(ConfigError, match=message):
        refuse_unsupported(SimpleNamespace(**{**config, **change}))


def test_other_connectors_leave_the_plan_alone():
    from vllm_aio.buffer.plan import buffer_count
    from vllm_aio.registration import aio_config

    extra = {"transfer_mode": "dynamic_buffer", "dynamic_buffer_count": 2}
    other = SimpleNamespace(kv_connector="ExampleConnector", kv_connector_module_path=None,
                            kv_connector_extra_config=extra)
    by_path = SimpleNamespace(kv_connector="AioConnector", kv_connector_module_path="vllm_aio.connector",
                              kv_connector_extra_config=extra)
    by_name = SimpleNamespace(kv_connector="AioConnector", kv_connector_module_path=None,
                              kv_connector_extra_config=extra)
    assert buffer_count(aio_config(SimpleNamespace(kv_transfer_config=other))) == 0
    assert buffer_count(aio_config(SimpleNamespace(kv_transfer_config=by_path))) == 2
    assert buffer_count(aio_config(SimpleNamespace(kv_transfer_config=by_name))) == 2
    assert buffer_count(aio_config(SimpleNamespace(kv_transfer_config=None))) == 0


def _module(name: str, **functions) -> ModuleType:
    module = ModuleType(name)
    vars(module).update(functions)
    return module


def test_a_planner_in_kv_cache_planning_is_wrapped_and_handed_its_further_parameters(kv, monkeypatch):
    """vLLM 0.33's layout: the planner in ``kv_cache_planning`` with the model's KV cache groups
    as a fourth parameter, the scheduler view left in ``kv_cache_utils``, both imported by the engine core."""
    from vllm_aio.buffer.plan import alias_layers
    from vllm_aio.registration import register_buffer_plan

    calls = []

    def planner(vllm_config, kv_cache_specs, available_memory, global_kv_cache_groups):
        calls.append((available_memory, global_kv_cache_groups))
        return [_config(kv, layers=4, num_blocks=40)]

    def scheduler_view(kv_cache_configs):
        return dataclasses.replace(kv_cache_configs[0])

    planning = _module("vllm.v1.core.kv_cache_planning", get_kv_cache_configs=planner)
    utils = _module("vllm.v1.core.kv_cache_utils", generate_scheduler_kv_cache_config=scheduler_view)
    core = _module("vllm.v1.engine.core", get_kv_cache_configs=planner,
                   generate_scheduler_kv_cache_config=scheduler_view)
    for module in (planning, utils, core):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    register_buffer_plan()
    assert core.get_kv_cache_configs is planning.get_kv_cache_configs is not planner
    assert core.generate_scheduler_kv_cache_config is utils.generate_scheduler_kv_cache_config

    extra = {"transfer_mode": "dynamic_buffer", "dynamic_buffer_count": 2}
    buffered = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector="AioConnector", kv_connector_module_path=None,
                                           kv_connector_extra_config=extra),
        compilation_config=SimpleNamespace(cudagraph_mode=None), speculative_config=None,
        parallel_config=SimpleNamespace(enable_dbo=False),
    )
    specs = [{f"layer.{i}": None for i in range(4)}]
    (config,) = core.get_kv_cache_configs(buffered, specs, [1000], "groups")
    assert calls == [([2000], "groups")]  # 4 layers on 2 buffers: twice the memory, the groups as they came
    assert _placement(config) == _placement(alias_layers(_config(kv, layers=4, num_blocks=40), 2))  # aliased
    other = SimpleNamespace(kv_transfer_config=None)
    core.get_kv_cache_configs(other, specs, [1000], "groups")
    assert calls[-1] == ([1000], "groups")
