"""Real ``vllm serve`` processes for the end-to-end tests that need vLLM's OpenAI server.

Built on ``vllm_aio.devtools.serve`` (what the benchmarks and examples start servers with): ``serve``
starts one and waits until it is healthy, ``Servers`` starts several at once and waits for them
together (on 2 cores a start takes about a minute; in parallel the total grows less than the count).
Each server runs in a process group of its own, so a test can kill one outright (``Server.kill``) the
way a crashed instance dies, or stop it as a user does (``Server.terminate``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.engines import EAGER, THREADS
from vllm_aio.devtools.serve import free_port, vllm_server, wait_healthy

# The migration routes are an endpoint plugin: VLLM_PLUGINS must name it, and
# then also our general plugins (it is the allowlist of every plugin group).
PLUGINS = "vllm_aio_buffer_plan,vllm_aio_connector,vllm_aio_migration"
# float32: a moved request's continuation attends over KV written by the source's decodes where the
# unmigrated run's own decodes wrote it, recomputed in part; in bf16 such rounding parts greedy
# tokens of this random model at near ties as often as a wrong byte would (LOGPROB_TOLERANCE).
SERVER_ARGS = ["--block-size", "32", "--max-model-len", "4096", "--enforce-eager", "--no-enable-prefix-caching",
               "--enable-prompt-tokens-details", "--dtype", "float32"]
STARTUP_S = 420.0


@dataclass
class Server:
    """A started ``vllm serve``: its base URL, process (the group's leader) and log."""

    name: str
    url: str
    proc: subprocess.Popen
    log: Path

    def kill(self) -> None:
        """SIGKILL the whole instance (API server, engine core, workers): a crash."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def terminate(self, timeout: float = 120) -> int:
        """SIGTERM the API server alone, as a user stops it; its exit code (what is left is killed on exit)."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


@contextlib.contextmanager
def serve(model: Path, log: Path, args: Sequence[str] = (), kv_transfer_config: dict | None = None,
          env: Mapping[str, str] | None = None, startup_s: float = STARTUP_S, name: str = "server"
          ) -> Iterator[Server]:
    """``vllm serve model`` on a free port, healthy when yielded; stopped (and its group killed) on exit."""
    port = free_port()
    with vllm_server(str(model), port, log, args, kv_transfer_config, env) as proc:
        server = Server(name, f"http://127.0.0.1:{port}", proc, log)
        wait_healthy(proc, server.url, log, startup_s)
        yield server


@dataclass
class Servers:
    """Several servers of one model, started together (the migration tests' instances)."""

    model: Path
    workdir: Path
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def start(self, specs: dict[str, dict], args: dict[str, list[str]] | None = None) -> dict[str, Server]:
        """Start one server per ``name -> kv_transfer_config`` and wait until all are healthy;
        ``args[name]`` adds to (or, for a flag given twice, overrides) SERVER_ARGS."""
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0", "VLLM_PLUGINS": PLUGINS, **THREADS, **EAGER}
        servers = {}
        for name, config in specs.items():
            port, log = free_port(), self.workdir / f"{name}.log"
            server_args = SERVER_ARGS + (args or {}).get(name, [])
            proc = self.stack.enter_context(vllm_server(str(self.model), port, log, server_args, config, env))
            servers[name] = Server(name, f"http://127.0.0.1:{port}", proc, log)
        for server in servers.values():
            wait_healthy(server.proc, server.url, server.log, STARTUP_S)
        return servers

    def close(self) -> None:
        self.stack.close()
