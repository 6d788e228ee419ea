"""A segment: one contiguous run of memory, named by its address and its size in bytes.

The block layout (``block_layout.py``) describes a block's bytes as segments, and
every backend copies between segments and its own memory (``backends/base.py``).
Plain Python, no torch: the scheduler half imports the backend contract.
"""

from __future__ import annotations

Segment = tuple[int, int]  # (address, size in bytes)
