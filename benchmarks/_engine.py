"""One real vLLM engine serving timed token-id requests, one at a time, on command.

``benchmarks/ttft.py`` starts this as a separate process per engine, so every
engine is fresh (as a restarted server would be), and keeps several engines
alive at once so that it can interleave their requests (only one of them
computes at any moment). Each request runs alone with ``max_tokens=1``: its
latency is its time to first token.

    python benchmarks/_engine.py spec.json RESULT_FD

spec: {"model", "max_model_len", "enable_prefix_caching", "kv_transfer_config",
       "max_num_batched_tokens", "warmup": [ids]}
stdin: one JSON command per line: {"label": str, "prompt": [ids]} or {"exit": true}
RESULT_FD: one JSON line per event: {"ready": true, "init_s", "warmup": step}
           after start and the warm-up request, then one step per command:
           {"label", "prompt_len", "cached", "wall_s", "ttft_s", "engine_s"}

``wall_s`` is the wall time of ``llm.generate``; ``ttft_s`` vLLM's own
first-token latency (request arrival to first token, ``RequestOutput.metrics``,
which needs ``disable_log_stats=False``); ``engine_s`` the engine core's
scheduled-to-first-token time (the step itself, without queueing and IPC).
vLLM's log goes to stdout/stderr, results only to RESULT_FD.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str, result_fd: int) -> None:
    os.set_inheritable(result_fd, False)  # not into vLLM's engine-core process
    results = os.fdopen(result_fd, "w", buffering=1)
    with open(spec_path) as f:
        spec = json.load(f)

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
        disable_log_stats=False,  # RequestOutput.metrics carries the first-token latency
        seed=0,
    )
    init_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=1, temperature=0)

    def step(label: str, prompt: list[int]) -> dict:
        start = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        wall = time.perf_counter() - start
        m = out.metrics
        ttft = getattr(m, "first_token_latency", 0.0) if m is not None else 0.0
        engine = (m.first_token_ts - m.scheduled_ts) if m is not None and m.scheduled_ts else 0.0
        print(f"[bench] {label}: wall={wall * 1e3:.1f}ms ttft={ttft * 1e3:.1f}ms "
              f"engine={engine * 1e3:.1f}ms cached={out.num_cached_tokens}/{len(prompt)}", flush=True)
        return {"label": label, "prompt_len": len(out.prompt_token_ids), "cached": out.num_cached_tokens,
                "wall_s": wall, "ttft_s": ttft if ttft > 0 else wall, "engine_s": engine,
                "t": time.time()}

    warmup = step("warmup", spec["warmup"])
    results.write(json.dumps({"ready": True, "init_s": init_s, "warmup": warmup}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("exit"):
            break
        results.write(json.dumps(step(cmd["label"], cmd["prompt"])) + "\n")
    results.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
