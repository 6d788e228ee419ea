"""Graph modes: which transfer modes ask vLLM for piecewise graphs, which refuse full ones at start,
and the connector's hooks outside a scheduled step (graph capture, dummy runs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_aio.config import TransferMode

from vllm_aio.errors import ConfigError
from vllm_aio.shared.graph_mode import refuse_full_graphs


def _graphs(name: str, full: bool) -> SimpleNamespace:
    return SimpleNamespace(compilation_config=SimpleNamespace(
        cudagraph_mode=SimpleNamespace(name=name, has_full_cudagraphs=lambda: full)))


@pytest.mark.parametrize("extra,piecewise", [
    ({}, False),
    ({"transfer_mode": "whole_blocks"}, False),
    ({"transfer_mode": "async"}, False),
    ({"transfer_mode": "layerwise"}, True),
    ({"transfer_mode": "dynamic_buffer", "dynamic_buffer_count": 2}, True),
    ({"use_layerwise": True}, True),  # a replaced key still selects its mode
    ({"transfer_mode": "sideways"}, False),  # refused by the connector's own start, naming the key
])
def test_modes_whose_work_runs_per_layer_ask_vllm_for_piecewise_graphs(extra, piecewise):
    from vllm_aio.connector.connector import AioConnector

    assert AioConnector.requires_piecewise_for_cudagraph(extra) is piecewise


@pytest.mark.parametrize("mode", ["FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
@pytest.mark.parametrize("transfer", [TransferMode.LAYERWISE, TransferMode.DYNAMIC_BUFFER])
def test_a_per_layer_mode_under_full_graphs_is_refused_at_start_naming_the_setting(mode, transfer):
    with pytest.raises(ConfigError, match=f"transfer_mode {transfer}: compilation_config.cudagraph_mode {mode}"):
        refuse_full_graphs(transfer, _graphs(mode, full=True))


@pytest.mark.parametrize("transfer", [TransferMode.WHOLE_BLOCKS, TransferMode.ASYNC])
def test_modes_working_before_and_after_the_forward_run_under_full_graphs(transfer):
    refuse_full_graphs(transfer, _graphs("FULL_AND_PIECEWISE", full=True))


@pytest.mark.parametrize("mode", ["PIECEWISE", "NONE"])
def test_per_layer_modes_run_under_piecewise_graphs_or_none(mode):
    refuse_full_graphs(TransferMode.LAYERWISE, _graphs(mode, full=False))


class _Worker:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self.calls.append(name)


def test_hooks_called_with_no_metadata_bound_return_at_once():
    """vLLM's graph capture and vllm-ascend's dummy runs (MLA/SFA/DSA attention, idle DP ranks) call
    the per-layer hooks with no step's metadata bound: nothing reaches the worker, nothing raises."""
    from vllm_aio.connector.connector import AioConnector
    from vllm_aio.shared.metadata import AioConnectorMetadata

    connector = AioConnector.__new__(AioConnector)  # the facade alone, over a worker that records
    connector._worker = worker = _Worker()
    connector.clear_connector_metadata()
    connector.start_load_kv(None)
    connector.wait_for_layer_load("model.layers.0.self_attn.attn")
    connector.save_kv_layer("model.layers.0.self_attn.attn", None, None)
    connector.wait_for_save()
    assert worker.calls == []

    connector.bind_connector_metadata(AioConnectorMetadata())
    connector.wait_for_layer_load("model.layers.0.self_attn.attn")
    connector.save_kv_layer("model.layers.0.self_attn.attn", None, None)
    assert worker.calls == ["begin_step", "wait_for_layer_load", "save_kv_layer"]
