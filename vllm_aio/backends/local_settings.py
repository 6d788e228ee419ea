"""Settings of the embedded host pool (``backends/local.py``): two inline keys, one variable."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_aio.backends.settings import BackendSettings, parse_size
from vllm_aio.errors import ConfigError

ENV_POOL_SIZE = "VLLM_AIO_LOCAL_POOL_SIZE"  # overrides local_pool_size


@dataclass(frozen=True)
class LocalSettings(BackendSettings):
    name: ClassVar[str] = "local"
    title: ClassVar[str] = "embedded pool"
    keys: ClassVar[tuple[str, ...]] = ("local_pool_size", "local_pool_name")

    # Bytes of host memory of the embedded pool (int or "4GB").
    local_pool_size: int = 4 << 30
    # Instances on one host that set the same name share one embedded pool
    # (e.g. a prefill and a decode instance); unset, the pool is private.
    local_pool_name: str | None = None

    def __post_init__(self) -> None:
        if self.local_pool_name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.local_pool_name):
            raise ConfigError(
                "local_pool_name: expected 1-64 characters from A-Z a-z 0-9 _ . -, "
                f"got {self.local_pool_name!r}"
            )

    @classmethod
    def load(cls, inline: Mapping[str, Any], environ: Mapping[str, str]) -> LocalSettings:
        values: dict[str, Any] = {}
        if "local_pool_size" in inline:
            values["local_pool_size"] = parse_size("local_pool_size", inline["local_pool_size"])
        if "local_pool_name" in inline:
            name = inline["local_pool_name"]
            if name is not None and not isinstance(name, str):
                raise ConfigError(f"local_pool_name: expected a string or null, got {name!r}")
            values["local_pool_name"] = name
        if ENV_POOL_SIZE in environ:
            values["local_pool_size"] = parse_size(ENV_POOL_SIZE, environ[ENV_POOL_SIZE])
        return cls(**values)
