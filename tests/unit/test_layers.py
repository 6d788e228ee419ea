"""The scheduler half stays on its side of the process boundary.

It runs in vLLM's engine-core process and never touches KV bytes: scheduler,
the shared facts (``shared/``: deployment, keys, metadata), ownership, entry
headers, configuration and the backend contract import neither torch nor numpy
(nor vLLM, which imports torch). Checked in a fresh interpreter where importing
them fails.
"""

from __future__ import annotations

import subprocess
import sys

from harness.prerequisites import ROOT

SCHEDULER_HALF = (
    "vllm_aio.config",
    "vllm_aio.pool.keys",
    "vllm_aio.pool.ownership",
    "vllm_aio.pool.entry",
    "vllm_aio.backends",
    "vllm_aio.backends.tiered",
    "vllm_aio.shared.deployment",
    "vllm_aio.shared.keying",
    "vllm_aio.shared.metadata",
    "vllm_aio.connector.scheduler.scheduler",
    "vllm_aio.connector.scheduler.leases",
    "vllm_aio.connector.scheduler.lookups",
    "vllm_aio.connector.scheduler.load_plan",
    "vllm_aio.connector.scheduler.save_plan",
    "vllm_aio.connector.events",
    "vllm_aio.buffer.planner",
    "vllm_aio.buffer.residency",
    "vllm_aio.migration.flushes",
    "vllm_aio.registration",  # not the scheduler's, but the plugins' module: vLLM loads it in every process
)


def test_scheduler_half_imports_neither_torch_nor_numpy_nor_vllm():
    blocked = "import sys\nfor name in ('torch', 'numpy', 'vllm'):\n    sys.modules[name] = None\n"
    imports = "".join(f"import {module}\n" for module in SCHEDULER_HALF)
    proc = subprocess.run([sys.executable, "-c", blocked + imports], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_worker_side_module_is_caught_importing_torch():
    # The check itself can fail: the block layout needs torch.
    blocked = "import sys\nsys.modules['torch'] = None\nimport vllm_aio.device.block_layout\n"
    proc = subprocess.run([sys.executable, "-c", blocked], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and "torch" in proc.stderr
