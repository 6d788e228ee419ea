"""A pool shared by name freed once every process attached to it has ended, however they ended.

The last process to detach unlinks a shared pool, but vLLM's ordinary stop (SIGTERM or Ctrl-C
without ``--shutdown-timeout``) ends the engine's processes before the connector's shutdown runs,
and SIGKILL always does: the pool's memory would stay in ``/dev/shm``. So every process that opens
a shared pool makes sure a reaper watches it: a small process of its own session, orphaned at
start (vLLM's shutdown kills its processes' children, however deep), one per pool (it holds an
``flock`` on the pool's file), that looks at the pool's pid table every ``POLL_S`` and frees the
pool once none of its processes is alive, saying so in one line on the stderr it inherited (the
server's log). It leaves as soon as the pool is gone.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

from vllm_aio.pool.shm_file import free_if_abandoned, open_private, pool_path

POLL_S = 1.0


def watch(name: str) -> None:
    """Start pool ``name``'s reaper (it leaves at once where one watches the pool already)."""
    # Through a shell that backgrounds it and exits: the reaper is nobody's child by the time vLLM
    # kills its processes' trees.
    subprocess.run(["/bin/sh", "-c", '"$0" -m vllm_aio.pool.reaper "$1" &', sys.executable, name],
                   start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True)


def reap(name: str) -> None:
    """Watch pool ``name`` until it is gone, freeing it once its processes have all ended."""
    try:
        fd = open_private(pool_path(name), os.O_RDONLY)
    except (FileNotFoundError, RuntimeError):  # gone already, or not one of ours
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another reaper watches it
        os.close(fd)
        return
    try:
        while _still(fd, name):
            if (pids := free_if_abandoned(name)) is not None:
                _say(f"vllm_aio: freed the embedded pool {name!r} ({pool_path(name)}): every process attached "
                     f"to it ({', '.join(map(str, pids))}) ended without detaching")
                return
            time.sleep(POLL_S)
    finally:
        os.close(fd)


def _still(fd: int, name: str) -> bool:
    """Whether the pool at the name is still the one ``fd`` watches."""
    try:
        return os.stat(pool_path(name)).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:  # the server's log went with it
        pass


if __name__ == "__main__":
    reap(sys.argv[1])
