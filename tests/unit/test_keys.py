"""Unit tests of ``vllm_aio.pool.keys``: namespace digests, rank coordinates, key format."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_aio.pool.keys import Namespace, block_key, group_block_hashes

ROOT = Path(__file__).resolve().parents[2]


def namespace(**changes) -> Namespace:
    base = Namespace(
        model="org/model",
        dtype="bfloat16",
        kv_cache_dtype="auto",
        block_size=16,
        kv_layout="NHD",
        attn_isa="avx512",
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        group=0,
        salt="",
    )
    return dataclasses.replace(base, **changes)


def changed(value):
    if isinstance(value, tuple):
        return (*value, "x")
    return value + 1 if isinstance(value, int) else value + "x"


# ---- namespace digest --------------------------------------------------------


def test_digest_is_16_lowercase_hex_characters():
    digest = namespace().digest()
    assert len(digest) == 16
    assert set(digest) <= set("0123456789abcdef")


def test_equal_namespaces_have_equal_digests():
    assert namespace().digest() == namespace().digest()


def test_digest_is_stable_across_processes_and_hash_seeds():
    code = (
        "from vllm_aio.pool.keys import Namespace;"
        "print(Namespace('org/model','bfloat16','auto',16,'NHD','avx512',1,1,1,1,0,'').digest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == namespace().digest()


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Namespace)])
def test_digest_changes_with_every_field(field):
    ns = namespace()
    assert namespace(**{field: changed(getattr(ns, field))}).digest() != ns.digest()


def test_digest_of_one_kv_cache_group_is_the_one_before_hybrid_support():
    # Pools written before hybrid models were supported keep hitting.
    fields = dataclasses.asdict(namespace())
    del fields["kv_groups"]
    text = json.dumps(fields, sort_keys=True)
    assert namespace().digest() == hashlib.sha256(text.encode()).hexdigest()[:16]


def test_each_kv_cache_group_keys_a_prefix_apart_and_one_group_by_the_hash_alone():
    hashes = [bytes(32), bytes([1]) * 32]
    assert group_block_hashes(hashes, None) == hashes
    full, window = group_block_hashes(hashes, 0), group_block_hashes(hashes, 1)
    assert len({*full, *window, *hashes}) == 6
    assert {len(h) % 8 for h in full + window} == {0}  # whole words: the pool's record ids read them so


def test_digest_tells_apart_values_that_print_alike():
    # a string "16" and an int 16 must not collide, nor a field shifted into a neighbour
    assert namespace(block_size=16).digest() != namespace(block_size="16").digest()  # type: ignore[arg-type]
    assert namespace(model="a", dtype="bc").digest() != namespace(model="ab", dtype="c").digest()


# ---- rank coordinates -----------------------------------------------------------


def test_block_key_joins_prefix_namespace_shard_and_hex_hash():
    assert block_key("0123456789abcdef", "tp0.pp0.pcp0.dcp0", b"\x00\x01\xfe\xff") == (
        "aio:0123456789abcdef:tp0.pp0.pcp0.dcp0:0001feff"
    )


def test_block_keys_differ_by_namespace_shard_and_hash():
    ns_a, ns_b = namespace().digest(), namespace(salt="other").digest()
    h = bytes(range(32))
    keys = {
        block_key(ns_a, "pp0.pcp0.dcp0.h0", h),
        block_key(ns_b, "pp0.pcp0.dcp0.h0", h),
        block_key(ns_a, "pp0.pcp0.dcp0.h1", h),
        block_key(ns_a, "pp0.pcp0.dcp0.h0", h[:-1] + b"\xff"),
    }
    assert len(keys) == 4
