"""The keys and headers of one rank's values, and the check of a stored header.

Every value is ``header + payload`` (``pool/entry.py``); a value whose header
differs from the one this rank would have written for that key is refused
(``FOREIGN``) before its payload reaches the cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from vllm_aio.backends import Status
from vllm_aio.connector.worker.block_io.blocks import BlockRef
from vllm_aio.device.block_layout import BlockLayout
from vllm_aio.log import get_logger
from vllm_aio.pool.entry import HASH_PREFIX_BYTES, HEADER_BYTES, EntryHeader, describe
from vllm_aio.pool.keys import Unit, block_key

logger = get_logger(__name__)


class ValueLabels:
    """Keys and headers of one rank's values under one namespace, per unit.

    Never changed once built: a new namespace is a new ``ValueLabels``
    (``renamed``), so a transfer that took one finishes its batch with keys
    and headers that agree.
    """

    def __init__(self, header: EntryHeader, layout: BlockLayout) -> None:
        self.header = header  # the layer field is set per unit
        self._layout = layout
        self._fixed: dict[int | None, bytes] = {}  # per unit tag

    @property
    def namespace_digest(self) -> str:
        return self.header.namespace_digest

    @property
    def shard(self) -> str:
        return self.header.shard

    def renamed(self, namespace_digest: str) -> ValueLabels:
        return ValueLabels(dataclasses.replace(self.header, namespace_digest=namespace_digest), self._layout)

    def value_bytes(self, unit: Unit) -> int:
        return HEADER_BYTES + self._layout.payload_bytes(unit.layers)

    def keys(self, blocks: Sequence[BlockRef], unit: Unit) -> list[str]:
        digest, shard = self.header.namespace_digest, self.header.shard
        return [block_key(digest, shard, b.block_hash, unit.tag) for b in blocks]

    def headers(self, blocks: Sequence[BlockRef], unit: Unit) -> list[bytes]:
        fixed = self.fixed(unit)
        return [fixed + b.block_hash[:HASH_PREFIX_BYTES].ljust(HASH_PREFIX_BYTES, b"\0") for b in blocks]

    def fixed(self, unit: Unit) -> bytes:
        """The header of ``unit``'s values up to the block hash: the same for every block, packed once."""
        fixed = self._fixed.get(unit.tag)
        if fixed is None:
            header = EntryHeader(
                self.header.namespace_digest,
                self.header.shard,
                -1 if unit.tag is None else unit.tag,
                self.header.block_size,
                self._layout.payload_bytes(unit.layers),
            )
            fixed = self._fixed[unit.tag] = header.pack(bytes(HASH_PREFIX_BYTES))[:-HASH_PREFIX_BYTES]
        return fixed


def check_headers(stored: torch.Tensor, expected: list[bytes], statuses: list[Status]) -> list[Status]:
    """OK only where the stored header is exactly the one this reader would write (one batched compare)."""
    if not expected:
        return statuses
    want = torch.frombuffer(bytearray(b"".join(expected)), dtype=torch.uint8).view(-1, HEADER_BYTES)
    equal = (stored == want).all(dim=1).tolist()
    out = list(statuses)
    for i, same in enumerate(equal):
        if out[i] is Status.OK and not same:
            out[i] = Status.FOREIGN
            got = stored[i].contiguous().numpy().tobytes()
            logger.debug("vllm_aio: refused a value: stored %s, expected %s", describe(got), describe(expected[i]))
    return out
