"""Settings of the tiered store (``backends/tiered.py``): the embedded pool in front of a distributed one.

Each tier is configured exactly as it would be alone, by its own settings
class: the local tier by ``local_pool_size``/``local_pool_name`` (and
``VLLM_AIO_LOCAL_POOL_SIZE``), the remote tier by Mooncake's keys and files or
Memcache's. Three keys are the tiered store's own: which remote
(``remote_backend``), how saves reach it (``remote_write``), and how many
values may wait for a background write (``remote_queue_size``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_aio.backends.local_settings import LocalSettings
from vllm_aio.backends.memcache_settings import MemcacheSettings
from vllm_aio.backends.mooncake_settings import MooncakeSettings
from vllm_aio.backends.settings import BackendSettings
from vllm_aio.errors import ConfigError

REMOTES: dict[str, type[BackendSettings]] = {s.name: s for s in (MooncakeSettings, MemcacheSettings)}
# "background": saves land in the local tier at once and reach the remote tier
# from a bounded queue; "through": a save returns once both tiers answered.
WRITE_MODES = ("background", "through")
_OWN_KEYS = ("remote_backend", "remote_write", "remote_queue_size")


@dataclass(frozen=True)
class TieredSettings(BackendSettings):
    name: ClassVar[str] = "tiered"
    title: ClassVar[str] = "tiered store"
    keys: ClassVar[tuple[str, ...]] = (
        _OWN_KEYS + LocalSettings.keys + tuple(k for s in REMOTES.values() for k in s.keys)
    )

    local: LocalSettings
    remote: BackendSettings  # one of REMOTES
    remote_write: str = "background"
    # Values whose background write to the remote tier may wait at once; one
    # more is dropped (counted), never waited for.
    remote_queue_size: int = 4096

    def __post_init__(self) -> None:
        if self.remote_write not in WRITE_MODES:
            raise ConfigError(f"remote_write: expected one of {', '.join(WRITE_MODES)}, got {self.remote_write!r}")
        size = self.remote_queue_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"remote_queue_size: expected an integer >= 1, got {size!r}")

    @classmethod
    def load(cls, inline: Mapping[str, Any], environ: Mapping[str, str]) -> TieredSettings:
        remote = _remote(inline.get("remote_backend"))
        for other in REMOTES.values():
            if other is not remote and (misplaced := sorted(set(inline) & set(other.keys) - set(remote.keys))):
                raise ConfigError(
                    f"{', '.join(misplaced)}: {other.title} settings need remote_backend \"{other.name}\", "
                    f"but remote_backend is {remote.name!r}"
                )
        own = {k: inline[k] for k in _OWN_KEYS[1:] if k in inline}
        return cls(
            local=LocalSettings.load({k: v for k, v in inline.items() if k in LocalSettings.keys}, environ),
            remote=remote.load({k: v for k, v in inline.items() if k in remote.keys}, environ),
            **own,
        )


def _remote(name: Any) -> type[BackendSettings]:
    if not isinstance(name, str) or name not in REMOTES:
        what = "missing" if name is None else f"got {name!r}"
        raise ConfigError(f"remote_backend: expected one of {', '.join(REMOTES)}, {what}")
    return REMOTES[name]
