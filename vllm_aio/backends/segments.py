"""Copies between a value's scattered segments and one contiguous buffer."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from vllm_aio.backends.base import Segment


def total(segments: Sequence[Segment]) -> int:
    return sum(size for _, size in segments)


def gather(segments: Sequence[Segment], dst: int) -> None:
    """Copy the segments, in order, to the contiguous buffer at ``dst``."""
    for address, size in segments:
        ctypes.memmove(dst, address, size)
        dst += size


def scatter(src: int, segments: Sequence[Segment]) -> None:
    """Copy the contiguous buffer at ``src`` out to the segments, in order."""
    for address, size in segments:
        ctypes.memmove(address, src, size)
        src += size
