"""Unit tests of ``vllm_aio.pool.entry``: the header every stored value starts with."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_aio.pool.entry import HEADER_BYTES, EntryHeader, describe

HEADER = EntryHeader("0123456789abcdef", "pp1.dcp3.h15", -1, 32, 1 << 20)


def test_header_is_fixed_size_and_deterministic():
    packed = HEADER.pack(b"h" * 32)
    assert len(packed) == HEADER_BYTES
    assert packed == HEADER.pack(b"h" * 32)


@pytest.mark.parametrize(
    "change",
    [
        {"namespace_digest": "fedcba9876543210"},
        {"shard": "pp1.dcp3.h14"},
        {"layer": 3},
        {"block_size": 16},
        {"payload_bytes": (1 << 20) - 2},
    ],
)
def test_every_field_changes_the_header(change):
    assert dataclasses.replace(HEADER, **change).pack(b"h" * 32) != HEADER.pack(b"h" * 32)


def test_block_hash_changes_the_header():
    assert HEADER.pack(b"a" * 32) != HEADER.pack(b"b" * 32)


def test_describe_names_the_fields_of_a_header_and_flags_garbage():
    assert describe(HEADER.pack(b"h" * 32)) == (
        "namespace=0123456789abcdef shard=pp1.dcp3.h15 layer=-1 block_size=32 payload=1048576"
    )
    assert describe(bytes(HEADER_BYTES)) == "no vllm_aio header"


def test_overlong_shard_id_is_refused():
    with pytest.raises(ValueError, match="longer than"):
        EntryHeader("0123456789abcdef", "x" * 25, 0, 32, 1)
