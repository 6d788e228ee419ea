"""Run one real vLLM engine over token-id prompts and write what it generated.

Tests start this as a separate process per engine: every engine gets a fresh
process (as in production), its own environment, and a pool that must be
cleaned up when it exits. Input and output are JSON files.

    python engine_runner.py spec.json result.json
"""

from __future__ import annotations

import json
import sys


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        spec["model"],
        max_model_len=spec.get("max_model_len", 4096),
        block_size=32,
        enforce_eager=True,
        enable_prefix_caching=spec.get("enable_prefix_caching", False),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 8192),
        kv_transfer_config=spec.get("kv_transfer_config"),
        seed=0,
    )
    params = SamplingParams(max_tokens=spec.get("max_tokens", 16), temperature=0, logprobs=0)
    rounds = []
    for prompts in spec["rounds"]:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        rounds.append([_result(o) for o in outputs])
    return {"rounds": rounds}


def _result(output) -> dict:
    completion = output.outputs[0]
    return {
        "prompt_len": len(output.prompt_token_ids),
        "cached": output.num_cached_tokens,
        "token_ids": list(completion.token_ids),
        "logprobs": [lp[tok].logprob for lp, tok in zip(completion.logprobs, completion.token_ids)],
    }


if __name__ == "__main__":
    spec_path, result_path = sys.argv[1:3]
    with open(spec_path) as f:
        result = run(json.load(f))
    with open(result_path, "w") as f:
        json.dump(result, f)
