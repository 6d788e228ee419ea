"""The connector's configuration, parsed once from ``kv_connector_extra_config``.

Neither connector half reads the extra config itself: both receive an
``AioConfig``. Unknown keys and values of the wrong type or outside the
accepted set fail at start, naming the key and what is accepted, because a
typo (``"backed": "mooncake"``) silently falling back to defaults is the worst
kind of misconfiguration for a cache: everything works, nothing hits.

Each backend owns its settings (``backends/*_settings.py``, registered in
``backends.SETTINGS``): its keys of the extra config are handed to its settings
class, which adds its own environment variables and files. ``AioConfig`` holds
the result, whatever the backend, in ``backend_settings``.

Every key and variable is documented in docs/configuration.md. Environment
variables override the extra config:
``VLLM_AIO_BACKEND``; the embedded pool reads ``VLLM_AIO_LOCAL_POOL_SIZE``, the
Mooncake backend ``MOONCAKE_CONFIG_PATH``, ``MOONCAKE_MASTER`` and
``MOONCAKE_GLOBAL_SEGMENT_SIZE``, the Memcache backend the file named by
``MMC_LOCAL_CONFIG_PATH``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from vllm_aio.backends import SETTINGS, BackendSettings
from vllm_aio.backends.local_settings import LocalSettings
from vllm_aio.backends.settings import parse_size
from vllm_aio.errors import ConfigError
from vllm_aio.log import get_logger

__all__ = ["BACKENDS", "REPLACED_MODE_KEYS", "AioConfig", "TransferMode", "parse_extra_config", "parse_size"]

logger = get_logger(__name__)

BACKENDS = tuple(SETTINGS)
# What Mooncake's TransferEngine accepts as a protocol.
MIGRATION_PROTOCOLS = ("tcp", "rdma", "ascend", "nvlink", "efa")


class TransferMode(str, Enum):
    """How blocks move between vLLM's KV cache and the pool: one way per instance."""

    # Each block one value of every layer, loaded before the forward and saved after it.
    WHOLE_BLOCKS = "whole_blocks"
    # Each layer of a block a value of its own, the transfers overlapping the
    # forward layer by layer (keys differ: see pool/keys.py).
    LAYERWISE = "layerwise"
    # Whole prefixes load in the background while the request waits in vLLM's
    # WAITING_FOR_REMOTE_KVS state (the whole-block way off the critical path).
    ASYNC = "async"
    # Layers time-share ``dynamic_buffer_count`` device buffers while the full
    # KV lives in host memory, and vLLM sees about layers/count times more blocks.
    DYNAMIC_BUFFER = "dynamic_buffer"

    def __str__(self) -> str:
        return self.value

    @property
    def runs_per_layer(self) -> bool:
        """Whether its hooks must run at every layer of every forward (``wait_for_layer_load``,
        ``save_kv_layer``). A replayed FULL CUDA or ACL graph calls neither: the layers would
        read KV that never arrived, and what they computed would never be saved."""
        return self in (TransferMode.LAYERWISE, TransferMode.DYNAMIC_BUFFER)


TRANSFER_MODES = tuple(m.value for m in TransferMode)


@dataclass(frozen=True)
class AioConfig:
    # Which pooled store holds the blocks: the embedded host pool by default.
    backend: str = "local"
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
    # The version of the model's weights, part of every key: KV computed under
    # other weights never hits and never migrates. RL trainers change it at
    # runtime after a weight update (POST /v1/kv_migration/weight_version).
    weight_version: str = ""
    # Serve the migration protocol (vllm_aio/migration): this instance can send
    # running requests' KV to another instance and receive it.
    migration: bool = False
    # Seconds a target keeps an uncommitted migration's slots reserved; the
    # source must finish writing within half of it.
    migration_watchdog_timeout: float = 60.0
    # How migrated bytes travel between embedded pools (Mooncake TransferEngine):
    # "tcp", or "rdma"/"ascend" passed through with their device.
    migration_protocol: str = "tcp"
    migration_device_name: str = ""
    # The address peers reach this host's transfer engine at ("": this host's name).
    migration_hostname: str = ""
    # Retention classes by vLLM request priority (lower is more important):
    # a request whose priority is at or below k of these values saves its
    # blocks in class k, and the pool evicts lower classes first (embedded
    # pool: lowest class first, LRU within; Mooncake: classes >= 1 soft-pinned).
    # Empty: one class, plain LRU.
    priority_cutoffs: tuple[int, ...] = ()
    # How blocks move between the KV cache and the pool (see TransferMode).
    transfer_mode: TransferMode = TransferMode.WHOLE_BLOCKS
    # With transfer_mode layerwise: layers loaded ahead of the one the forward waits for.
    layerwise_prefetch_layers: int = 1
    # Seconds a step waits at most for a transfer before declaring it failed
    # (loads: recomputed; saves: skipped).
    transfer_timeout: float = 30.0
    # Host bytes per direction for blocks in flight (page-locked on accelerators).
    staging_buffer_size: int = 256 << 20
    # With transfer_mode dynamic_buffer: the device buffers the layers time-share (S >= 2).
    dynamic_buffer_count: int = 2
    # With the dynamic buffer: device blocks per layer kept for requests of the
    # highest retention class (``priority_cutoffs``), whose KV then stays on
    # the device in every layer instead of streaming through the S buffers
    # (0: every request streams). Each costs one block of every layer, taken
    # from the streamed blocks' memory.
    dynamic_buffer_resident_blocks: int = 0
    # The chosen backend's own settings: its keys of the extra config (e.g.
    # local_pool_size, master_server_address), its variables and its files.
    backend_settings: BackendSettings = field(default_factory=LocalSettings)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend: expected one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend_settings.name != self.backend:
            raise ConfigError(
                f"backend_settings: {type(self.backend_settings).__name__} are not the settings of "
                f"backend {self.backend!r}"
            )
        if not self.discard_partial_chunks:
            raise ConfigError(
                "discard_partial_chunks: only true is accepted: keys come from vLLM's "
                "block hashes, which exist for whole blocks only"
            )
        object.__setattr__(self, "transfer_mode", _transfer_mode("transfer_mode", self.transfer_mode))
        if self.dynamic_buffer_count < 2:
            raise ConfigError(f"dynamic_buffer_count: expected an integer >= 2, got {self.dynamic_buffer_count}")
        if self.dynamic_buffer_resident_blocks < 0:
            raise ConfigError(
                f"dynamic_buffer_resident_blocks: expected an integer >= 0, got {self.dynamic_buffer_resident_blocks}"
            )
        buffered = self.transfer_mode is TransferMode.DYNAMIC_BUFFER
        if self.dynamic_buffer_resident_blocks and not (buffered and self.priority_cutoffs):
            raise ConfigError(
                "dynamic_buffer_resident_blocks: needs transfer_mode dynamic_buffer and priority_cutoffs (the "
                "requests of the highest retention class stay resident)"
            )
        if self.layerwise_prefetch_layers < 0:
            raise ConfigError(f"layerwise_prefetch_layers: expected an integer >= 0, got {self.layerwise_prefetch_layers}")
        if not self.transfer_timeout > 0:
            raise ConfigError(f"transfer_timeout: expected seconds > 0, got {self.transfer_timeout}")
        if not self.migration_watchdog_timeout > 0:
            raise ConfigError(
                f"migration_watchdog_timeout: expected seconds > 0, got {self.migration_watchdog_timeout}"
            )
        if list(self.priority_cutoffs) != sorted(set(self.priority_cutoffs)) or len(self.priority_cutoffs) > 7:
            raise ConfigError(
                f"priority_cutoffs: expected up to 7 distinct integers in increasing order, "
                f"got {list(self.priority_cutoffs)}"
            )
        if self.migration_protocol not in MIGRATION_PROTOCOLS:
            raise ConfigError(
                f"migration_protocol: expected one of {', '.join(MIGRATION_PROTOCOLS)}, "
                f"got {self.migration_protocol!r}"
            )


def transfer_mode_of(extra: Mapping[str, Any]) -> TransferMode:
    """The transfer mode ``kv_connector_extra_config`` selects, without the rest of its checks
    (vLLM asks before the connector exists: ``AioConnector.requires_piecewise_for_cudagraph``)."""
    if "transfer_mode" in extra:
        return _transfer_mode("transfer_mode", extra["transfer_mode"])
    return _replaced_mode_keys(extra).get("transfer_mode", AioConfig.transfer_mode)


def _transfer_mode(key: str, value: Any) -> TransferMode:
    if not isinstance(value, str) or value not in TRANSFER_MODES:
        raise ConfigError(f"{key}: expected one of {', '.join(TRANSFER_MODES)}, got {value!r}")
    return TransferMode(value)


_ENV_OVERRIDES = {"VLLM_AIO_BACKEND": "backend"}
_SIZE_KEYS = {"staging_buffer_size"}


def _check_type(key: str, value: Any, field: dataclasses.Field) -> Any:
    """``key`` names the source in errors: the extra-config key or the env variable."""
    if field.name in _SIZE_KEYS:
        return parse_size(key, value)
    expected = field.type
    if expected == "TransferMode":
        value = _transfer_mode(key, value)
    elif expected == "bool":
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
    elif expected == "tuple[int, ...]":
        if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise ConfigError(f"{key}: expected a list of integers, got {value!r}")
        value = tuple(value)
    return value


def parse_extra_config(
    extra: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> AioConfig:
    """Build the config from ``kv_connector_extra_config`` and the environment.

    The chosen backend's own keys sit at the top level too (``local_pool_size``;
    Mooncake's ``master_server_address``, ``protocol``, ... as vllm-ascend users
    write them; Memcache's ``device_id``): they go to its settings class, parsed
    here, once. Unlike a ``MOONCAKE_CONFIG_PATH`` file they stay strict: keys of
    other connectors (``alloc_in_same_node``) and of a backend not chosen fail.
    """
    environ = os.environ if environ is None else environ
    fields = {f.name: f for f in dataclasses.fields(AioConfig) if f.name != "backend_settings"}
    values: dict[str, Any] = {
        **_replaced_mode_keys(extra),
        **{key: _check_type(key, value, fields[key]) for key, value in extra.items() if key in fields},
    }
    mode = values.get("transfer_mode", AioConfig.transfer_mode)
    if "dynamic_buffer_count" in extra and mode is not TransferMode.DYNAMIC_BUFFER:
        raise ConfigError(
            f"dynamic_buffer_count, transfer_mode: dynamic_buffer_count sets the buffers of transfer_mode "
            f"dynamic_buffer, but transfer_mode is {mode}"
        )
    for env, key in _ENV_OVERRIDES.items():
        if env in environ:
            values[key] = _check_type(env, environ[env], fields[key])
    backend = values.get("backend", AioConfig.backend)
    if backend not in SETTINGS:
        raise ConfigError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    chosen = SETTINGS[backend]
    _check_keys({k: v for k, v in extra.items() if k not in REPLACED_MODE_KEYS}, sorted(fields), chosen)
    inline = {key: value for key, value in extra.items() if key in chosen.keys}
    return AioConfig(backend_settings=chosen.load(inline, environ), **values)


def _check_keys(extra: Mapping[str, Any], general: list[str], chosen: type[BackendSettings]) -> None:
    """Every key is general or the chosen backend's; another backend's key names that backend."""
    owners: dict[str, type[BackendSettings]] = {}
    for s in SETTINGS.values():  # a key of several backends (the tiered store's) names the first: its own
        for key in s.keys:
            if s is not chosen and key not in chosen.keys:
                owners.setdefault(key, s)
    unknown = sorted(set(extra) - set(general) - set(chosen.keys) - set(owners))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(unknown)} in kv_connector_extra_config; "
            f"accepted keys: {', '.join(general)}; with backend {chosen.name} also: {', '.join(chosen.keys)}"
        )
    for other in SETTINGS.values():
        if misplaced := sorted(key for key in extra if owners.get(key) is other):
            raise ConfigError(
                f"{', '.join(misplaced)}: {other.title} settings need backend \"{other.name}\", "
                f"but backend is {chosen.name!r}"
            )


# The keys transfer_mode replaced, still accepted for one release: each names the mode it turns on.
REPLACED_MODE_KEYS = {
    "use_layerwise": TransferMode.LAYERWISE,
    "load_async": TransferMode.ASYNC,
    "dynamic_buffer_layers": TransferMode.DYNAMIC_BUFFER,
}


def _replaced_mode_keys(extra: Mapping[str, Any]) -> dict[str, Any]:
    """``transfer_mode`` (and ``dynamic_buffer_count``) as the replaced keys say them; {} without any.

    They used to be three flags kept apart by cross-checks; what they say must
    still name one mode, and agree with the new keys where those are given too.
    """
    given = {key: _replaced_value(key, extra[key]) for key in REPLACED_MODE_KEYS if key in extra}
    if not given:
        return {}
    on = sorted(key for key, value in given.items() if value)
    if len(on) > 1:
        raise ConfigError(
            f"{', '.join(on)}: these select {' and '.join(str(REPLACED_MODE_KEYS[k]) for k in on)}; "
            f"choose one transfer_mode ({', '.join(TRANSFER_MODES)})"
        )
    mode = REPLACED_MODE_KEYS[on[0]] if on else TransferMode.WHOLE_BLOCKS
    if "transfer_mode" in extra:
        chosen = _transfer_mode("transfer_mode", extra["transfer_mode"])
        if against := sorted(k for k, value in given.items() if bool(value) != (chosen is REPLACED_MODE_KEYS[k])):
            raise ConfigError(
                f"transfer_mode, {', '.join(against)}: transfer_mode is {chosen}, "
                f"{', '.join(f'{k} is {json.dumps(given[k])}' for k in against)}; keep transfer_mode alone"
            )
    values: dict[str, Any] = {"transfer_mode": mode}
    replacement = f"transfer_mode: {mode}"
    if count := given.get("dynamic_buffer_layers"):
        if extra.get("dynamic_buffer_count", count) != count:
            raise ConfigError(
                f"dynamic_buffer_count, dynamic_buffer_layers: {extra['dynamic_buffer_count']!r} and {count} "
                "buffers; keep dynamic_buffer_count alone"
            )
        values["dynamic_buffer_count"] = count
        replacement += f", dynamic_buffer_count: {count}"
    for key in given:
        _warn_replaced(key, replacement)
    return values


def _replaced_value(key: str, value: Any) -> bool | int:
    if key != "dynamic_buffer_layers":
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, int) or value == 1 or value < 0:
        raise ConfigError(f"{key}: expected 0 (off) or an integer >= 2, got {value!r}")
    return value


@functools.cache  # once per process: the scheduler and a worker may share one
def _warn_replaced(key: str, replacement: str) -> None:
    logger.warning("kv_connector_extra_config: %s is deprecated and goes in the next release; write %s instead",
                   key, replacement)
