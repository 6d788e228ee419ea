"""Memcache's settings: the library's own config file, and one inline key.

The library reads its file, ``$MMC_LOCAL_CONFIG_PATH`` (``ock.mmc.*`` keys),
once, at import (seen). ``setup(LocalConfig)`` would replace it, not merge, so
we copy none of its ~40 keys: we read its URLs (probed before ``init``) and its
protocol (for messages), and add what it lacks: ``device_id``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_aio.backends.settings import BackendSettings
from vllm_aio.errors import ConfigError

ENV_CONFIG_PATH = "MMC_LOCAL_CONFIG_PATH"


@dataclass(frozen=True)
class MemcacheSettings(BackendSettings):
    name: ClassVar[str] = "memcache"
    title: ClassVar[str] = "Memcache"
    keys: ClassVar[tuple[str, ...]] = ("device_id",)

    config_path: str  # the library's config file (ock.mmc.* keys): $MMC_LOCAL_CONFIG_PATH
    # Read from the file: the meta service ("tcp://host:port"), its config store (which a
    # memory-owning client joins) and the transfer protocol (for messages).
    meta_service_url: str
    config_store_url: str = ""
    protocol: str = "host_rdma"
    device_id: int | None = None  # NPU of this process; None: torch.npu's current one, else 0
    lookup_only: bool = False  # the scheduler's client: looks keys up, contributes no memory, needs no NPU

    def __post_init__(self) -> None:
        if self.device_id is not None and (isinstance(self.device_id, bool) or not isinstance(self.device_id, int)):
            raise ConfigError(f"device_id: expected an integer, got {self.device_id!r}")
        tcp_address("ock.mmc.meta_service_url", self.meta_service_url)

    @classmethod
    def load(cls, inline: Mapping[str, Any] | None = None,
             environ: Mapping[str, str] | None = None) -> MemcacheSettings:
        """Settings from ``$MMC_LOCAL_CONFIG_PATH`` (no inline path: the library reads that) and ``inline``."""
        environ = os.environ if environ is None else environ
        inline = dict(inline or {})
        if unknown := sorted(set(inline) - set(cls.keys)):
            raise ConfigError(f"unknown Memcache setting(s) {', '.join(unknown)}; accepted: {', '.join(cls.keys)}")
        if not (path := environ.get(ENV_CONFIG_PATH)):
            raise ConfigError(f"{ENV_CONFIG_PATH}: not set; point it to Memcache's local config file "
                              "(a sample ships in memcache_hybrid/config/mmc-local.conf)")
        if not (url := (conf := read_conf(path)).get("ock.mmc.meta_service_url")):
            raise ConfigError(f"ock.mmc.meta_service_url: missing in {path}")
        return cls(config_path=path, meta_service_url=url,
                   config_store_url=conf.get("ock.mmc.local_service.config_store_url", ""),
                   protocol=conf.get("ock.mmc.local_service.protocol", "host_rdma"), **inline)


def read_conf(path: str) -> dict[str, str]:
    """The ``key = value`` lines of a Memcache config file, read as the library does
    (seen: ``#`` starts a comment line only; after a value it is part of the value)."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as e:
        raise ConfigError(f"{ENV_CONFIG_PATH}: cannot read Memcache config {path}: {e}") from e
    pairs = (line.partition("=") for line in lines if not line.lstrip().startswith("#"))
    return {k.strip(): v.strip() for k, sep, v in pairs if sep and k.strip()}


def tcp_address(key: str, url: str) -> str:
    """``host:port`` of a ``tcp://host:port`` URL."""
    scheme, sep, rest = str(url).partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not colon or not host or not port.isdigit():
        raise ConfigError(f"{key}: expected 'tcp://host:port', got {url!r}")
    return f"{host}:{port}"
