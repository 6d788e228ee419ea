"""``benchmarks/_engine.py`` with tensor parallelism: same protocol, same timing.

    python benchmarks/_engine_tp.py spec.json RESULT_FD

The spec is ``_engine.py``'s plus optional ``tensor_parallel_size`` and
``distributed_executor_backend``; those are bound into ``vllm.LLM`` before
``_engine.main`` imports it, so the runner's timing code is reused unchanged.
"""

from __future__ import annotations

import functools
import json
import sys

PARALLEL_KEYS = ("tensor_parallel_size", "distributed_executor_backend")

if __name__ == "__main__":  # engine-core and worker processes are spawned: nothing at import time
    with open(sys.argv[1]) as f:
        parallel = {k: v for k, v in json.load(f).items() if k in PARALLEL_KEYS}
    if parallel:
        import vllm

        vllm.LLM = functools.partial(vllm.LLM, **parallel)  # _engine.main does `from vllm import LLM`

    import _engine  # benchmarks/ is sys.path[0]: this script's folder

    _engine.main(sys.argv[1], int(sys.argv[2]))
