"""Plumbing shared by the torch-only GPU benchmarks (layer_pipeline, dynamic_buffer, block_io_device).

Streams and events through torch's accelerator API; on the CPU everything runs
synchronously and wall-clock stand-ins replace the events, so ``--device cpu``
works as a smoke test.
"""

from __future__ import annotations

import contextlib
import platform
import statistics
import time

import torch


class _WallEvent:
    """CPU stand-in for torch.Event: everything ran synchronously, so the wall clock is the timeline."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "_WallEvent") -> float:
        return (end.t - self.t) * 1e3


class Accel:
    """Streams and events through torch's accelerator API; on CPU no streams and wall-clock events."""

    HELP = "auto (the current accelerator, else cpu), cuda, cpu, ..."

    def __init__(self, name: str) -> None:
        if name == "auto":
            acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            name = acc.type if acc is not None else "cpu"
        dev = torch.device(name)
        if dev.type != "cpu" and dev.index is None:
            dev = torch.device(dev.type, torch.accelerator.current_device_index())
        self.device = dev
        self.is_async = dev.type != "cpu"

    def describe(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return f"{self.device.type} ({platform.processor() or platform.machine()})"

    def stream(self, priority: int = 0):
        return torch.Stream(device=self.device, priority=priority) if self.is_async else None

    def current_stream(self):
        return torch.accelerator.current_stream(self.device) if self.is_async else None

    @contextlib.contextmanager
    def on(self, stream):
        if stream is None:
            yield
            return
        prev = torch.accelerator.current_stream(self.device)
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(prev)

    def event(self, timing: bool = False):
        return torch.Event(self.device, enable_timing=timing) if self.is_async else _WallEvent()

    def record(self, event, stream) -> None:
        event.record(stream) if self.is_async else event.record()

    def wait(self, stream, event) -> None:
        if self.is_async:
            stream.wait_event(event)

    def sync(self) -> None:
        if self.is_async:
            torch.accelerator.synchronize(self.device)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.is_async)

    def attention_backends(self):
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel  # never the O(n^2)-memory math kernel
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def wall(acc: Accel, fn) -> float:
    """Seconds of ``fn()`` on the host clock, the device idle before and drained after."""
    acc.sync()
    start = time.perf_counter()
    fn()
    acc.sync()
    return time.perf_counter() - start


def timed(acc: Accel, enqueue) -> float:
    """ms from a start event on the compute stream to an end event after ``enqueue(start)``."""
    acc.sync()
    start, end = acc.event(True), acc.event(True)
    comp = acc.current_stream()
    acc.record(start, comp)
    enqueue(start)
    acc.record(end, comp)
    acc.sync()
    return start.elapsed_time(end)


def copy_bandwidth(acc: Accel, host: torch.Tensor, nbytes: int, reps: int = 5) -> dict:
    """GB/s of one large pinned copy each way, median of ``reps``."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=acc.device)
    src = host[:nbytes]
    out = {}
    for name, dst, s in (("h2d", dev, src), ("d2h", src, dev)):
        samples = []
        for _ in range(reps + 1):
            samples.append(timed(acc, lambda _s, dst=dst, s=s: dst.copy_(s, non_blocking=True)))
        out[f"{name}_GBps"] = nbytes / (statistics.median(samples[1:]) * 1e-3) / 1e9
    del dev
    return out
