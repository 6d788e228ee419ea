"""Pytest fixtures that run real Mooncake pools on loopback.

Use from a test module with ``pytest_plugins = ["harness.mooncake_fixtures"]`` (``pytest.ini``
puts ``tests/`` on ``sys.path``). The backend is only worth testing against a
real master: the return codes, the "put of an existing key" behaviour and the
failure timings all come from the C++ client, not from its documentation.

A missing prerequisite (the ``mooncake`` package, its native libraries or the
``mooncake_master`` / ``mooncake_client`` binaries) fails the test when the
``CI`` environment variable is set, so CI cannot go green by skipping; outside
CI the test is skipped with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from vllm_aio.backends.mooncake import MooncakeBackend, MooncakeSettings
from vllm_aio.devtools.mooncake_pool import MooncakePool, PoolError, find_binary

PoolFactory = Callable[..., MooncakePool]


def in_ci() -> bool:
    """The same rule as conftest.require: any non-empty ``CI``."""
    return bool(os.environ.get("CI"))


def missing_prerequisite() -> str | None:
    """Why a real pool cannot run here, or None."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mooncake.store not importable ({e}); pip install 'vllm_aio[mooncake]' and " \
               "apt-get install libibverbs1 librdmacm1 libnuma1"
    try:
        find_binary("mooncake_master")
        find_binary("mooncake_client")
    except PoolError as e:
        return str(e)
    return None


def require_mooncake() -> None:
    """Fail (under CI) or skip (elsewhere) when a real pool cannot run."""
    reason = missing_prerequisite()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"CI is set and a Mooncake prerequisite is missing: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def mooncake_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakePool]:
    """One master + 256 MiB memory owner for the whole session; keys must be unique per test."""
    require_mooncake()
    with MooncakePool("256MB", log_dir=tmp_path_factory.mktemp("mooncake-pool")) as pool:
        yield pool


@pytest.fixture
def mooncake_pool_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolFactory]:
    """Start private pools (tiny, or to kill) within a test; all are stopped after it."""
    require_mooncake()
    pools: list[MooncakePool] = []

    def start(size: int | str = "64MB", **kwargs: object) -> MooncakePool:
        pool = MooncakePool(size, log_dir=tmp_path_factory.mktemp("mooncake-pool"), **kwargs)
        pools.append(pool)
        return pool.start()

    yield start
    for pool in pools:
        pool.stop()


@pytest.fixture(scope="session")
def mooncake_settings(mooncake_pool: MooncakePool) -> MooncakeSettings:
    """Engine settings for the session pool (this process contributes no memory)."""
    return MooncakeSettings.load(mooncake_pool.config, environ={})


@pytest.fixture(scope="session")
def mooncake_backend(mooncake_settings: MooncakeSettings) -> Iterator[MooncakeBackend]:
    """One backend on the session pool, shared: do not close or reconfigure it.

    Shared because ``close`` of a Mooncake client takes about 1 s (it joins a
    thread that wakes once a second); tests that need their own build one.
    """
    backend = MooncakeBackend(mooncake_settings)
    yield backend
    backend.close()
