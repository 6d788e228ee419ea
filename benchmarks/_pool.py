"""The embedded pool as the benchmarks use it: where it lives, whose values it holds, checked statuses."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from vllm_aio.backends import Status
from vllm_aio.pool import shm_file
from vllm_aio.pool.entry import EntryHeader

GiB = 1 << 30


def header(block_size: int) -> EntryHeader:
    """The entry header of one rank's values (the layer field is set per unit by BlockIO)."""
    return EntryHeader("0123456789abcdef", "pp0.dcp0.h0", -1, block_size, 0)


def free_bytes(directory: Path | None = None) -> int:
    st = os.statvfs(directory or shm_file.SHM_DIR)
    return st.f_bavail * st.f_frsize


def use_pool_dir(directory: Path) -> None:
    """Create the pools of this process in ``directory`` (a tmpfs, ideally) instead of /dev/shm.

    This patches ``vllm_aio.pool.shm_file.SHM_DIR`` (read at call time by
    every pool path, lock and space check): neither ``SharedHostPool`` nor
    ``LocalBackend`` takes a directory.
    """
    shm_file.SHM_DIR = Path(directory)


def pool_dir_for(need: int) -> Path:
    """/dev/shm when it has room for a pool of ``need`` bytes, else the temp dir (a disk-backed mapping)."""
    for d in (shm_file.SHM_DIR, Path(tempfile.gettempdir())):
        if free_bytes(d) > need * 1.1 + (64 << 20):
            use_pool_dir(d)
            return d
    raise SystemExit(f"no room for a {need / GiB:.2f} GiB pool in {shm_file.SHM_DIR} nor {tempfile.gettempdir()}")


def expect(statuses: Sequence[Status], want: Status, what: str) -> None:
    bad = [s for s in statuses if s is not want]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} of {len(statuses)} returned {bad[0]} (want {want})")
