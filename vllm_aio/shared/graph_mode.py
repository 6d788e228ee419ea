"""Which of vLLM's graph modes each transfer mode runs under.

vLLM replays captured graphs (CUDA graphs; ACL graphs on vllm-ascend) instead of
running the model's Python code. A PIECEWISE graph stops at every attention
layer, which runs eagerly and calls the connector's per-layer hooks; a FULL
graph (``FULL``, ``FULL_DECODE_ONLY``, or the full half of
``FULL_AND_PIECEWISE``, chosen for steps of one token per request, such as a
pool hit that leaves one token to compute) replays the whole forward and calls
none of them. Transfer modes whose work happens in those hooks
(``TransferMode.runs_per_layer``) therefore need piecewise graphs or none:
``AioConnector.requires_piecewise_for_cudagraph`` asks vLLM for them, and
``refuse_full_graphs`` stops the engine at start where a full mode still
reached us (a platform plugin that sets ``cudagraph_mode`` after vLLM's check
runs, as vllm-ascend's ``check_and_update_config`` can).

No torch here: the scheduler half and the buffer's planner both check.
"""

from __future__ import annotations

from typing import Any

from vllm_aio.config import TransferMode
from vllm_aio.errors import ConfigError


def refuse_full_graphs(mode: TransferMode, vllm_config: Any) -> None:
    if not mode.runs_per_layer:
        return
    graphs = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    if graphs is None or not graphs.has_full_cudagraphs():
        return
    raise ConfigError(
        f"transfer_mode {mode}: compilation_config.cudagraph_mode {graphs.name} replays whole forwards without "
        "the per-layer hooks this mode needs (AioConnector asks vLLM for PIECEWISE; something set "
        f"{graphs.name} after that); set cudagraph_mode to PIECEWISE or NONE, or use transfer_mode "
        "whole_blocks or async"
    )
