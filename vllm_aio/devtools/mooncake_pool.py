"""A development Mooncake pool on loopback: one master plus one memory owner.

Why a separate memory owner: Mooncake keeps each value in the segment of the
client that contributed the memory, and the value vanishes when that client
closes. Engines therefore run with ``global_segment_size = 0`` and a standalone
``mooncake_client`` (shipped in the mooncake wheel) owns the pool, so cached
blocks outlive engine restarts. Used by ``vllm-aio serve-mooncake``, the tests,
the examples and the benchmarks.

Every port is chosen free on 127.0.0.1 unless given (two masters on default
ports collide), the master's HTTP metadata server stays off (it fails to start
here; engines use ``P2PHANDSHAKE``), and the children get SIGTERM when this
process dies, so a crashed test run leaves no pool behind.

Linux sends that signal when the *thread* that forked a child ends, not the
process: a master restarted from a load's client thread died with the thread,
at the end of the load. So every child is forked by one thread the pool owns,
which lives from ``start`` to ``stop``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vllm_aio.config import parse_size
from vllm_aio.errors import ConfigError

HOST = "127.0.0.1"
INSTALL_HINT = "pip install 'vllm_aio[mooncake]'"
MIN_SIZE = 16 << 20  # mooncake_client refuses smaller segments
# Seconds the master keeps a client, and the memory it owns, after its last
# heartbeat (mooncake_master --client_ttl, default 10). With two TP workers on
# a 2-core machine the 10 s lease ran out and the pool was lost (calls failed
# with -707), so a development pool waits longer; master_args can override it.
CLIENT_TTL = 60


class PoolError(RuntimeError):
    """The pool's processes could not be found or started."""


def find_binary(name: str) -> str:
    """Path of ``mooncake_master`` / ``mooncake_client``: in the wheel, else on PATH."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / name
        if path.is_file():
            if not os.access(path, os.X_OK):
                path.chmod(path.stat().st_mode | 0o111)
            return str(path)
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found:
        return found
    raise PoolError(f"{name} not found in the mooncake package or on PATH; install it with {INSTALL_HINT}")


def free_port() -> int:
    """A TCP port free on loopback now (another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_open(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=timeout):
            return True
    except OSError:
        return False


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the parent thread ends (Linux prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class MooncakePool:
    """``mooncake_master`` + a memory-owning ``mooncake_client``, both on loopback.

    >>> with MooncakePool(size="1GB") as pool:
    ...     backend = MooncakeBackend(MooncakeSettings.load(pool.config))
    """

    def __init__(
        self,
        size: int | str = "1GB",
        *,
        rpc_port: int | None = None,
        metrics_port: int | None = None,
        client_port: int | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        master_args: tuple[str, ...] = (),
        start_timeout: float = 15.0,
    ) -> None:
        self.size = parse_size("size", size)
        if self.size < MIN_SIZE:
            raise ConfigError(f"size: mooncake_client needs at least 16MB, got {size!r}")
        self.rpc_port = rpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.client_port = client_port or free_port()
        # Logs go to log_dir, kept; else to a temp dir removed by stop().
        self._temp_logs = log_dir is None
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="mooncake-pool-"))
        self.master_args = master_args
        self.start_timeout = start_timeout
        self.master: subprocess.Popen[bytes] | None = None
        self.client: subprocess.Popen[bytes] | None = None
        self._forker: ThreadPoolExecutor | None = None  # the thread the children are tied to

    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def config(self) -> dict[str, Any]:
        """What an engine needs (a ``MOONCAKE_CONFIG_PATH`` file's content)."""
        return {
            "local_hostname": HOST,
            "metadata_server": "P2PHANDSHAKE",
            "master_server_address": self.master_address,
            "protocol": "tcp",
            "device_name": "",
            "global_segment_size": 0,
            "local_buffer_size": 16 << 20,
        }

    def start(self) -> MooncakePool:
        self._forker = ThreadPoolExecutor(1, thread_name_prefix="mooncake-pool")
        try:
            self.master = self._spawn("master", [find_binary("mooncake_master"), *self._master_argv()])
            self._wait_listening(self.master, "master", self.rpc_port)
            self.client = self._spawn("client", [find_binary("mooncake_client"), *self._client_argv()])
            self._wait_listening(self.client, "client", self.client_port)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the client, then the master; SIGKILL what outlives ``timeout``."""
        for proc in (self.client, self.master):
            _terminate(proc, timeout)
        if self._forker is not None:
            self._forker.shutdown()
            self._forker = None
        if self._temp_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def kill_master(self) -> None:
        """SIGKILL the master (fault injection in tests)."""
        if self.master and self.master.poll() is None:
            self.master.kill()
            self.master.wait()

    def restart_master(self) -> None:
        """Start the master again on its port, after ``kill_master`` (clients reconnect by themselves)."""
        self.master = self._spawn("master", [find_binary("mooncake_master"), *self._master_argv()])
        self._wait_listening(self.master, "master", self.rpc_port)

    def kill_client(self) -> None:
        """SIGKILL the memory owner (fault injection in tests)."""
        if self.client and self.client.poll() is None:
            self.client.kill()
            self.client.wait()

    def alive(self) -> bool:
        return all(p is not None and p.poll() is None for p in (self.master, self.client))

    def __enter__(self) -> MooncakePool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _master_argv(self) -> list[str]:
        return [
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={HOST}",
            f"--metrics_port={self.metrics_port}",
            f"--metrics_host={HOST}",
            "--enable_http_metadata_server=false",
            f"--client_ttl={CLIENT_TTL}",
            *self.master_args,
        ]

    def _client_argv(self) -> list[str]:
        return [
            f"--master_server_address={self.master_address}",
            "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp",
            f"--global_segment_size={self.size}",
            f"--host={HOST}",
            f"--port={self.client_port}",
        ]

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        if self._forker is None:
            raise PoolError(f"mooncake {name}: the pool is not started")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as log:
            return self._forker.submit(
                subprocess.Popen, argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent,
            ).result()

    def _wait_listening(self, proc: subprocess.Popen[bytes], name: str, port: int) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise PoolError(f"mooncake {name} exited with code {proc.returncode}:\n{self._log_tail(name)}")
            if port_open(port):
                return
            time.sleep(0.05)
        raise PoolError(f"mooncake {name} not listening on {HOST}:{port} after {self.start_timeout:.0f} s:\n"
                        f"{self._log_tail(name)}")

    def _log_tail(self, name: str, lines: int = 20) -> str:
        try:
            return "\n".join((self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _terminate(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
