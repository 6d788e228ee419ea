"""A ``PeerLink`` in a process of its own serving a shared mapping: the far end of the transport tests and benchmark.

The region is a ``/dev/shm`` file that the starting process maps too, as an
instance's processes share its embedded pool: the caller reads (and fills)
what the peer's engine serves through ``TransferPeer.view`` without asking the
peer. The file is unlinked as soon as the peer has mapped it. The peer runs
until its stdin closes: ``close``, ``kill``, or the starting process's death.

    python -m vllm_aio.devtools.transfer_peer PATH SETTINGS_JSON   # the peer's side
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from vllm_aio.migration.transport import LinkSettings, PeerLink

ROOT = Path(__file__).resolve().parents[2]  # puts this checkout's vllm_aio first in the peer
LOOPBACK = LinkSettings(hostname="127.0.0.1")


class TransferPeer:
    """Starts the peer process; ``session_id`` and ``address`` say where its region is, ``view`` shows it."""

    def __init__(self, size: int, settings: LinkSettings = LOOPBACK, start_timeout: float = 30.0) -> None:
        path = Path("/dev/shm") / f"vllm_aio_peer.{uuid.uuid4().hex}"
        with open(path, "w+b") as f:
            f.truncate(size)
            self._mapping = mmap.mmap(f.fileno(), size)
        self.view = np.frombuffer(self._mapping, dtype=np.uint8)
        self._log = tempfile.TemporaryFile()  # the engine logs a lot to stderr: a pipe could fill and block it
        python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(path), json.dumps(dataclasses.asdict(settings))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                env={**os.environ, "PYTHONPATH": python_path},
            )
            info = self._read_info(time.monotonic() + start_timeout)
        finally:
            path.unlink()
        self.session_id: str = info["session_id"]
        self.address: int = info["address"]

    def _read_info(self, deadline: float) -> dict:
        stdout = self._proc.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = stdout.readline() if ready else b""
        if not line:
            self.kill()
            self._log.seek(0)
            tail = self._log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"transfer peer did not start (exit code {self._proc.returncode}):\n{tail}")
        return json.loads(line)

    def stop(self) -> None:
        """Freeze the peer (SIGSTOP): it accepts connections but answers nothing."""
        os.kill(self._proc.pid, signal.SIGSTOP)

    def kill(self) -> None:
        if self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGCONT)  # a stopped process dies only once continued
            self._proc.kill()
        self._proc.wait()

    def close(self, timeout: float = 10.0) -> None:
        """End the peer (it closes its engine, ~1 s); kill it past ``timeout``."""
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self._log.close()

    def __enter__(self) -> TransferPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str]) -> int:
    path, settings = argv
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 0)
    address = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
    link = PeerLink(LinkSettings(**json.loads(settings)), (address, len(mapping)))
    print(json.dumps({"session_id": link.session_id, "address": address}), flush=True)
    sys.stdin.read()  # until the starting process closes it or dies
    link.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
