"""Every benchmark's ``--quick`` run, in a subprocess: it exits 0, prints its table and writes its results.

Benchmarks measure, tests do not: this only keeps the scripts from rotting
(an API they call changed, a size they compute went stale). The three scripts
that run real vLLM engines (and ``migration``, two ``vllm serve``) take a minute or more, mostly starting them:
they start side by side when the first test runs and their tests wait for
them (their engines' OpenMP threads unpinned, as the engine tests run theirs), while the
others run one at a time meanwhile. ``priority``, ``soak`` and ``buffer_capacity``
(one engine or server at a time, one torch thread each) then start side by
side: alone, each kept one of the two cores busy. ``serve`` and ``gpu_serve`` (two
servers each, and vLLM's benchmark client) come last, side by side. Under ``CI`` a missing
prerequisite fails the test, as ``conftest.require`` does, instead of
skipping it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.engines import EAGER, THREADS
from harness.prerequisites import ROOT

TIMEOUT_S = 300  # per script, from its start (a guard against hangs)
# script -> (what it needs beyond torch, the first column of a table it prints)
SCRIPTS = {
    "block_io_device": ((), "case"),
    "layer_pipeline": ((), "prefix tokens"),
    "dynamic_buffer": ((), "phase"),
    "pool_bandwidth": ((), "case"),
    "scale": ((), "pool"),
    "mooncake_backend": (("mooncake",), "case"),
    "transport": (("mooncake",), "value"),
    "ttft": (("vllm",), "model"),
    "mooncake_ttft": (("vllm", "mooncake"), "model"),
    "gpu_ttft": (("vllm",), "prefix tokens"),  # on the CPU build: two engines (OffloadingConnector skipped)
    "migration": (("vllm", "mooncake"), "model"),
    "priority": (("vllm",), "system"),  # one engine at a time: run beside the others
    "soak": (("vllm",), "soak"),  # one server at a time, as priority
    "buffer_capacity": (("vllm",), "system"),  # three engines one after the other, as priority
    "serve": (("vllm",), "config"),  # two servers at once, each with vLLM's client: last, beside gpu_serve
    "gpu_serve": (("vllm",), "system"),  # as serve (on the CPU build its two servers start at once)
}
ENGINE_SCRIPTS = ("ttft", "mooncake_ttft", "gpu_ttft", "migration")
# Started together when the first of them is tested: after the engine scripts' tests (SCRIPTS' order).
LATE_SCRIPTS = ("priority", "soak", "buffer_capacity")
# Started together when the first of them is tested, after the late scripts: servers that mostly wait
# for their clients (a client's start is a vLLM import), so that two side by side take less than one
# after the other.
LAST_SCRIPTS = ("serve", "gpu_serve")
# One torch thread beside the engines: threads spinning at OpenMP barriers on busy cores made a
# two-second run take a minute, and slowed the engines down too.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
PLOTTED = "pool_bandwidth"  # a cheap script whose run also draws its plot (benchmarks/_report.plot)


def missing(needs: tuple[str, ...]) -> str | None:
    """Why a script cannot run here, or None (without importing vLLM: that takes seconds)."""
    for need in needs:
        if need == "vllm" and importlib.util.find_spec("vllm") is None:
            return "vllm is not installed"
        if need == "mooncake":
            try:
                importlib.import_module("mooncake.store")
                from vllm_aio.devtools.mooncake_pool import find_binary

                find_binary("mooncake_master")
                find_binary("mooncake_client")
            except Exception as exc:  # ImportError, OSError (libibverbs), PoolError
                return f"Mooncake cannot run here: {exc}"
    return None


@dataclass
class Run:
    proc: subprocess.Popen
    log: Path
    results: Path
    deadline: float  # time.monotonic()

    @classmethod
    def start(cls, script: str, out: Path, env: dict[str, str] | None = None) -> Run:
        """The script's quick run; TorchDynamo off (``conftest.EAGER``): a smoke run's figures are
        not read, and each engine's compile of vLLM's sampler took seconds on these two cores."""
        log = out / f"{script}.log"
        plot = ["--plot", str(out / f"{script}.png")] if script == PLOTTED else []
        with open(log, "w") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", f"benchmarks.{script}", "--quick", "--json", str(out / f"{script}.json"),
                 *plot],
                cwd=ROOT, env={**os.environ, **EAGER, **(env or {})}, stdout=f, stderr=subprocess.STDOUT,
                start_new_session=True)
        return cls(proc, log, out / f"{script}.json", time.monotonic() + TIMEOUT_S)

    def wait(self) -> str:
        try:
            self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGINT)  # KeyboardInterrupt: the script kills its engines
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("benchmarks")


def started_together(request, out: Path, group: tuple[str, ...], env: dict[str, str] | None = None
                     ) -> Iterator[dict[str, Run]]:
    """The ``--quick`` run of each selected script of ``group`` whose prerequisites are here, started at once."""
    selected = {item.callspec.params["script"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    runnable = [s for s in group if s in selected and missing(SCRIPTS[s][0]) is None]
    if runnable:  # the tiny model, built once here rather than by two scripts at once
        from vllm_aio.devtools.tiny_model import PRESETS, ensure_model

        ensure_model(ROOT / "models" / "tiny", PRESETS["tiny"])
    runs = {script: Run.start(script, out, env) for script in runnable}
    yield runs
    for run in runs.values():  # a test that failed early leaves nothing running
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGINT)
            run.wait()


@pytest.fixture(scope="module")
def engine_runs(request, out: Path) -> Iterator[dict[str, Run]]:
    # Unpinned, as the engine tests run theirs: pinned, the three scripts' engines each put
    # their first OpenMP thread on core 0.
    yield from started_together(request, out, ENGINE_SCRIPTS, THREADS)


@pytest.fixture(scope="module")
def late_runs(request, out: Path) -> Iterator[dict[str, Run]]:
    """Requested by the first late script's test (not before: the engine scripts are done by then)."""
    yield from started_together(request, out, LATE_SCRIPTS, ONE_THREAD)


@pytest.fixture(scope="module")
def last_runs(request, out: Path) -> Iterator[dict[str, Run]]:
    """Requested by the first last script's test (the late scripts are done by then)."""
    yield from started_together(request, out, LAST_SCRIPTS, ONE_THREAD)


def has_table(output: str, first_column: str) -> bool:
    """A markdown table whose first column is ``first_column``, with at least one row."""
    lines = output.splitlines()
    return any(
        re.match(rf"\| *{re.escape(first_column)} +\|", line) and re.fullmatch(r"\|[-:|]+\|", lines[i + 1])
        and lines[i + 2].startswith("|")
        for i, line in enumerate(lines[:-2])
    )


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_quick_run(request, script: str, engine_runs: dict[str, Run], out: Path) -> None:
    needs, first_column = SCRIPTS[script]
    if reason := missing(needs):
        if os.environ.get("CI"):
            pytest.fail(f"CI requires what {script}.py needs: {reason}", pytrace=False)
        pytest.skip(reason)
    group = {**(request.getfixturevalue("late_runs") if script in LATE_SCRIPTS else {}),
             **(request.getfixturevalue("last_runs") if script in LAST_SCRIPTS else {})}
    run = engine_runs.get(script) or group.get(script) or Run.start(script, out, env=ONE_THREAD)
    output = run.wait()
    assert run.proc.returncode == 0, f"{script}.py --quick exited {run.proc.returncode}:\n{output[-6000:]}"
    assert has_table(output, first_column), f"{script}.py --quick printed no table:\n{output[-6000:]}"
    assert run.results.exists(), f"{script}.py --quick wrote no {run.results}"
    if script == PLOTTED:
        assert (out / f"{script}.png").stat().st_size > 0, f"{script}.py --plot drew nothing:\n{output[-2000:]}"
