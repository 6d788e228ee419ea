"""The preemption scenario of the end-to-end tests: four requests decoding together in a KV cache too
small for all of them, under vLLM's priority scheduling (``test_e2e_preemption.py``; ``test_e2e_hybrid.py``
runs it again on the hybrid model).
"""

from __future__ import annotations

from harness.engines import FLOAT32
from harness.prompts import make_prompts

PROMPTS = make_prompts(seed=71, lengths=[300, 290, 310, 305])
BLOCK = 32
PRIORITIES = [0, 1, 1, 1]  # vLLM: lower is more important; the three 1s are preempted first
RUN = {
    "scheduling_policy": "priority",
    "priorities": [PRIORITIES],
    "max_num_seqs": 4,
    "max_num_batched_tokens": 256,
    "enable_prefix_caching": True,
    # The prompts take 40 blocks of 32 tokens, the whole sequences 72: a preempted
    # request's freed blocks go to the others' decodes before it resumes, so
    # vLLM's prefix cache has lost most of them by then.
    "num_gpu_blocks_override": 48,
    "max_tokens": 256,
    "max_model_len": 1024,
    # A resumed request attends over loaded decode-written KV where the baseline recomputed it:
    # float32, so that rounding is far below what a wrong byte does (LOGPROB_TOLERANCE).
    **FLOAT32,
}
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # every request queued before the first step
