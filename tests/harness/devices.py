"""The devices the device-path tests run on: the CPU, CUDA where present, and an Ascend NPU.

NPU cases are always collected and carry the ``npu`` marker: without an NPU
they skip, and with ``VLLM_AIO_REQUIRE_NPU=1`` (the NPU workflow) they fail
instead (``conftest.pytest_runtest_setup``). ``torch.device("npu")`` exists
only once torch_npu is imported, which that hook does, so the tests build
NPU devices from the name inside their bodies.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

CUDA = ["cuda"] if torch.cuda.is_available() else []


def marks(device: str) -> list[pytest.MarkDecorator]:
    """The marks of a device case (``device`` may carry a path suffix such as ``+direct``)."""
    return [pytest.mark.npu] if device.partition("+")[0] == "npu" else []


def params(*devices: str) -> list:
    """``devices`` as parameters, each with its marks."""
    return [pytest.param(d, marks=marks(d), id=d) for d in devices]


def registered(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is registered with the driver (torch's is_pinned knows only its own allocator).

    Asked through the driver API: a failing runtime call (a cudaHostRegister
    probe of registered memory) would leave an error that the next kernel
    launch raises.
    """
    if not torch.cuda.is_available():
        return False
    torch.cuda.init()  # the primary context, current on this thread
    flags = ctypes.c_uint()
    return ctypes.CDLL("libcuda.so.1").cuMemHostGetFlags(ctypes.byref(flags), ctypes.c_void_p(t.data_ptr())) == 0
