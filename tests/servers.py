"""Real ``vllm serve`` processes for end-to-end tests that need vLLM's OpenAI server (migration).

Several servers start at once and are waited for together (on 2 cores a start
takes about a minute; in parallel the total grows less than the count). Each
server runs in a process group of its own, so a test can kill one outright
(``kill``) the way a crashed instance dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from conftest import EAGER, THREADS
from vllm_aio.devtools.serve import free_port, vllm_server, wait_healthy

# The migration routes are an endpoint plugin: VLLM_PLUGINS must name it, and
# then also our general plugins (it is the allowlist of every plugin group).
PLUGINS = "vllm_aio_buffer_plan,vllm_aio_connector,vllm_aio_migration"
# float32: a moved request's continuation attends over KV written by the source's decodes where the
# unmigrated run's own decodes wrote it, recomputed in part; in bf16 such rounding parts greedy
# tokens of this random model at near ties as often as a wrong byte would (conftest.LOGPROB_TOLERANCE).
SERVER_ARGS = ["--block-size", "32", "--max-model-len", "4096", "--enforce-eager", "--no-enable-prefix-caching",
               "--enable-prompt-tokens-details", "--dtype", "float32"]
STARTUP_S = 420.0


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen
    log: Path

    def kill(self) -> None:
        """SIGKILL the whole instance (API server, engine core, workers): a crash."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@dataclass
class Servers:
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
