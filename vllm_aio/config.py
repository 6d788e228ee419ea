"""The connector's configuration, parsed once from ``kv_connector_extra_config``.

Neither connector half reads the extra config itself: both receive an
``AioConfig``. Unknown keys and values of the wrong type or outside the
accepted set fail at start, naming the key and what is accepted, because a
typo (``"backed": "mooncake"``) silently falling back to defaults is the worst
kind of misconfiguration for a cache: everything works, nothing hits.

Environment variables (documented in the README) override the extra config:
``VLLM_AIO_BACKEND`` and ``VLLM_AIO_LOCAL_POOL_SIZE``; the Mooncake backend also
reads ``MOONCAKE_CONFIG_PATH``, ``MOONCAKE_MASTER`` and
``MOONCAKE_GLOBAL_SEGMENT_SIZE`` (see ``backends/mooncake.py``), the Memcache
backend the file named by ``MMC_LOCAL_CONFIG_PATH`` (see ``backends/memcache.py``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

BACKENDS = ("local", "mooncake", "memcache")

_SIZE_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*$", re.IGNORECASE)


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key."""


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a string like "4GB", "512MB", "1.5GB" (binary units)."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size such as 4294967296 or '4GB', got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        unit = m.group(2).upper()
        unit = unit if unit.endswith("B") or unit == "" else unit + "B"
        size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ConfigError(
            f"{key}: expected a size such as 4294967296 or '4GB' (units B, KB, MB, GB, TB), "
            f"got {value!r}"
        )
    if size <= 0:
        raise ConfigError(f"{key}: must be positive, got {value!r}")
    return size


@dataclass(frozen=True)
class AioConfig:
    # Which pooled store holds the blocks: the embedded host pool by default.
    backend: str = "local"
    # Bytes of host memory of the embedded pool (int or "4GB").
    local_pool_size: int = 4 << 30
    # Instances on one host that set the same name share one embedded pool
    # (e.g. a prefill and a decode instance); unset, the pool is private.
    local_pool_name: str | None = None
    # A kv_consumer loads from the pool unless this is false.
    consumer_is_to_load: bool = True
    # A kv_consumer also stores what it computes.
    consumer_is_to_put: bool = False
    # Also store blocks filled by generated tokens, not only the prompt's.
    save_decode_cache: bool = False
    # Only whole blocks are stored (see parse_extra_config for why).
    discard_partial_chunks: bool = True
    # Mixed into every key: instances with different salts never share blocks.
    salt: str = ""
    # Store and load each layer as a value of its own, overlapping the
    # transfers with the forward layer by layer (keys differ: see pool/keys.py).
    use_layerwise: bool = False
    # With use_layerwise: layers loaded ahead of the one the forward waits for.
    layerwise_prefetch_layers: int = 1
    # Load whole prefixes in the background while the request waits in vLLM's
    # WAITING_FOR_REMOTE_KVS state (the non-layerwise way off the critical path).
    load_async: bool = False
    # Seconds a step waits at most for a transfer before declaring it failed
    # (loads: recomputed; saves: skipped).
    transfer_timeout: float = 30.0
    # Host bytes per direction for blocks in flight (page-locked on accelerators).
    staging_buffer_size: int = 256 << 20
    # Layers of KV cache kept on the device (0: every layer, the normal
    # cache). With S >= 2, layers time-share S device buffers while the full KV
    # lives in host memory, and vLLM sees about layers/S times more blocks.
    dynamic_buffer_layers: int = 0
    # Mooncake settings given inline (master_server_address, protocol, ...);
    # merged over the MOONCAKE_CONFIG_PATH file and checked by the backend.
    mooncake: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend: expected one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.mooncake and self.backend != "mooncake":
            raise ConfigError(
                f"{', '.join(sorted(self.mooncake))}: Mooncake settings need backend \"mooncake\", "
                f"but backend is {self.backend!r}"
            )
        if not self.discard_partial_chunks:
            raise ConfigError(
                "discard_partial_chunks: only true is accepted: keys come from vLLM's "
                "block hashes, which exist for whole blocks only"
            )
        if self.use_layerwise and self.load_async:
            raise ConfigError(
                "use_layerwise, load_async: choose one; layerwise loads overlap the forward, "
                "load_async loads before the request is scheduled"
            )
        if self.dynamic_buffer_layers == 1 or self.dynamic_buffer_layers < 0:
            raise ConfigError(
                f"dynamic_buffer_layers: expected 0 (off) or an integer >= 2, got {self.dynamic_buffer_layers}"
            )
        if self.dynamic_buffer_layers and self.use_layerwise:
            raise ConfigError(
                "dynamic_buffer_layers, use_layerwise: choose one; the dynamic buffer already streams "
                "every layer through host memory"
            )
        if self.layerwise_prefetch_layers < 0:
            raise ConfigError(f"layerwise_prefetch_layers: expected an integer >= 0, got {self.layerwise_prefetch_layers}")
        if not self.transfer_timeout > 0:
            raise ConfigError(f"transfer_timeout: expected seconds > 0, got {self.transfer_timeout}")
        if self.local_pool_name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.local_pool_name):
            raise ConfigError(
                "local_pool_name: expected 1-64 characters from A-Z a-z 0-9 _ . -, "
                f"got {self.local_pool_name!r}"
            )



_ENV_OVERRIDES = {"VLLM_AIO_BACKEND": "backend", "VLLM_AIO_LOCAL_POOL_SIZE": "local_pool_size"}
_SIZE_KEYS = {"local_pool_size", "staging_buffer_size"}


def _check_type(key: str, value: Any, field: dataclasses.Field) -> Any:
    """``key`` names the source in errors: the extra-config key or the env variable."""
    if field.name in _SIZE_KEYS:
        return parse_size(key, value)
    expected = field.type
    if expected == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
    elif expected == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
    elif expected == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number of seconds, got {value!r}")
        value = float(value)
    elif expected == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
    elif expected == "str | None":
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string or null, got {value!r}")
    return value


def _mooncake_keys() -> list[str]:
    # Imported here: the backend module imports this one (for parse_size).
    from vllm_aio.backends.mooncake import MooncakeSettings

    return [f.name for f in dataclasses.fields(MooncakeSettings)]


def parse_extra_config(
    extra: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> AioConfig:
    """Build the config from ``kv_connector_extra_config`` and the environment.

    Mooncake's own keys (``master_server_address``, ``protocol``, ...) are
    accepted at the top level, as vllm-ascend users write them, and collected
    into ``mooncake``. Unlike a ``MOONCAKE_CONFIG_PATH`` file, they stay
    strict: keys of other connectors (``alloc_in_same_node``) fail here.
    """
    environ = os.environ if environ is None else environ
    fields = {f.name: f for f in dataclasses.fields(AioConfig) if f.name != "mooncake"}
    mooncake_keys = _mooncake_keys()
    unknown = sorted(set(extra) - set(fields) - set(mooncake_keys))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(unknown)} in kv_connector_extra_config; "
            f"accepted keys: {', '.join(sorted(fields))}; "
            f"with backend mooncake also: {', '.join(mooncake_keys)}"
        )
    values: dict[str, Any] = {
        key: _check_type(key, value, fields[key]) for key, value in extra.items() if key in fields
    }
    values["mooncake"] = {key: value for key, value in extra.items() if key in mooncake_keys}
    for env, key in _ENV_OVERRIDES.items():
        if env in environ:
            values[key] = _check_type(env, environ[env], fields[key])
    return AioConfig(**values)
