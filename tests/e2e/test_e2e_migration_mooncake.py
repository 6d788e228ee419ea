"""Runtime KV migration through one shared Mooncake store: no bytes move between the instances.

Both ``vllm serve`` instances use the same real ``mooncake_master`` (started
by the fixtures on loopback). The source's flush puts the request's blocks,
generated ones included, into the store; the target only has to find them.
"""

from __future__ import annotations

import pytest

from harness.assertions import assert_same_continuation
from harness.engines import aio_config
from harness.prerequisites import require
from harness.prompts import make_prompts
from harness.servers import Servers
from vllm_aio.migration.driver import Instance, generate_migrating

pytest_plugins = ["harness.mooncake_fixtures"]

MAX_TOKENS, AFTER = 1024, 16  # decoding well past the move (see test_e2e_migration.py)
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory, mooncake_pool):
    require("vllm")
    config = aio_config(backend="mooncake", migration=True, **mooncake_pool.config)
    servers = Servers(tiny_model, tmp_path_factory.mktemp("migration-mooncake"))
    try:
        started = servers.start({"a": config, "b": config})
        yield Instance(started["a"].url, timeout=120), Instance(started["b"].url, timeout=120)
    finally:
        servers.close()


def test_request_moves_through_a_shared_mooncake_store_without_copying(pair):
    a, b = pair
    prompt = make_prompts(41, [560])[0]
    want = generate_migrating(a, a, prompt, MAX_TOKENS, MAX_TOKENS + 1, NO_EOS)
    got = generate_migrating(a, b, prompt, MAX_TOKENS, AFTER, NO_EOS)
    assert got.error is None and got.moved_after is not None, got.error
    assert_same_continuation(got, want)
    moved = len(prompt) + got.moved_after
    assert got.report.mode == "shared" and got.report.bytes == 0
    # The flush put the generated tokens' blocks into the store, where the target found every block.
    assert got.report.full_blocks == moved // 32 and got.report.matched_tokens == moved // 32 * 32
    assert got.cached_tokens == min(moved // 32 * 32, moved - 1)
