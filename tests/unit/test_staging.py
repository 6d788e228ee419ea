"""Unit tests of ``vllm_aio.device.staging.StagingBuffer``: ring-wise slices of one host buffer."""

from __future__ import annotations

import threading

import pytest
import torch
from harness.devices import CUDA, params

from vllm_aio.device.accelerator import Device
from vllm_aio.device.staging import StagingBuffer


@pytest.fixture(params=params("cpu", *CUDA, "npu"))
def device(request) -> Device:
    """The ring behaves alike on every device's host buffer (page-locked on accelerators)."""
    return Device(torch.device(request.param))


def test_slices_do_not_overlap_while_live(device):
    buf = StagingBuffer(device, 100)
    a, b, c = (buf.allocate(30, 0) for _ in range(3))
    assert [(s.start, s.end) for s in (a, b, c)] == [(0, 30), (30, 60), (60, 90)]
    assert buf.allocate(30, 0) is None


def test_released_space_is_reused_after_wrapping_around(device):
    buf = StagingBuffer(device, 100)
    a, b, c = (buf.allocate(30, 0) for _ in range(3))
    buf.release(a)
    d = buf.allocate(30, 0)
    assert (d.start, d.end) == (0, 30)
    assert buf.allocate(10, 0) is None  # [90, 100) is too small, [30, 60) still live


def test_out_of_order_release_frees_only_behind_the_oldest_live_slice(device):
    buf = StagingBuffer(device, 100)
    a, b = buf.allocate(50, 0), buf.allocate(50, 0)
    buf.release(b)
    assert buf.allocate(10, 0) is None
    buf.release(a)
    assert buf.allocate(100, 0).start == 0


def test_allocate_waits_for_a_release_and_gets_the_freed_space(device):
    buf = StagingBuffer(device, 100)
    a = buf.allocate(100, 0)
    waiting = threading.Thread(target=lambda: got.append(buf.allocate(60, 30.0)))
    got: list = []
    waiting.start()
    buf.release(a)  # the waiter wakes on the release, long before its 30 s bound
    waiting.join(30.0)
    assert got and got[0] is not None and got[0].start == 0


def test_allocate_gives_up_after_its_timeout_when_nothing_is_released(device):
    buf = StagingBuffer(device, 100)
    buf.allocate(100, 0)
    assert buf.allocate(60, 0.05) is None


def test_larger_than_the_buffer_is_refused_at_once(device):
    assert StagingBuffer(device, 100).allocate(101, 10.0) is None


def test_slice_tensor_views_its_bytes_of_the_buffer(device):
    buf = StagingBuffer(device, 100)
    buf.allocate(10, 0)
    s = buf.allocate(20, 0)
    s.tensor.fill_(7)
    assert s.address == buf.address + 10
    assert buf.buffer[10:30].eq(7).all()


class _Copy:
    """A stand-in device event: completes when told to, or when waited for."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_slice_released_after_a_copy_returns_once_the_copy_completes(device):
    buf = StagingBuffer(device, 100)
    a = buf.allocate(100, 0)
    copy = _Copy()
    buf.release(a, after=copy)
    copy.done = True
    assert buf.allocate(100, 0) is not None


def test_full_buffer_waits_for_the_oldest_copy_instead_of_timing_out(device):
    buf = StagingBuffer(device, 100)
    copy = _Copy()
    buf.release(buf.allocate(100, 0), after=copy)
    assert buf.allocate(100, 0) is not None  # Device.synchronize(copy) completed it
    assert copy.done


@pytest.mark.parametrize("name", params(*CUDA, "npu"))
def test_staging_on_an_accelerator_is_page_locked(name):
    assert StagingBuffer(Device(torch.device(name)), 100).buffer.is_pinned()
