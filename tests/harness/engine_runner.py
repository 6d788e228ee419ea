"""Run one real vLLM engine over token-id prompts, round after round, as a test asks.

Tests start this as a separate process per engine: every engine gets a fresh
process (as in production), its own environment, and a pool that must be
cleaned up when it exits. The test hands it rounds through files in a
directory (``conftest.LiveEngine``): ``round-N.json`` holds a round's prompts
and options, ``round-N.out.json`` what the engine generated and its counters
so far; ``stop`` ends the run, whose facts go to the result file.

    python engine_runner.py spec.json result.json
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if spec.get("kv_cache_memory_bytes"):  # vLLM's CPU build lets the GiB variable win
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

    # On an accelerator (the GPU engine tier): graphs as deployments run them, and a memory share.
    tp = spec.get("tensor_parallel_size", 1)
    accelerator = {key: spec[key] for key in ("compilation_config", "gpu_memory_utilization") if key in spec}
    speculative = {"speculative_config": spec["speculative_config"]} if "speculative_config" in spec else {}
    llm = LLM(
        spec["model"],
        max_model_len=spec.get("max_model_len", 4096),
        block_size=spec.get("block_size", 32),
        enforce_eager=spec.get("enforce_eager", True),
        **accelerator,
        **speculative,
        enable_prefix_caching=spec.get("enable_prefix_caching", False),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 8192),
        # One request at a time: which requests share a step depends on when the
        # engine core receives them, and a different batch changes float
        # rounding, which flips near-tie tokens of a random model. Running
        # alone, a request's result depends only on its own KV.
        max_num_seqs=spec.get("max_num_seqs", 1),
        tensor_parallel_size=tp,
        # TP=1: the worker in the engine core's process (vLLM's default on GPUs; its CPU platform
        # moves it to a process of its own only where the core has one, to set OpenMP's environment
        # there, and here the core runs in this process, started with the test's environment).
        # A worker process per TP=1 engine cost 7 s of a 19 s start here.
        distributed_executor_backend="mp" if tp > 1 else "uni",
        attention_backend=spec.get("attention_backend"),
        dtype=spec.get("dtype", "auto"),
        kv_transfer_config=spec.get("kv_transfer_config"),
        kv_events_config=_kv_events_config(spec.get("kv_events_config")),
        num_gpu_blocks_override=spec.get("num_gpu_blocks_override"),
        kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes"),
        scheduling_policy=spec.get("scheduling_policy", "fcfs"),
        disable_log_stats=False,
        seed=0,
    )
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    resumed = _ResumedPrefills()
    llm.llm_engine.logger_manager.stat_loggers.append(resumed)
    # The top two logprobs: their gap tells a near tie (conftest.assert_same_generation).
    params = SamplingParams(max_tokens=spec.get("max_tokens", 16), temperature=0, logprobs=2)
    directory = Path(spec["rounds_dir"])
    for index in itertools.count():
        order = _next_order(directory, index)
        if order is None:
            break
        if order.get("reset_prefix_cache"):  # the round's hits then come from the connector
            assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
        prompts = [TokensPrompt(prompt_token_ids=p) for p in order["prompts"]]
        if aborts := spec.get("aborts", {}).get(str(index)):
            outputs = _generate_aborting(llm, index, prompts, params, aborts["after_steps"], aborts["requests"])
        else:
            outputs = llm.generate(prompts, params, priority=order.get("priorities"))
        _write(directory / f"round-{index}.out.json",
               {"results": [o and _result(o, dtype) for o in outputs], "aio": _aio_counters(llm),
                "preemptions": _counter(llm, "vllm:num_preemptions"),
                "recomputed_after_preemption": resumed.recomputed})
    return {"workers": llm.collective_rpc(_worker_facts)}


def _generate_aborting(llm, round_: int, prompts: list, params, after_steps: int, aborted: list[int]) -> list:
    """The prompts through the engine's own loop, the ``aborted`` ones aborted after ``after_steps``
    steps, as vLLM aborts a request whose client hung up (their loads or saves may be in flight).
    The others' outputs in prompt order; None for an aborted one."""
    engine = llm.llm_engine
    ids = [f"round-{round_}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        # The id as given, whether an output carries it or vLLM's internal one (it appends "-<suffix>")
        finished.update(("-".join(out.request_id.split("-")[:3]), out) for out in engine.step() if out.finished)
        steps += 1
        if steps == after_steps:
            engine.abort_request([ids[i] for i in aborted])
    return [None if i in aborted else finished[request_id] for i, request_id in enumerate(ids)]


def _next_order(directory: Path, index: int) -> dict | None:
    """Round ``index``'s order once the test has written it; None once it said stop."""
    path = directory / f"round-{index}.json"
    while not path.exists():
        if (directory / "stop").exists():
            return None
        time.sleep(0.02)
    return json.loads(path.read_text())


def _write(path: Path, value: dict) -> None:
    """Whole or not at all: the reader polls for the name."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(value))
    temporary.rename(path)


def _worker_facts(worker) -> dict:
    """Asked of every worker process after the run: which kernels its attention layers used and
    whether the process holds the AMX tile permission (read from the kernel here, not from the
    connector's word)."""
    import platform

    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    from vllm_aio.device.amx_permission import ARCH_GET_XCOMP_PERM, TILE_BIT, LibcArchPrctl

    amx_tiles = platform.machine() == "x86_64" and bool(LibcArchPrctl().mask(ARCH_GET_XCOMP_PERM) & TILE_BIT)
    layers = get_layers_from_vllm_config(worker.vllm_config, Attention)
    return {"pid": os.getpid(), "amx_tiles": amx_tiles,
            "attention": sorted({str(getattr(layer, "isa", None)) for layer in layers.values()})}


class _ResumedPrefills:
    """Tokens vLLM recomputed when it resumed preempted requests, from its own
    scheduler stats: what neither its prefix cache nor the connector supplied."""

    def __init__(self) -> None:
        self.recomputed = 0

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0) -> None:
        if scheduler_stats is None:
            return
        # The connector is asked about what the prefix cache missed; without one, that is recomputed.
        stats = scheduler_stats.connector_prefix_cache_stats or scheduler_stats.prefix_cache_stats
        self.recomputed += stats.preempted_queries - stats.preempted_hits

    def __getattr__(self, name: str):  # vLLM's other logger hooks: nothing to do
        return lambda *args, **kwargs: None


def _kv_events_config(fields: dict | None):
    from vllm.config import KVEventsConfig

    return KVEventsConfig(**fields) if fields else None


def _counter(llm, name: str) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == name))


def _aio_counters(llm) -> dict[str, float]:
    """The connector's own counters (``vllm:aio_<name>_total``), by name: totals since start."""
    from vllm.v1.metrics.reader import Counter

    prefix = "vllm:aio_"
    return {m.name[len(prefix):]: m.value for m in llm.get_metrics()
            if m.name.startswith(prefix) and isinstance(m, Counter)}


def _result(output, dtype: str) -> dict:
    from vllm_aio.migration.margin import top_two_gap

    completion = output.outputs[0]
    return {
        "prompt_len": len(output.prompt_token_ids),
        "cached": output.num_cached_tokens,
        "token_ids": list(completion.token_ids),
        "logprobs": [lp[tok].logprob for lp, tok in zip(completion.logprobs, completion.token_ids)],
        "margins": [top_two_gap(p.logprob for p in lp.values()) for lp in completion.logprobs],
        "dtype": dtype,  # what the model ran in: it sets the near-tie bound and the logprob tolerance
    }


def main(spec_path: str, result_path: str) -> None:
    with open(spec_path) as f:
        result = run(json.load(f))
    _write(Path(result_path), result)


if __name__ == "__main__":
    main(*sys.argv[1:3])
