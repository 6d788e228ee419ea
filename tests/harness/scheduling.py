"""How the suite's files share the two CI workers (pytest-xdist): the longest first, and work done once.

``make test`` runs two files at a time (``-n 2 --dist loadfile``). xdist's own order (most tests first)
put the one-test engine files last, and a worker claims the next file before it runs the last test of its
current one: one worker ran a two-minute file while the other had nothing left. ``longest_file_first``
hands the files out by what they took in CI (``CI_SECONDS``); ``once_per_run`` computes a value (the
no-connector baseline) once for all workers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

# Seconds each slow file took in CI (two at a time on two cores; fixtures included). Files not named
# here take seconds. The figures only order the files; stale ones cost balance, never a test.
CI_SECONDS = {
    "test_e2e_migration.py": 300,  # three servers
    "test_e2e_load.py": 500,  # five servers, about ten load passes
    "test_e2e_migration_priority.py": 160,  # two servers and the router
    "test_e2e_pool.py": 140,  # with the session's no-connector baseline (the first file to ask computes it)
    "test_e2e_migration_mooncake.py": 80,
    "test_e2e_shared_prefix.py": 80,
    "test_e2e_hybrid.py": 55,
    "test_e2e_dynamic_buffer.py": 45,
    "test_e2e_isolation.py": 45,
    "test_demo.py": 40,
    "test_endpoints.py": 35,  # a vllm serve
    "test_e2e_mooncake.py": 35,
    "test_e2e_mooncake_config.py": 30,
    "test_e2e_mla.py": 30,
    "test_e2e_preemption.py": 30,
    "test_e2e_tiered.py": 15,
    "test_e2e_long_context.py": 15,
    "test_e2e_kv_events.py": 15,
    "test_e2e_amx.py": 10,
    "test_registration.py": 10,
    "test_pd_proxy.py": 10,
}


def ci_seconds(path: str, num_tests: int) -> float:
    """What a file took in CI, or a guess from its test count for the quick ones."""
    return CI_SECONDS.get(Path(path).name, 0.01 * num_tests)


def longest_file_first(config: pytest.Config, log):
    """xdist's ``LoadFileScheduling``, its queue of files reordered longest first at the first assignment."""
    from xdist.scheduler import LoadFileScheduling

    class LongestFileFirst(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "_ordered", False):  # the queue is complete at the first assignment
                self._ordered = True
                units = sorted(self.workqueue.items(), key=lambda unit: -ci_seconds(unit[0], len(unit[1])))
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return LongestFileFirst(config, log)


def once_per_run(name: str, compute: Callable[[], dict], tmp_path_factory, worker_id: str) -> dict:
    """``compute()`` once for all xdist workers of this run (under a file lock, kept as JSON in
    their shared temporary directory), or just once without xdist."""
    if worker_id == "master":
        return compute()
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # the run's directory; each worker's is inside it
    path = shared / f"{name}.json"
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            path.write_text(json.dumps(compute()))
        return json.loads(path.read_text())
