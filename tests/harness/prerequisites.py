"""Where the suite runs from, and what it needs there.

Under ``CI`` a missing prerequisite (vLLM, the model builder's libraries) is a
failure, never a skip: a green CI run must mean the real thing ran (``require``).
"""

from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository
TESTS = ROOT / "tests"  # on the path of the tests and of every engine they start: ``harness`` imports from it


def require(module: str):
    """Import a prerequisite; in CI its absence fails the test instead of skipping."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI requires {module}: {exc}")
        pytest.skip(f"{module} not installed: {exc}")


@functools.cache
def npu_available() -> bool:
    """Whether torch_npu imports (it registers the ``npu`` device with torch) and sees an NPU."""
    try:
        import torch
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return torch.npu.is_available()


def host_has_amx() -> bool:
    """Whether this CPU and kernel offer AMX tiles (vLLM's CPU attention then runs AMX kernels for bf16)."""
    import platform

    from vllm_aio.device.amx_permission import ARCH_GET_XCOMP_SUPP, TILE_BIT, LibcArchPrctl

    return platform.machine() == "x86_64" and bool(LibcArchPrctl().mask(ARCH_GET_XCOMP_SUPP) & TILE_BIT)
