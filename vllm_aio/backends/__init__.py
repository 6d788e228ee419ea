"""Pooled stores behind one contract (``base.Backend``), chosen by ``backend``.

``SETTINGS`` registers each backend's settings class under its name: the
config boundary (``config.parse_extra_config``) parses the chosen one's
settings once, and ``create_backend`` opens the store they describe. Settings
modules import no store library; a backend's module and library are imported
only when it is opened.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_aio.backends.base import Backend, Memory, SlotStore, Status
from vllm_aio.backends.local_settings import LocalSettings
from vllm_aio.backends.memcache_settings import MemcacheSettings
from vllm_aio.backends.mooncake_settings import MooncakeSettings
from vllm_aio.backends.settings import BackendSettings
from vllm_aio.backends.tiered_settings import TieredSettings

if TYPE_CHECKING:
    from vllm_aio.config import AioConfig

__all__ = ["SETTINGS", "Backend", "BackendSettings", "Memory", "SlotStore", "Status", "create_backend"]

SETTINGS: dict[str, type[BackendSettings]] = {
    s.name: s for s in (LocalSettings, MooncakeSettings, MemcacheSettings, TieredSettings)
}


def create_backend(cfg: AioConfig, pool_name: str, value_bytes: int, for_scheduler: bool) -> Backend:
    """The configured backend (see ``BackendSettings.open`` for the arguments)."""
    return cfg.backend_settings.open(pool_name, value_bytes, for_scheduler)
