"""Pooled stores behind one contract (``base.Backend``), chosen by ``backend``."""

from __future__ import annotations

from vllm_aio.backends.base import Backend, Segment, Status
from vllm_aio.config import AioConfig

__all__ = ["Backend", "Segment", "Status", "create_backend"]


def create_backend(cfg: AioConfig, pool_name: str, value_bytes: int) -> Backend:
    """The configured backend; imports its library only when chosen."""
    if cfg.backend == "local":
        from vllm_aio.backends.local import LocalBackend

        return LocalBackend(pool_name, cfg.local_pool_size, value_bytes)
    raise AssertionError(f"unvalidated backend {cfg.backend!r}")
