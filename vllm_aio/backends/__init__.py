"""Pooled stores behind one contract (``base.Backend``), chosen by ``backend``."""

from __future__ import annotations

from vllm_aio.backends.base import Backend, Segment, Status
from vllm_aio.config import AioConfig

__all__ = ["Backend", "Segment", "Status", "create_backend"]


def create_backend(cfg: AioConfig, pool_name: str, value_bytes: int, last_attacher: bool) -> Backend:
    """The configured backend; imports its library only when chosen.

    ``last_attacher``: no other process of this instance will open the store
    after this one (vLLM creates the scheduler half after every worker).
    """
    if cfg.backend == "local":
        from vllm_aio.backends.local import LocalBackend

        private = cfg.local_pool_name is None
        return LocalBackend(pool_name, cfg.local_pool_size, value_bytes, seal=private and last_attacher)
    raise AssertionError(f"unvalidated backend {cfg.backend!r}")
