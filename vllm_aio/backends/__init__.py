"""Pooled stores behind one contract (``base.Backend``), chosen by ``backend``.

``SETTINGS`` registers each backend's settings class under its name: the
config boundary (``config.parse_extra_config``) parses the chosen one's
settings once, and ``open_backend`` opens the store they describe. Settings
modules import no store library, nor their backend's module: a backend's module
and library are imported only when it is opened, here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from vllm_aio.backends.base import Backend, Memory, SlotStore, Status
from vllm_aio.backends.local_settings import LocalSettings
from vllm_aio.backends.memcache_settings import MemcacheSettings
from vllm_aio.backends.mooncake_settings import MooncakeSettings
from vllm_aio.backends.settings import BackendSettings
from vllm_aio.backends.tiered_settings import TieredSettings

__all__ = ["SETTINGS", "Backend", "BackendSettings", "Memory", "SlotStore", "Status", "open_backend"]

SETTINGS: dict[str, type[BackendSettings]] = {
    s.name: s for s in (LocalSettings, MooncakeSettings, MemcacheSettings, TieredSettings)
}


def open_backend(settings: BackendSettings, pool_name: str, value_bytes: int, for_scheduler: bool) -> Backend:
    """The backend ``settings`` describe; its module and library are imported now, not before.

    ``pool_name``: the embedded pool's name unless configured; ``value_bytes``:
    the size of every value; ``for_scheduler``: the store is opened by vLLM's
    scheduler, which only looks keys up and is created after every worker
    of the instance.
    """
    return _OPENERS[settings.name](settings, pool_name, value_bytes, for_scheduler)


def _open_local(settings: LocalSettings, pool_name: str, value_bytes: int, for_scheduler: bool) -> Backend:
    from vllm_aio.backends.local import LocalBackend

    # A private pool is sealed once the scheduler, created after every worker, has attached.
    private = settings.local_pool_name is None
    return LocalBackend(settings.local_pool_name or pool_name, settings.local_pool_size, value_bytes,
                        seal=private and for_scheduler, shared=not private)


def _open_mooncake(settings: MooncakeSettings, pool_name: str, value_bytes: int, for_scheduler: bool) -> Backend:
    from vllm_aio.backends.mooncake import MooncakeBackend

    # The scheduler only looks up: it contributes no memory, and keeps the
    # tenant_id, as its lookups must see the workers' keys.
    return MooncakeBackend(replace(settings, global_segment_size=0) if for_scheduler else settings,
                           value_bytes=value_bytes)


def _open_memcache(settings: MemcacheSettings, pool_name: str, value_bytes: int, for_scheduler: bool) -> Backend:
    from vllm_aio.backends.memcache import MemcacheBackend

    # The scheduler's client: lookup-only, no memory, no device needed.
    return MemcacheBackend(replace(settings, lookup_only=True) if for_scheduler else settings, value_bytes=value_bytes)


def _open_tiered(settings: TieredSettings, pool_name: str, value_bytes: int, for_scheduler: bool) -> Backend:
    from vllm_aio.backends.tiered import TieredBackend

    local = open_backend(settings.local, pool_name, value_bytes, for_scheduler)
    try:
        remote = open_backend(settings.remote, pool_name, value_bytes, for_scheduler)
    except BaseException:
        local.close()
        raise
    return TieredBackend(local, remote, value_bytes, settings.remote.title,
                         write_through=settings.remote_write == "through", queue_size=settings.remote_queue_size)


_OPENERS: dict[str, Callable[..., Backend]] = {
    LocalSettings.name: _open_local,
    MooncakeSettings.name: _open_mooncake,
    MemcacheSettings.name: _open_memcache,
    TieredSettings.name: _open_tiered,
}
