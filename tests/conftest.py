"""The suite's fixtures and pytest hooks: the local tiny models, engines, the session baseline, CI rules.

What the fixtures build on lives in ``tests/harness/`` (engines, servers, prompts, assertions, fakes);
tests import it as ``harness.<module>`` (``pytest.ini`` puts ``tests/`` on the path). Under ``CI`` a
missing prerequisite is a failure, never a skip (``harness.prerequisites.require``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.engines import Engine
from harness.prerequisites import ROOT, npu_available, require
from harness.prompts import PROMPTS
from harness.scheduling import longest_file_first, once_per_run


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile``, the files handed out longest first (``harness.scheduling.CI_SECONDS``)."""
    if config.getoption("dist", None) != "loadfile":
        return None
    return longest_file_first(config, log)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "npu: needs an Ascend NPU (torch_npu): skipped without one, "
                            "a failure with VLLM_AIO_REQUIRE_NPU=1")


@pytest.hookimpl(tryfirst=True)  # before fixtures are set up: an engine fixture would start vLLM first
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("npu") is None or npu_available():
        return
    if os.environ.get("VLLM_AIO_REQUIRE_NPU") == "1":
        pytest.fail("VLLM_AIO_REQUIRE_NPU=1 but no Ascend NPU is usable here (torch_npu missing, or "
                    "torch.npu.is_available() is False)", pytrace=False)
    pytest.skip("needs an Ascend NPU (torch_npu)")


def _model(name: str) -> Path:
    """The random-weight preset ``name``, built under ``models/`` on first use (nothing is downloaded)."""
    require("vllm")
    from vllm_aio.devtools.tiny_model import PRESETS, ensure_model

    return ensure_model(ROOT / "models" / name, PRESETS[name])


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return _model("tiny")


@pytest.fixture(scope="session")
def tiny_1kv_model() -> Path:
    return _model("tiny_1kv")


@pytest.fixture(scope="session")
def tiny6_model() -> Path:
    return _model("tiny6")


@pytest.fixture(scope="session")
def tiny_mla_model() -> Path:
    return _model("tiny_mla")


@pytest.fixture
def engine(tiny_model: Path, tmp_path: Path) -> Engine:
    return Engine(tiny_model, tmp_path)


@pytest.fixture(scope="session")
def baseline(tiny_model: Path, tmp_path_factory, worker_id: str) -> dict[str, list[dict]]:
    """What vLLM generates with no connector, per prompt set (``harness.prompts.PROMPTS``).

    Each set runs as a batch of its own, as in the tests: batch composition
    changes chunking and thus float rounding, which can flip a near-tie token.
    Computed once per test run: test files on other xdist workers read it.
    """
    def compute() -> dict[str, list[dict]]:
        names = [n for n in PROMPTS if n != "tp2"]
        rounds = Engine(tiny_model, tmp_path_factory.mktemp("baseline")).run([PROMPTS[n] for n in names])
        return dict(zip(names, rounds))

    return once_per_run("baseline", compute, tmp_path_factory, worker_id)
