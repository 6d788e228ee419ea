"""Importing the connector's module loads nothing of the worker half.

vLLM imports ``kv_connector_module_path`` from its configuration check, before
any worker starts. vLLM 0.32's CPU worker start then scans every loaded module
for Triton kernels and fails on numba's (llvmlite's) function wrappers: where
the worker runs in that same process (TP=1, the engine core in-process), an
import of numba from the connector module stopped the engine at start.
"""

from __future__ import annotations

import subprocess
import sys

from harness.prerequisites import ROOT


def test_importing_the_connector_module_loads_no_numba():
    code = ("import sys\nimport vllm_aio.connector\nfrom vllm_aio.connector import AioConnector\n"
            "print(sorted(m for m in ('numba', 'llvmlite') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
