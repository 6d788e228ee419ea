"""Copies between a value's scattered segments and one contiguous buffer.

``gather`` and ``scatter`` copy one value on the calling thread, one
``ctypes.memmove`` per segment. A backend that copies a whole batch instead
flattens the batch's segment lists once (``FlatSegments``) and hands every
copy of it to ``host_copy.copy_many`` in one call: compiled loops on every
core, no Python per segment.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from vllm_aio.device.segment import Segment

Copies = tuple[np.ndarray, np.ndarray, np.ndarray]  # copy_many's arguments


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


@dataclass(frozen=True)
class FlatSegments:
    """A batch's per-value segment lists as int64 arrays, values back to back.

    Built in one pass over the lists (~70 ns a segment on batches of 2,048
    and 4,096) and holding no tuple per segment: a batch has thousands, and
    the cyclic garbage collector's full passes over such objects (tens of ms
    with torch loaded) would land mid-copy. Value i owns segments
    ``first[i]:first[i + 1]``; segment j starts ``offsets[j]`` bytes into the
    batch's segments counted back to back (``offsets[-1]``: their total).
    """

    address: np.ndarray
    size: np.ndarray
    first: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, segments: Sequence[Sequence[Segment]]) -> FlatSegments:
        counts = np.fromiter(map(len, segments), np.int64, len(segments))
        first = np.zeros(len(segments) + 1, np.int64)
        np.cumsum(counts, out=first[1:])
        flat = np.fromiter(chain.from_iterable(chain.from_iterable(segments)), np.int64, 2 * int(first[-1]))
        offsets = np.zeros(len(flat) // 2 + 1, np.int64)
        np.cumsum(flat[1::2], out=offsets[1:])
        return cls(flat[0::2], flat[1::2], first, offsets)

    def totals(self) -> np.ndarray:
        """Bytes of each value."""
        return self.offsets[self.first[1:]] - self.offsets[self.first[:-1]]

    def gather_copies(self, values: Sequence[int], dst: Sequence[int]) -> Copies:
        """``copy_many``'s (dst, src, size) gathering value ``values[k]`` to the contiguous buffer at ``dst[k]``."""
        return self._buffer_copies(values, dst)

    def scatter_copies(self, src: Sequence[int], values: Sequence[int]) -> Copies:
        """``copy_many``'s (dst, src, size) scattering the contiguous buffer at ``src[k]`` to value ``values[k]``."""
        buffer, segment, size = self._buffer_copies(values, src)
        return segment, buffer, size

    def _buffer_copies(self, values: Sequence[int], buffers: Sequence[int]) -> Copies:
        """(buffer address, segment address, size) of each segment of ``values``, each value laid out in its buffer."""
        values = np.asarray(values, np.int64)
        starts, counts = self.first[values], self.first[values + 1] - self.first[values]
        # The chosen segments' indices: each value's first, counting up through its own.
        shift = np.repeat(starts - (np.cumsum(counts) - counts), counts)
        chosen = shift + np.arange(len(shift))
        within = self.offsets[chosen] - np.repeat(self.offsets[starts], counts)  # where each lies in its value
        return np.repeat(np.asarray(buffers, np.int64), counts) + within, self.address[chosen], self.size[chosen]
