"""End to end on real vLLM (CPU build): preemption costs a load, not a recompute.

Four requests decode together in a KV cache too small for all of them to
finish, under ``--scheduling-policy priority``: vLLM preempts the
lowest-priority running request, frees its blocks, and later resumes it.
Without the connector the resumption recomputes every token the prefix
cache no longer holds; with it, the preempted request's full blocks
(generated ones included) were copied out before vLLM reused them and are
loaded back. The figure is vLLM's own: tokens its scheduler stats count as
queried and not hit for resumed requests.
"""

from __future__ import annotations

from harness.assertions import assert_same_generation
from harness.engines import aio_config
from harness.preemption import BLOCK, IN_PROCESS, PROMPTS, RUN


def test_a_preempted_request_resumes_by_loading_its_blocks_not_recomputing_them(engine):
    (baseline,) = engine.run([PROMPTS], env=IN_PROCESS, **RUN)
    recomputed_without = engine.last_recomputed_after_preemption
    assert engine.last_preemptions > 0 and recomputed_without > 0

    (got,) = engine.run([PROMPTS], aio_config(local_pool_size="64MB"), env=IN_PROCESS, **RUN)
    assert engine.last_preemptions > 0
    assert engine.last_counters.get("load_failures", 0) == 0
    # Only each resumed request's last, partial block is computed again (full blocks were rescued).
    recomputed = engine.last_recomputed_after_preemption
    assert recomputed <= BLOCK * engine.last_preemptions and recomputed < recomputed_without, (
        recomputed, engine.last_preemptions, recomputed_without)
    print(f"preemptions {engine.last_preemptions}; tokens recomputed after preemption: "
          f"{engine.last_recomputed_after_preemption} with the connector, {recomputed_without} without")
    assert_same_generation(got, baseline)
