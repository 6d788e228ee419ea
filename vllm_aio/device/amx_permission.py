"""The AMX tile permission that vLLM's CPU attention needs and never asks for.

Linux gives a process the AMX tile state (xstate component 18, XTILEDATA) only
after it asks with ``arch_prctl(ARCH_REQ_XCOMP_PERM, 18)``; a tile instruction
before that raises SIGILL. On CPUs with AMX, vLLM's CPU attention runs AMX
kernels for bf16 KV in blocks of a multiple of 32 tokens, and they never ask:
the only request in vLLM's extension sits in its bundled oneDNN, which a GEMM
reaches on steps of 5 or more tokens. An ``--enforce-eager`` engine (no
warm-up) whose first step is smaller dies. With this connector that is the
common case, not the rare one: a request served from the pool, or moved in by
migration, starts with one new token. So the worker asks at start; the
permission is the process's, for every thread it has or starts.

No torch here: the syscall goes through libc, and tests hand in a stand-in.
"""

from __future__ import annotations

import ctypes
import enum
import os
import platform
from dataclasses import dataclass
from typing import Protocol

from vllm_aio.log import get_logger

logger = get_logger(__name__)

SYS_ARCH_PRCTL = 158  # x86_64's syscall number
ARCH_GET_XCOMP_SUPP = 0x1021  # the xstate components the CPU and kernel support
ARCH_GET_XCOMP_PERM = 0x1022  # the ones this process may use
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
TILE_BIT = 1 << XFEATURE_XTILEDATA


class ArchPrctl(Protocol):
    """The two ``arch_prctl`` calls asked of the kernel; both raise ``OSError`` on failure."""

    def mask(self, code: int) -> int: ...

    def request(self, feature: int) -> None: ...


class LibcArchPrctl:
    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)

    def mask(self, code: int) -> int:
        value = ctypes.c_ulong(0)
        self._check(self._libc.syscall(SYS_ARCH_PRCTL, code, ctypes.byref(value)))
        return value.value

    def request(self, feature: int) -> None:
        self._check(self._libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, ctypes.c_ulong(feature)))

    @staticmethod
    def _check(result: int) -> None:
        if result != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))


class Amx(enum.Enum):
    ABSENT = "absent"  # no AMX on this CPU, or a kernel that cannot hand it out: nothing to ask
    HELD = "held"  # the process had it already (oneDNN or torch asked first)
    GRANTED = "granted"  # asked now, given
    REFUSED = "refused"


@dataclass(frozen=True)
class AmxPermission:
    state: Amx
    reason: str = ""

    @property
    def usable(self) -> bool:
        return self.state in (Amx.HELD, Amx.GRANTED)


def request_amx_permission(prctl: ArchPrctl | None = None, machine: str | None = None) -> AmxPermission:
    """Ask for the AMX tile state where the CPU has it; say what came of it."""
    machine = machine or platform.machine()
    if machine != "x86_64":
        return AmxPermission(Amx.ABSENT, f"not an x86-64 CPU ({machine})")
    prctl = prctl or LibcArchPrctl()
    try:
        supported = prctl.mask(ARCH_GET_XCOMP_SUPP)
    except OSError as exc:  # EINVAL: a kernel before 5.16, which hands out no AMX
        return AmxPermission(Amx.ABSENT, f"the kernel has no dynamic xstate permissions ({exc.strerror})")
    if not supported & TILE_BIT:
        return AmxPermission(Amx.ABSENT, "the CPU has no AMX tiles")
    try:
        if prctl.mask(ARCH_GET_XCOMP_PERM) & TILE_BIT:
            return AmxPermission(Amx.HELD)
        prctl.request(XFEATURE_XTILEDATA)
    except OSError as exc:  # e.g. ENOSPC: the signal stack is too small for the tile state
        return AmxPermission(Amx.REFUSED, f"arch_prctl(ARCH_REQ_XCOMP_PERM): {exc.strerror}")
    return AmxPermission(Amx.GRANTED)


def ensure_amx_for_cpu_attention(prctl: ArchPrctl | None = None, machine: str | None = None) -> AmxPermission:
    """``request_amx_permission``, with one log line when something was done or went wrong."""
    permission = request_amx_permission(prctl, machine)
    if permission.state is Amx.GRANTED:
        logger.info("vllm_aio: AMX tile permission requested for worker process %d: vLLM's AMX attention "
                    "kernels use the tiles without asking (a first step under 5 tokens would die with SIGILL)",
                    os.getpid())
    elif permission.state is Amx.REFUSED:
        logger.warning("vllm_aio: AMX tile permission refused for worker process %d (%s): vLLM's AMX attention "
                       "kernels may die with SIGILL on a step under 5 tokens; --dtype float32 keeps them off",
                       os.getpid(), permission.reason)
    return permission
