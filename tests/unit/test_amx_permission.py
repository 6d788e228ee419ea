"""The AMX tile permission the worker asks for (``vllm_aio/device/amx_permission.py``).

Against a stand-in for ``arch_prctl`` on every machine, and against the real
syscall in a fresh interpreter: on a CPU with AMX the process holds the
permission afterwards, elsewhere nothing is asked.
"""

from __future__ import annotations

import errno
import json
import logging
import platform
import subprocess
import sys

import pytest

from harness.prerequisites import ROOT
from vllm_aio.device.amx_permission import (
    ARCH_GET_XCOMP_PERM,
    ARCH_GET_XCOMP_SUPP,
    TILE_BIT,
    XFEATURE_XTILEDATA,
    Amx,
    ensure_amx_for_cpu_attention,
    request_amx_permission,
)

BASE = 0x2E7  # x87, SSE, AVX and AVX-512 state: what every process holds


class StandIn:
    """``arch_prctl`` as a kernel with (or without) AMX would answer it; records the requests."""

    def __init__(self, supported: int = BASE | TILE_BIT, permitted: int = BASE, refuse: int | None = None,
                 unsupported_call: bool = False) -> None:
        self.supported, self.permitted = supported, permitted
        self.refuse, self.unsupported_call = refuse, unsupported_call
        self.requests: list[int] = []

    def mask(self, code: int) -> int:
        if self.unsupported_call:
            raise OSError(errno.EINVAL, "Invalid argument")
        return {ARCH_GET_XCOMP_SUPP: self.supported, ARCH_GET_XCOMP_PERM: self.permitted}[code]

    def request(self, feature: int) -> None:
        self.requests.append(feature)
        if self.refuse is not None:
            raise OSError(self.refuse, "No space left on device")
        self.permitted |= 1 << feature


def test_the_tile_permission_is_requested_where_the_cpu_has_amx():
    kernel = StandIn()
    permission = request_amx_permission(kernel, machine="x86_64")
    assert permission.state is Amx.GRANTED and permission.usable
    assert kernel.requests == [XFEATURE_XTILEDATA] and kernel.permitted & TILE_BIT


def test_a_held_permission_is_not_requested_again():
    kernel = StandIn(permitted=BASE | TILE_BIT)
    assert request_amx_permission(kernel, machine="x86_64").state is Amx.HELD
    assert kernel.requests == []


def test_nothing_is_requested_on_a_cpu_without_amx():
    kernel = StandIn(supported=BASE)
    permission = request_amx_permission(kernel, machine="x86_64")
    assert permission.state is Amx.ABSENT and "no AMX" in permission.reason
    assert kernel.requests == []


def test_a_kernel_without_dynamic_xstate_permissions_counts_as_no_amx():
    permission = request_amx_permission(StandIn(unsupported_call=True), machine="x86_64")
    assert permission.state is Amx.ABSENT and "Invalid argument" in permission.reason


def test_other_architectures_are_left_alone():
    kernel = StandIn()
    assert request_amx_permission(kernel, machine="aarch64").state is Amx.ABSENT
    assert kernel.requests == []


def test_a_refused_request_is_one_warning_naming_the_reason(caplog):
    with caplog.at_level(logging.INFO, logger="vllm"):
        permission = ensure_amx_for_cpu_attention(StandIn(refuse=errno.ENOSPC), machine="x86_64")
    assert permission.state is Amx.REFUSED and not permission.usable
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "refused" in record.getMessage() and "No space left on device" in record.getMessage()


def test_a_granted_request_is_said_once(caplog):
    with caplog.at_level(logging.INFO, logger="vllm"):
        ensure_amx_for_cpu_attention(StandIn(), machine="x86_64")
    (record,) = caplog.records
    assert record.levelno == logging.INFO and "AMX tile permission requested" in record.getMessage()


PROBE = """
import json
from vllm_aio.device.amx_permission import ARCH_GET_XCOMP_PERM, ARCH_GET_XCOMP_SUPP, TILE_BIT, LibcArchPrctl, \\
    request_amx_permission
kernel = LibcArchPrctl()
has_amx = bool(kernel.mask(ARCH_GET_XCOMP_SUPP) & TILE_BIT)
before = bool(kernel.mask(ARCH_GET_XCOMP_PERM) & TILE_BIT)
state = request_amx_permission().state.value
after = bool(kernel.mask(ARCH_GET_XCOMP_PERM) & TILE_BIT)
print(json.dumps({"has_amx": has_amx, "before": before, "state": state, "after": after}))
"""


def test_the_real_syscall_leaves_the_process_holding_the_permission_on_an_amx_cpu():
    if platform.machine() != "x86_64":
        pytest.skip("arch_prctl's xstate permissions are x86-64's")
    # A fresh interpreter that imports nothing else: no library has asked for the tiles before.
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    probe = json.loads(out.stdout)
    if probe["has_amx"]:
        assert probe == {"has_amx": True, "before": False, "state": "granted", "after": True}
    else:
        assert probe == {"has_amx": False, "before": False, "state": "absent", "after": False}
