"""A process that imports vLLM once and forks an engine process for each request.

An engine process spent 8 of its 12 s of start-up importing vLLM, and the suite starts dozens.
The zygote imports vLLM once per test worker, then forks: every engine is still a process of its
own, with its own environment, pool and exit, whose rounds ``engine_runner.py`` runs as it does
when started alone. Requests come through a spool directory, as the runner's rounds do:

- ``<id>.json``: the engine's argv (spec and result paths), environment, log path and directory;
- ``<id>.pid``: written by the zygote once it forked the engine;
- ``<id>.rc``: the engine's exit status once it ended (negative: killed by that signal).

What is read at import time (``IMPORT_TIME``) is the zygote's for every engine it forks: an
engine that needs another value of one starts as a fresh interpreter (``conftest.Engine``).
The zygote never starts a thread, and exits when the test worker that started it is gone.

    python engine_zygote.py SPOOL_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

# Read once, at interpreter start or by the libraries at import (OpenMP's thread count, TorchDynamo's
# switch, vLLM's logging set-up): an engine forked from the zygote keeps the zygote's values.
IMPORT_TIME = ("PYTHONHASHSEED", "PYTHONPATH", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "TORCHDYNAMO_DISABLE",
               "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH")


def serves(zygote_env: dict[str, str], engine_env: dict[str, str]) -> bool:
    """Whether an engine of ``engine_env`` may be forked from a zygote started with ``zygote_env``."""
    return all(zygote_env.get(key) == engine_env.get(key) for key in IMPORT_TIME)


def preload() -> None:
    """What every engine imports before its first round (engine_runner.run)."""
    import vllm.model_executor.models.llama  # noqa: F401
    import vllm.v1.engine.core  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.config import KVEventsConfig  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401
    from vllm.v1.metrics.reader import Counter  # noqa: F401


def serve(spool: Path) -> None:
    parent = os.getppid()
    children: dict[int, Path] = {}  # pid -> its request's path
    (spool / "ready").touch()
    while os.getppid() == parent:
        for request in sorted(spool.glob("*.json")):
            order = json.loads(request.read_text())
            request.rename(request.with_suffix(".taken"))
            pid = _fork_engine(order)
            children[pid] = request
            _write(request.with_suffix(".pid"), str(pid))
        _reap(children)
        time.sleep(0.02)


def _fork_engine(order: dict) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        log = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ.clear()
        os.environ.update(order["env"])
        os.chdir(order["cwd"])
        from harness import engine_runner

        engine_runner.main(*order["argv"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(children: dict[int, Path]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        request = children.pop(pid, None)
        if request is not None:
            _write(request.with_suffix(".rc"), str(os.waitstatus_to_exitcode(status)))


def _write(path: Path, text: str) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    temporary.rename(path)


if __name__ == "__main__":
    preload()
    serve(Path(sys.argv[1]))
