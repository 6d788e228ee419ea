"""Real vLLM engines for the tests, each in a process of its own, generating round after round.

``Engine`` starts them (forked from a zygote that imported vLLM once, where the environment allows,
else as a fresh interpreter running ``engine_runner.py``); ``LiveEngine`` hands a test each round's
results, counters and log. Also here: the environment every engine and server of the suite runs in
(``THREADS``, ``EAGER``, ``engine_env``), the settings tests pass to engines (``FLOAT32``, ``TP2``,
``MLA``, ``TRANSFER_MODES``) and the connector's ``kv_transfer_config`` (``aio_config``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.engine_zygote import serves
from harness.prerequisites import ROOT, TESTS

RUNNER = Path(__file__).resolve().parent / "engine_runner.py"
ZYGOTE = RUNNER.parent / "engine_zygote.py"
# Greedy logprobs of pool-served prompts match recompute to LOGPROB_TOLERANCE (by the dtype the
# model ran in): the bytes are identical, only the kernels that consume them (prefill vs. the short
# remaining chunk, decode vs. prefill) differ. Tests whose point is the connector's bytes across such
# paths run in float32 (FLOAT32): in bf16 a wrong layer's KV moved this random model's logprobs by
# 0.03-0.09, as much as rounding does.
FLOAT32 = {"dtype": "float32"}

# Two test files run at once on CI's two cores, each starting engines whose
# OpenMP threads span both cores. Threads that spin at barriers while the other
# file's engine holds the core slow both down; sleeping ones do not (measured: two
# engines side by side finished in 58 s instead of 69 s). Arithmetic is unchanged.
# Set when the suite starts (conftest.py imports this module): servers inherit it too.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The OpenMP threads of every engine and server the tests start: one per core, as vLLM's binding
# "0-N" gave, but not pinned ("nobind", the count from OMP_NUM_THREADS). Pinned, every engine's
# thread 0, which also runs its worker's Python, sat on core 0: two engines side by side (two test
# files at once) took 54 s where one alone took 24 (unpinned: 39 s; runs dominated by start-up,
# 35 s -> 22 s, as fast as one alone). The thread count, and with it the arithmetic, is unchanged:
# the same tokens and logprobs, pinned or not.
THREADS = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(os.cpu_count())}

# Eager engines (every CPU engine and server of the suite) compile nothing of the model; torch.compile
# is left only on vLLM's sampler, whose rank count of logprobs (``batched_count_greater_than``, an integer
# count: the same numbers either way) inductor compiled on each process's first request: 4.7 s of it,
# ten compiler probes in child processes even with a warm cache. Off, that first request took 0.07 s.
EAGER = {"TORCHDYNAMO_DISABLE": "1"}

# Runs with a configuration no TP=1 test has (TP=2, MLA, another architecture)
# check their warm pass against their own cold pass instead of a no-connector
# engine of their own: a cold pass loads nothing, and that the connector's
# stores leave the computation untouched is shown against no-connector engines
# by the TP=1 tests. Each such engine costs a minute on CI's two cores.

# Tensor parallel 2 on a 2-core machine: one thread per rank, as the binding "0|1" gave (vLLM's
# default binding fails with "Not enough allowed NUMA nodes to bind threads"), unpinned (THREADS).
TP2 = {"tensor_parallel_size": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}}

# MLA on vLLM's CPU build: the reference CPU_MLA backend runs on any x86 CPU
# and takes 16-token blocks only. Left to choose, vLLM picks AMX_MLA where the
# CPU has AMX (32-token blocks), so the backend is pinned for one behaviour.
MLA = {"attention_backend": "CPU_MLA", "block_size": 16}

# The connector's transfer modes, as extra settings of ``aio_config`` (a test parametrized over them).
TRANSFER_MODES = {mode: {"transfer_mode": mode} for mode in ("whole_blocks", "layerwise", "async")}


def aio_config(role: str = "kv_both", module: str = "vllm_aio.connector",
               connector: str = "AioConnector", **extra) -> dict:
    """vLLM's ``kv_transfer_config`` for the connector (or a test's subclass of it: ``module``)."""
    return {
        "kv_connector": connector,
        "kv_connector_module_path": module,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def block_value_bytes(model: Path, tp: int = 1) -> int:
    """One stored value: header + one rank's block of every layer (bf16, block size 32)."""
    from vllm_aio.pool.entry import HEADER_BYTES

    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    heads_per_rank = max(1, cfg["num_key_value_heads"] // tp)
    return HEADER_BYTES + cfg["num_hidden_layers"] * 2 * heads_per_rank * head_dim * 32 * 2


def engine_env(spec: dict, env: dict[str, str] | None) -> dict[str, str]:
    """The environment of an engine of ``spec``: the repository and ``tests/`` on its path (vLLM loads
    the tests' connectors by module name: ``harness.faulty_connector``), ``env`` over the rest."""
    # vLLM picks its OpenMP thread count differently with and without a
    # connector; a different count changes float rounding, so fix it (THREADS). The
    # engine core runs in the runner's process, and at TP=1 its worker too: a
    # process fewer to start, 4-13 s of a 25-38 s run here.
    path = os.pathsep.join([str(ROOT), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0", **THREADS,
            **(EAGER if spec.get("enforce_eager", True) else {}),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": path, **(env or {})}


@dataclass
class Round:
    """What one round of a live engine generated, and what it added to the engine's figures."""

    results: list[dict]
    counters: dict[str, float]  # the connector's counters (``vllm:aio_<name>_total``) this round added
    preemptions: int
    recomputed_after_preemption: int  # tokens vLLM recomputed when it resumed preempted requests
    log: str  # what the engine logged from the round's order until its results


class LogTail:
    """What a log file gained since the last read: a round's or a pass's lines."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def read_new(self) -> str:
        with open(self.path, errors="replace") as log:
            log.seek(self.offset)
            text = log.read()
            self.offset = log.tell()
        return text


class LiveEngine:
    """One real vLLM engine in a process of its own, generating round after round as a test asks.

    Tests that need an engine of the same configuration take rounds from one (a module fixture),
    each round's counters and log its own, in place of an engine each: an engine's start is most
    of a short test's time. Between rounds the engine idles; the test may change what it reads
    (a fault file, the pool) or start other engines.
    """

    def __init__(self, proc: subprocess.Popen, directory: Path, result_path: Path, log_path: Path) -> None:
        self.proc, self.directory, self.result_path, self.log_path = proc, directory, result_path, log_path
        self.rounds = 0
        self._totals: dict = {"aio": {}, "preemptions": 0, "recomputed_after_preemption": 0}
        self._log_tail = LogTail(log_path)
        self.workers: list[dict] = []

    def round(self, prompts: list[list[int]], *, priorities: list[int] | None = None,
              reset_prefix_cache: bool = False, timeout: float = 300) -> Round:
        order = {"prompts": prompts, "priorities": priorities, "reset_prefix_cache": reset_prefix_cache}
        out = self.directory / f"round-{self.rounds}.out.json"
        _write_json(self.directory / f"round-{self.rounds}.json", order)
        self.rounds += 1
        self._wait(out.exists, timeout, f"round {self.rounds - 1}")
        reply = json.loads(out.read_text())
        previous, self._totals = self._totals, {key: reply[key] for key in self._totals}
        return Round(reply["results"],
                     {name: value - previous["aio"].get(name, 0) for name, value in reply["aio"].items()},
                     reply["preemptions"] - previous["preemptions"],
                     reply["recomputed_after_preemption"] - previous["recomputed_after_preemption"],
                     self._log_tail.read_new())

    @property
    def log(self) -> str:
        """Everything the engine logged so far."""
        return self.log_path.read_text(errors="replace")

    @property
    def totals(self) -> dict:
        """The connector's counters since start (``aio``), and vLLM's preemption figures."""
        return self._totals

    def close(self, timeout: float = 120) -> None:
        """Stop the engine: it must exit cleanly (its pool and threads shut down)."""
        if self.proc.poll() is None:
            (self.directory / "stop").touch()
            try:
                self._wait(lambda: False, timeout, "shutdown", exit_expected=True)
            finally:
                self.kill()
        assert self.proc.returncode == 0, f"engine failed ({self.log_path}):\n{self.log[-4000:]}"
        self.workers = json.loads(self.result_path.read_text())["workers"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def _wait(self, done: Callable[[], bool], timeout: float, what: str, exit_expected: bool = False) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if self.proc.poll() is not None:
                if exit_expected:
                    return
                raise AssertionError(f"engine failed ({self.log_path}):\n{self.log[-4000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"engine {what} timed out ({self.log_path})")
            time.sleep(0.02)


class ForkedEngine:
    """An engine process the zygote forked, as much of ``subprocess.Popen`` as ``LiveEngine`` uses."""

    def __init__(self, pid: int, rc_path: Path) -> None:
        self.pid, self.rc_path, self.returncode = pid, rc_path, None

    def poll(self) -> int | None:
        if self.returncode is None and self.rc_path.exists():
            self.returncode = int(self.rc_path.read_text())
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.pid} did not exit")
            time.sleep(0.02)
        return self.returncode


@dataclass
class Zygote:
    """``engine_zygote.py``, started once per test process with the engines' usual environment."""

    proc: subprocess.Popen
    spool: Path

    def fork(self, argv: list[str], env: dict[str, str], log: Path) -> ForkedEngine:
        name = uuid.uuid4().hex
        log.touch()
        _write_json(self.spool / f"{name}.json", {"argv": argv, "env": env, "log": str(log), "cwd": os.getcwd()})
        pid_path = self.spool / f"{name}.pid"
        deadline = time.monotonic() + 120
        while not pid_path.exists():
            assert self.proc.poll() is None, f"the engine zygote exited ({self.spool / 'zygote.log'})"
            assert time.monotonic() < deadline, f"the engine zygote did not fork ({self.spool / 'zygote.log'})"
            time.sleep(0.02)
        return ForkedEngine(int(pid_path.read_text()), self.spool / f"{name}.rc")


@functools.cache
def _zygote() -> Zygote:
    spool = Path(tempfile.mkdtemp(prefix="aio-zygote-"))
    with open(spool / "zygote.log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(ZYGOTE), str(spool)], env=engine_env({}, None), stdout=log,
                                stderr=subprocess.STDOUT)
    atexit.register(shutil.rmtree, spool, ignore_errors=True)
    atexit.register(proc.kill)  # atexit runs last in, first out: the kill first
    return Zygote(proc, spool)


def _write_json(path: Path, value: dict) -> None:
    """Whole or not at all: the engine polls for the name."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(value))
    temporary.rename(path)


@dataclass
class Engine:
    """Starts real vLLM engines, each in a process of its own."""

    model: Path
    workdir: Path

    def start(self, kv_transfer_config: dict | None = None, env: dict[str, str] | None = None,
              **spec) -> LiveEngine:
        """An engine of this configuration, idle until its first round."""
        name = uuid.uuid4().hex[:8]
        directory = self.workdir / f"{name}.rounds"
        directory.mkdir()
        spec_path, result_path = self.workdir / f"{name}.json", self.workdir / f"{name}.out.json"
        log_path = self.workdir / f"{name}.log"
        spec_path.write_text(json.dumps(
            {"model": str(self.model), "kv_transfer_config": kv_transfer_config, "rounds_dir": str(directory), **spec}
        ))
        full_env = engine_env(spec, env)
        argv = [str(spec_path), str(result_path)]
        if serves(engine_env({}, None), full_env):
            proc = _zygote().fork(argv, full_env, log_path)
        else:
            with open(log_path, "w") as log:
                proc = subprocess.Popen([sys.executable, str(RUNNER), *argv], env=full_env, stdout=log,
                                        stderr=subprocess.STDOUT)
        return LiveEngine(proc, directory, result_path, log_path)

    def run(self, rounds: list[list[list[int]]], kv_transfer_config: dict | None = None,
            env: dict[str, str] | None = None, timeout: float = 300,
            between_rounds: Callable[[int], None] | None = None, priorities: list[list[int]] | None = None,
            reset_prefix_cache_between_rounds: bool = False, **spec) -> list[list[dict]]:
        """Generate each round's prompts in one engine, then stop it; ``between_rounds(i)`` runs in
        the test, with the engine idle, before round ``i`` (i >= 1)."""
        live = self.start(kv_transfer_config, env, **spec)
        deadline = time.monotonic() + timeout
        try:
            results = []
            for i, prompts in enumerate(rounds):
                if i and between_rounds:
                    between_rounds(i)
                results.append(live.round(prompts, priorities=priorities[i] if priorities else None,
                                          reset_prefix_cache=bool(i) and reset_prefix_cache_between_rounds,
                                          timeout=max(1.0, deadline - time.monotonic())).results)
            live.close(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            live.kill()
            self.last_log = live.log
        totals = live.totals
        self.last_preemptions = totals["preemptions"]
        self.last_recomputed_after_preemption = totals["recomputed_after_preemption"]
        self.last_counters = totals["aio"]
        self.last_workers = live.workers  # per worker process: pid, amx_tiles, attention (kernel names)
        return results
