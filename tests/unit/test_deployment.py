"""Deployment.block_size against vLLM's own request hasher and KV cache manager.

The scheduler half indexes ``request.block_hashes`` and the block ids vLLM
allocates with one block size; under decode context parallelism vLLM scales
both by DCP (and neither by PCP), so the same must hold for the deployment.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.prerequisites import require
from vllm_aio.pool.entry import HEADER_BYTES

BLOCK = 16  # the attention backend's block size
PROMPT_TOKENS = 200


@pytest.fixture(autouse=True)
def _vllm() -> None:
    require("vllm")


def _vllm_config(dcp: int, pcp: int) -> SimpleNamespace:
    import torch

    return SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=BLOCK, prefix_caching_hash_algo="sha256", cache_dtype="auto",
            prefix_match_unit=None, enable_prefix_caching=False,
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=2, pipeline_parallel_size=1,
            prefill_context_parallel_size=pcp, decode_context_parallel_size=dcp,
        ),
        model_config=SimpleNamespace(model="m", dtype=torch.bfloat16, use_mla=False, get_total_num_kv_heads=lambda: 1),
        kv_transfer_config=SimpleNamespace(kv_role="kv_both", engine_id="e"),
        kv_events_config=None,
    )


def _kv_cache_config(vllm_config: SimpleNamespace, dcp_sharded: bool = True):
    """One full-attention group, with hash_block_size resolved as vLLM's engine core does."""
    import torch
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16,
                             dcp_sharded=dcp_sharded)
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    _, config.hash_block_size = resolve_kv_cache_block_sizes(config, vllm_config)
    return config


def _hashes_and_block_ids(vllm_config: SimpleNamespace, kv_cache_config) -> tuple[int, int]:
    """How many block hashes and block ids vLLM gives one PROMPT_TOKENS request."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    request = Request("r", list(range(3, 3 + PROMPT_TOKENS)), SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(hash_block_size, hash_fn))
    manager = KVCacheManager(
        kv_cache_config, max_model_len=4096, scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size, enable_caching=False,
        dcp_world_size=vllm_config.parallel_config.decode_context_parallel_size,
        pcp_world_size=1,  # what vLLM 0.32's Scheduler passes, whatever the PCP size
    )
    blocks = manager.allocate_slots(request, PROMPT_TOKENS)
    return len(request.block_hashes), len(blocks.get_block_ids()[0])


def _deployment(vllm_config: SimpleNamespace, kv_cache_config):
    from vllm_aio.config import AioConfig
    from vllm_aio.shared.deployment import build_deployment

    return build_deployment(vllm_config, kv_cache_config, AioConfig())


@pytest.mark.parametrize(("dcp", "pcp"), [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4)])
def test_block_size_spans_the_tokens_of_one_block_hash_and_one_block_id(dcp: int, pcp: int) -> None:
    vllm_config = _vllm_config(dcp, pcp)
    kv_cache_config = _kv_cache_config(vllm_config)
    block_size = _deployment(vllm_config, kv_cache_config).block_size
    assert block_size == BLOCK * dcp
    num_hashes, num_block_ids = _hashes_and_block_ids(vllm_config, kv_cache_config)
    assert num_hashes == PROMPT_TOKENS // block_size
    assert num_block_ids == -(-PROMPT_TOKENS // block_size)


def test_block_size_of_a_cache_dcp_does_not_shard_is_not_scaled() -> None:
    vllm_config = _vllm_config(dcp=2, pcp=1)
    kv_cache_config = _kv_cache_config(vllm_config, dcp_sharded=False)
    assert _deployment(vllm_config, kv_cache_config).block_size == BLOCK
    assert _hashes_and_block_ids(vllm_config, kv_cache_config) == (PROMPT_TOKENS // BLOCK, -(-PROMPT_TOKENS // BLOCK))


def test_hashes_coarser_or_finer_than_block_ids_are_refused() -> None:
    from vllm_aio.errors import ConfigError

    vllm_config = _vllm_config(dcp=2, pcp=1)
    kv_cache_config = _kv_cache_config(vllm_config)
    kv_cache_config.hash_block_size = BLOCK
    with pytest.raises(ConfigError, match="hashes blocks of 16 tokens but its block ids cover 32"):
        _deployment(vllm_config, kv_cache_config)


def _groups_config(*specs, layers_per_group: int = 2):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [
        KVCacheGroupSpec([f"layers.{g + len(specs) * i}" for i in range(layers_per_group)], spec)
        for g, spec in enumerate(specs)
    ]
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    config.hash_block_size = BLOCK
    return config


def _attention(window: int | None = None):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    common = dict(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    return FullAttentionSpec(**common) if window is None else SlidingWindowSpec(**common, sliding_window=window)


def _hybrid(**options):
    from vllm_aio.config import AioConfig
    from vllm_aio.shared.deployment import build_deployment

    vllm_config = _vllm_config(dcp=1, pcp=1)
    vllm_config.kv_events_config = options.pop("kv_events_config", None)  # vLLM's own config, not the connector's
    return build_deployment(vllm_config, _groups_config(_attention(64), _attention()), AioConfig(**options))


def test_a_sliding_window_group_is_kept_with_its_window() -> None:
    vllm_config = _vllm_config(dcp=1, pcp=1)
    (group,) = _deployment(vllm_config, _groups_config(_attention(64))).groups
    assert group.window == 64
    # vLLM frees a block once the next token's window has passed it.
    assert [group.first_held_block(t, BLOCK) for t in (0, 63, 64, 79, 80, 300)] == [0, 0, 0, 1, 1, 14]


def test_a_hybrid_model_keeps_its_groups_and_reads_blocks_through_group_0s_layers() -> None:
    dep = _hybrid()
    assert dep.hybrid and [g.window for g in dep.groups] == [64, None]
    assert dep.layer_names == ("layers.0", "layers.2")
    assert dep.value_bytes == HEADER_BYTES + 2 * _attention().page_size_bytes


def test_a_hybrid_model_has_a_namespace_of_its_own() -> None:
    # The same model with vLLM's hybrid manager off is one group of every layer:
    # other bytes per block, so other keys.
    one_group = _deployment(_vllm_config(dcp=1, pcp=1), _groups_config(_attention(), layers_per_group=4))
    assert _hybrid().namespace.digest() != one_group.namespace.digest()


def test_a_hybrid_model_loads_in_the_background() -> None:
    # vLLM 0.32 takes a failed load of several groups per request, for background loads only.
    from vllm_aio.config import TransferMode

    assert _hybrid(transfer_mode="whole_blocks").transfer_mode is TransferMode.ASYNC


@pytest.mark.parametrize(
    ("option", "reason"),
    [
        ({"transfer_mode": "layerwise"}, "transfer_mode layerwise is not supported with a hybrid model"),
        ({"transfer_mode": "dynamic_buffer"},
         "transfer_mode dynamic_buffer is not supported with a hybrid model.*one group"),
        ({"migration": True}, "migration is not supported with a hybrid model"),
        ({"kv_events_config": SimpleNamespace(enable_kv_cache_events=True)}, "kv_events_config is not supported"),
    ],
)
def test_features_naming_one_groups_blocks_are_refused_for_a_hybrid_model(option, reason) -> None:
    from vllm_aio.errors import ConfigError

    with pytest.raises(ConfigError, match=reason):
        _hybrid(**option)


@pytest.mark.parametrize(("option", "config"), [("transfer_mode dynamic_buffer", {"transfer_mode": "dynamic_buffer"}),
                                                ("migration", {"migration": True})])
def test_features_naming_every_block_are_refused_with_a_sliding_window(option, config) -> None:
    from vllm_aio.config import AioConfig
    from vllm_aio.errors import ConfigError
    from vllm_aio.shared.deployment import build_deployment

    with pytest.raises(ConfigError, match=f"{option} is not supported with sliding-window attention"):
        build_deployment(_vllm_config(dcp=1, pcp=1), _groups_config(_attention(64)), AioConfig(**config))


def test_groups_of_unequal_pages_are_refused() -> None:
    from vllm_aio.config import AioConfig
    from vllm_aio.errors import ConfigError
    from vllm_aio.shared.deployment import build_deployment

    config = _groups_config(_attention(64), _attention())
    config.kv_cache_groups[1].layer_names.append("layers.4")
    with pytest.raises(ConfigError, match="share block size, page size and layer count"):
        build_deployment(_vllm_config(dcp=1, pcp=1), config, AioConfig())


def test_a_state_cache_group_is_refused_with_the_reason() -> None:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_aio.errors import ConfigError

    mamba = MambaSpec(block_size=BLOCK, shapes=((3, 512), (4, 64, 64)), dtypes=(torch.bfloat16, torch.float32))
    with pytest.raises(ConfigError, match="MambaSpec: state caches .* one state per request"):
        _deployment(_vllm_config(dcp=1, pcp=1), _groups_config(mamba, _attention()))
