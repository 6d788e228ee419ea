"""Run one real vLLM engine over a list of timed token-id requests (benchmark runner).

``benchmarks/ttft.py`` starts this as a separate process per engine, so every
engine is fresh (as a restarted server would be). Each step sends ONE request
alone with ``max_tokens=1``, so its latency is its time to first token.

    python benchmarks/_engine.py spec.json result.json

spec: {"model", "max_model_len", "enable_prefix_caching", "kv_transfer_config",
       "max_num_batched_tokens", "steps": [{"label": str, "prompt": [ids]}, ...]}
result: {"init_s": float, "steps": [{"label", "prompt_len", "cached", "wall_s",
         "ttft_s", "engine_s"}, ...]}

``wall_s`` is the wall time of ``llm.generate``; ``ttft_s`` is vLLM's own
first-token latency (request arrival to first token, from ``RequestOutput.metrics``,
which needs ``disable_log_stats=False``); ``engine_s`` is the engine core's
scheduled-to-first-token time (the step itself, without queueing/IPC).
"""

from __future__ import annotations

import json
import sys
import time


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        spec["model"],
        max_model_len=spec["max_model_len"],
        block_size=32,
        enforce_eager=True,
        enable_prefix_caching=spec["enable_prefix_caching"],
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 8192),
        kv_transfer_config=spec.get("kv_transfer_config"),
        disable_log_stats=False,  # RequestOutput.metrics carries first-token latency
        seed=0,
    )
    init_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=1, temperature=0)
    steps = []
    for step in spec["steps"]:
        prompt = TokensPrompt(prompt_token_ids=step["prompt"])
        start = time.perf_counter()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - start
        m = out.metrics
        ttft = getattr(m, "first_token_latency", 0.0) if m is not None else 0.0
        engine = (m.first_token_ts - m.scheduled_ts) if m is not None and m.scheduled_ts else 0.0
        steps.append({
            "label": step["label"],
            "prompt_len": len(out.prompt_token_ids),
            "cached": out.num_cached_tokens,
            "wall_s": wall,
            "ttft_s": ttft if ttft > 0 else wall,
            "engine_s": engine,
            "t_end": time.time(),
        })
        print(f"[bench] {step['label']}: wall={wall * 1e3:.1f}ms ttft={ttft * 1e3:.1f}ms "
              f"engine={engine * 1e3:.1f}ms cached={out.num_cached_tokens}/{len(out.prompt_token_ids)}",
              flush=True)
    return {"init_s": init_s, "steps": steps}


if __name__ == "__main__":
    spec_path, result_path = sys.argv[1:3]
    with open(spec_path) as f:
        result = run(json.load(f))
    with open(result_path, "w") as f:
        json.dump(result, f)
    # vLLM's engine-core shutdown runs in atexit / __del__; exit normally.
