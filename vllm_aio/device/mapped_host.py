"""Host memory mapped for the device's kernels (``Device.map_host``), and the one mapping of a range its users share.

``MappedHost`` is the mapped memory as a uint8 tensor on the device, valid until
``release`` (or garbage collection) unmaps it. A driver registers a range once per
process, so ``shared_mapping`` keeps one registration per range and device for all
its users (a test's saver and loader over one pool), made by the caller's
device-specific ``make`` (CUDA's in ``accelerator.py``, the NPU's in
``npu_host_map.py``) and undone by the last ``release``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

from vllm_aio.log import get_logger

logger = get_logger(__name__)


class MappedHost:
    """Host memory mapped for the device (``Device.map_host``): ``tensor``, valid until ``release``.

    ``release`` must come after the device's last copy from or to it (it
    synchronizes the device first) and before the host memory is unmapped.
    """

    def __init__(self, tensor: torch.Tensor, unmap: Callable[[], None] | None = None) -> None:
        self.tensor: torch.Tensor | None = tensor
        # Garbage collection unmaps too: a registration outliving its memory
        # would refuse the next mapping placed at that address.
        self._finalizer = weakref.finalize(self, unregister_quietly, tensor, unmap) if unmap else None
        if self._finalizer is not None:
            self._finalizer.atexit = False

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs at most once
        self.tensor = None


# (address, bytes, device) -> [view, unmap, users]: a driver registers a range once per process,
# and several users in one process (a test's saver and loader over one pool) share it.
_mapped: dict[tuple[int, int, str], list] = {}
_mapped_lock = threading.Lock()


def shared_mapping(address: int, nbytes: int, device: torch.device,
                   make: Callable[[], tuple[torch.Tensor, Callable[[], None]] | None]) -> MappedHost | None:
    """The range mapped for ``device`` once for all its users: ``make()`` registers it (the device
    view and what unregisters it, or None where refused); the last ``release`` unregisters."""
    region = (address, nbytes, str(device))
    with _mapped_lock:
        entry = _mapped.get(region)
        if entry is None:
            made = make()
            if made is None:
                return None
            entry = _mapped[region] = [*made, 0]
        entry[2] += 1

    def unmap() -> None:
        with _mapped_lock:
            entry[2] -= 1
            if entry[2]:
                return
            del _mapped[region]
        entry[1]()

    return MappedHost(entry[0], unmap)


def unregister_quietly(tensor: torch.Tensor, unregister: Callable[[], None]) -> None:
    """Undo a registration of ``tensor``'s host memory from a finalizer: a failure is logged, never raised.

    ``tensor`` is an argument so the memory outlives its registration.
    """
    try:
        unregister()
    except Exception as exc:  # a finalizer must not raise; the process goes on
        logger.warning("vllm_aio: unregistering %d bytes of host memory failed: %s", tensor.nbytes, exc)
