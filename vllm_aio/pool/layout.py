"""Where everything lies in an embedded pool's file, and what its header counts.

    header | hash index (key -> slot) | per-slot metadata | block records | eviction log | slot data

Every region is an int64 array but the slot data, which starts on a page
boundary. The header holds fixed fields, then the table of attached pids
(``shm_file.py``). Both the pool (``host_pool.py``) and the lock-free reader
(``inspect.snapshot``) map the file through this one description.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = 0x41494F504F4F4C35  # "AIOPOOL5": read leases added
# "AIOPOOL1": no block records; "AIOPOOL2": no classes; "AIOPOOL3": no eviction log; "AIOPOOL4": no leases
OLD_MAGICS = (0x41494F504F4F4C31, 0x41494F504F4F4C32, 0x41494F504F4F4C33, 0x41494F504F4F4C34)
MAX_PIDS = 256
_PAGE = 4096

# Header: fixed int64 fields, then the attached-pid table.
H_MAGIC, H_SLOT_SIZE, H_NUM_SLOTS, H_TABLE_SIZE, H_CLOCK = range(5)
H_NEXT_UNUSED, H_EVICTIONS, H_NUM_READY = range(5, 8)
# Values looked up by key (pin_ids) and those found: counted from zero in a pool made before.
H_LOOKUPS, H_HITS = 8, 9
H_FIELDS = 16


@dataclass(frozen=True)
class PoolUsage:
    num_slots: int
    num_ready: int
    slot_size: int
    evictions: int  # since the pool was created
    lookups: int  # values looked up by key, found or not
    hits: int

    @property
    def bytes_used(self) -> int:
        return self.num_ready * self.slot_size

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_size


def usage_of(header: np.ndarray) -> PoolUsage:
    """The counters of a pool's header (a view or a copy of it)."""
    return PoolUsage(int(header[H_NUM_SLOTS]), int(header[H_NUM_READY]), int(header[H_SLOT_SIZE]),
                     int(header[H_EVICTIONS]), int(header[H_LOOKUPS]), int(header[H_HITS]))


def attach_problem(path: Path, name: str, head: np.ndarray, slot_size: int) -> str | None:
    """Why the file whose header starts with ``head`` is no pool of ``slot_size``-byte values (None: it is)."""
    if len(head) >= H_FIELDS and head[H_MAGIC] in OLD_MAGICS:
        return (f"{path} was left by an older vllm_aio version (another pool layout): "
                "stop the instances using it, or remove the file")
    if len(head) < H_FIELDS or head[H_MAGIC] != MAGIC:
        return f"{path} is not a vllm_aio pool (or is still being created)"
    if head[H_SLOT_SIZE] != slot_size:
        return (
            f"pool {name!r} holds {int(head[H_SLOT_SIZE])}-byte blocks but this instance needs "
            f"{slot_size}-byte blocks: give instances with different models or parallelism "
            "different local_pool_name values"
        )
    return None


@dataclass(frozen=True)
class Layout:
    """Byte offsets of the regions inside the pool file."""

    slot_size: int
    num_slots: int

    @property
    def table_size(self) -> int:
        return 1 << max(4, (2 * self.num_slots - 1).bit_length())  # load <= 50%

    def offsets(self) -> dict[str, tuple[int, int, type]]:
        """name -> (offset, count, numpy dtype) of each region."""
        specs = [
            ("header", H_FIELDS + MAX_PIDS, np.int64),
            ("table", self.table_size, np.int64),
            ("key_hi", self.num_slots, np.int64),
            ("key_lo", self.num_slots, np.int64),
            ("version", self.num_slots, np.int64),
            ("last_used", self.num_slots, np.int64),
            ("retention", self.num_slots, np.int64),  # evicted lowest class first
            ("lease_until", self.num_slots, np.int64),  # CLOCK_MONOTONIC ns; not evicted before
            ("state", self.num_slots, np.int64),
            ("slot_group_hi", self.num_slots, np.int64),  # 0: the slot's key has no block record
            ("slot_group_lo", self.num_slots, np.int64),
            # Block records, open-addressed like the index; parts 0: empty bucket.
            ("group_hi", self.table_size, np.int64),
            ("group_lo", self.table_size, np.int64),
            ("group_parts", self.table_size, np.int64),
            # Eviction log: the block record id of the k-th evicted value at k % num_slots (hi 0: no record).
            ("evicted_hi", self.num_slots, np.int64),
            ("evicted_lo", self.num_slots, np.int64),
        ]
        out, pos = {}, 0
        for name, count, dtype in specs:
            out[name] = (pos, count, dtype)
            pos += count * 8
        out["data"] = (-(-pos // _PAGE) * _PAGE, self.num_slots * self.slot_size, np.uint8)
        return out

    @property
    def file_bytes(self) -> int:
        offset, size, _ = self.offsets()["data"]
        return offset + size
