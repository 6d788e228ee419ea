"""Pooled stores behind one contract (``base.Backend``), chosen by ``backend``."""

from __future__ import annotations

import dataclasses

from vllm_aio.backends.base import Backend, Segment, Status
from vllm_aio.config import AioConfig

__all__ = ["Backend", "Segment", "Status", "create_backend"]


def create_backend(cfg: AioConfig, pool_name: str, value_bytes: int, for_scheduler: bool) -> Backend:
    """The configured backend; imports its library only when chosen.

    ``for_scheduler``: the store is opened by vLLM's scheduler, which only
    looks keys up and is created after every worker of the instance: a private
    embedded pool can be sealed, and a Mooncake or Memcache client contributes
    no memory.
    """
    if cfg.backend == "local":
        from vllm_aio.backends.local import LocalBackend

        private = cfg.local_pool_name is None
        return LocalBackend(pool_name, cfg.local_pool_size, value_bytes, seal=private and for_scheduler)
    if cfg.backend == "mooncake":
        from vllm_aio.backends.mooncake import MooncakeBackend, MooncakeSettings

        settings = MooncakeSettings.load(cfg.mooncake)
        if for_scheduler:  # same tenant_id: its lookups must see the workers' keys
            settings = dataclasses.replace(settings, global_segment_size=0)
        return MooncakeBackend(settings)
    if cfg.backend == "memcache":
        from vllm_aio.backends.memcache import MemcacheBackend, MemcacheSettings

        settings = MemcacheSettings.load()
        if for_scheduler:  # a lookup-only client: no memory, no device needed
            settings = dataclasses.replace(settings, lookup_only=True)
        return MemcacheBackend(settings)
    raise AssertionError(f"unvalidated backend {cfg.backend!r}")
