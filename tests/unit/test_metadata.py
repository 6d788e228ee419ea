"""What the scheduler sends the workers each step (``shared/metadata.py``): content and size on the wire."""

from __future__ import annotations

import hashlib
import pickle

import pytest

from vllm_aio.shared.metadata import AioConnectorMetadata, BlockTransfer

BLOCKS = 8192  # a 128k-token prompt of 16-token blocks


def hashes(n: int) -> list[bytes]:
    return [hashlib.sha256(str(i).encode()).digest() for i in range(n)]


def test_a_transfer_round_trips_through_pickle_with_its_ids_and_hashes():
    ids, hs = list(range(100, 110)), hashes(10)
    sent = AioConnectorMetadata(loads=[BlockTransfer.of("r", ids, hs, 3)])
    (got,) = pickle.loads(pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL)).loads
    assert (got.req_id, list(got.block_ids), got.block_hashes, got.first_index) == ("r", ids, hs, 3)
    assert len(got) == 10 and got.block_hash(4) == hs[4]


def test_a_transfer_costs_its_ids_and_hashes_on_the_wire_and_little_more():
    transfer = BlockTransfer.of("r", range(BLOCKS), hashes(BLOCKS), 0)
    wire = len(pickle.dumps(AioConnectorMetadata(loads=[transfer]), protocol=pickle.HIGHEST_PROTOCOL))
    assert wire <= BLOCKS * (4 + 32) + 512


def test_hashes_of_mixed_sizes_or_counts_are_refused():
    with pytest.raises(ValueError, match="one size"):
        BlockTransfer.of("r", [1, 2], [b"a" * 32, b"b" * 16], 0)
    with pytest.raises(ValueError, match="2 block ids but 1 hashes"):
        BlockTransfer.of("r", [1, 2], [b"a" * 32], 0)
