"""Mooncake's settings: a ``MOONCAKE_CONFIG_PATH`` file, inline keys, two variables.

Settings users of vLLM and vllm-ascend already know: a ``MOONCAKE_CONFIG_PATH``
file written for their connectors works unchanged. Keys that mean something
here are honoured (``tenant_id``; ``mode`` decides whether this engine
contributes memory), theirs that do not are ignored and named in one log
line, and any other key fails at start: a typo must fail, not silently miss.
Precedence: the file, then the inline keys of ``kv_connector_extra_config``,
then ``MOONCAKE_MASTER`` / ``MOONCAKE_GLOBAL_SEGMENT_SIZE``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_aio.backends.remote import split_address
from vllm_aio.backends.settings import BackendSettings, parse_size
from vllm_aio.errors import ConfigError
from vllm_aio.log import get_logger

logger = get_logger(__name__)

ENV_CONFIG_PATH = "MOONCAKE_CONFIG_PATH"
_ENV_OVERRIDES = {"MOONCAKE_MASTER": "master_server_address", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "global_segment_size"}
_ZERO_SIZE_RE = re.compile(r"^\s*0+(\.0+)?\s*([KMGT]?B?)\s*$", re.IGNORECASE)

DEFAULT_TENANT_ID = "default"  # Mooncake's tenant when none is given
# ``mode`` in vLLM's MooncakeStoreConnector files: whether the engine
# contributes ``global_segment_size`` (embedded) or no memory (standalone-store).
MODES = ("embedded", "standalone-store")
# Keys that files written for vLLM's MooncakeStoreConnector
# (vllm/distributed/mooncake_store.py) or vllm-ascend's AscendStoreConnector
# (ascend_store/backend/mooncake_backend.py, over its versions) may hold and
# that mean nothing to this backend: key -> why it is ignored. ``enable_offload``
# too: vLLM never passes it to setup (it sizes vLLM's own disk staging), and
# passing enable_ssd_offload to an engine's client fails setup (-1300) unless
# the master runs with --enable_offload.
_SSD_TIER = "the SSD tier is the memory owner's: mooncake_client --enable_offload"
_PLACEMENT = "placement hints: puts use Mooncake's default placement"
_IGNORED_FILE_KEYS = {
    "enable_offload": _SSD_TIER,
    "enable_ssd_offload": _SSD_TIER,
    "ssd_offload_path": _SSD_TIER,
    "enable_ssd_prefetch": _SSD_TIER,
    "ssd_prefetch_cooldown_sec": _SSD_TIER,
    "ssd_prefetch_dedup_ttl_sec": _SSD_TIER,
    "ssd_get_wait_ms": _SSD_TIER,
    "alloc_in_same_node": _PLACEMENT,
    "prefer_alloc_in_same_node": _PLACEMENT,
    "preferred_segment": _PLACEMENT,
    "use_ascend_direct": "vllm-ascend's transport switch: protocol chooses the transport",
    "staging_buffer_size": "vllm-ascend's device staging: this backend stages by itself",
}


@dataclass(frozen=True)
class MooncakeSettings(BackendSettings):
    name: ClassVar[str] = "mooncake"
    title: ClassVar[str] = "Mooncake"
    keys: ClassVar[tuple[str, ...]] = (
        "master_server_address", "local_hostname", "metadata_server", "protocol", "device_name",
        "global_segment_size", "local_buffer_size", "tenant_id",
    )

    # Address ("host:port") of the mooncake_master RPC service. Required.
    master_server_address: str
    # Address other clients reach this one at; empty: the local address that
    # routes to the master (127.0.0.1 for a master on loopback).
    local_hostname: str = ""
    # Where transfer engines find each other; P2PHANDSHAKE needs no server.
    metadata_server: str = "P2PHANDSHAKE"
    # Transfer protocol: "tcp", or "rdma" / "ascend" passed through to Mooncake.
    protocol: str = "tcp"
    # RDMA / Ascend device names ("" lets Mooncake choose).
    device_name: str = ""
    # Bytes this process contributes to the pool (int or "4GB"); 0: none,
    # a standalone memory-owning client holds the pool.
    global_segment_size: int = 0
    # Bytes of the client's own transfer buffer (int or "16MB"); zero-copy
    # batches into registered memory do not use it.
    local_buffer_size: int = 16 << 20
    # Mooncake tenant of every client of this engine (scheduler and workers).
    # Its keys are scoped by it (``_scoped``), so tenants see none of each
    # other's keys on any master; a master started with --enable_multi_tenants
    # and a quota file also enforces quotas (there, puts of a tenant the file
    # does not name fail). Null or blank in a file means "default", as in vLLM.
    tenant_id: str = DEFAULT_TENANT_ID

    def __post_init__(self) -> None:
        for field in ("metadata_server", "protocol", "tenant_id"):
            if not getattr(self, field):
                raise ConfigError(f"{field}: must not be empty")
        split_address("master_server_address", self.master_server_address)

    @classmethod
    def load(
        cls, inline: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> MooncakeSettings:
        """Settings from the ``MOONCAKE_CONFIG_PATH`` file, then ``inline``, then env overrides."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        mode = None
        if path := environ.get(ENV_CONFIG_PATH):
            file_values, mode = _read_file(path)
            values.update(file_values)
        values.update(_check_keys(inline or {}, "the inline Mooncake settings"))
        for env, key in _ENV_OVERRIDES.items():
            if env in environ:
                values[key] = environ[env]
        if "master_server_address" not in values:
            raise ConfigError(
                "master_server_address: missing; set it in the JSON file named by "
                f"{ENV_CONFIG_PATH}, in the inline settings, or with MOONCAKE_MASTER"
            )
        settings = cls(**{key: _coerce(key, value) for key, value in values.items()})
        if mode is not None:
            _check_mode(mode, settings.global_segment_size, f"{ENV_CONFIG_PATH} file {path}")
        return settings

    def resolved_hostname(self) -> str:
        """``local_hostname``, or the local address that routes to the master."""
        if self.local_hostname:
            return self.local_hostname
        return route_address(split_address("master_server_address", self.master_server_address)[0])


_FIELDS = frozenset(MooncakeSettings.keys)
_SIZE_FIELDS = ("global_segment_size", "local_buffer_size")  # 0 allowed: "no memory"


def _read_json(path: str) -> Mapping[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{ENV_CONFIG_PATH}: cannot read Mooncake settings from {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{ENV_CONFIG_PATH}: {path} must hold a JSON object, got {type(data).__name__}")
    return data


def _read_file(path: str) -> tuple[dict[str, Any], str | None]:
    """A settings file's keys that are fields, and its ``mode``; logs the keys it ignores."""
    where = f"{ENV_CONFIG_PATH} file {path}"
    data = _check_keys(_read_json(path), where, also_accepted=["mode", *_IGNORED_FILE_KEYS])
    mode = data.get("mode")
    if mode is not None and mode not in MODES:
        raise ConfigError(f"mode: expected one of {', '.join(MODES)}, got {mode!r} in {where}")
    ignored = tuple(sorted(set(data) & set(_IGNORED_FILE_KEYS)))
    if ignored:
        _log_ignored(where, ignored)
    return {key: value for key, value in data.items() if key in _FIELDS}, mode


@functools.cache  # once per process and file: the scheduler and a worker may share one
def _log_ignored(where: str, keys: tuple[str, ...]) -> None:
    by_reason: dict[str, list[str]] = {}
    for key in keys:
        by_reason.setdefault(_IGNORED_FILE_KEYS[key], []).append(key)
    reasons = "; ".join(f"{', '.join(names)} ({why})" for why, names in by_reason.items())
    logger.warning("%s: ignoring keys that mean nothing to vllm_aio: %s", where, reasons)


def _check_mode(mode: str, global_segment_size: int, where: str) -> None:
    """vLLM's rule, which refuses the same files: embedded contributes memory, standalone-store none."""
    if mode == "standalone-store" and global_segment_size:
        raise ConfigError(
            f'mode, global_segment_size: mode "standalone-store" in {where} contributes no memory, but '
            f'global_segment_size is {global_segment_size} bytes; set it to 0, or use mode "embedded"'
        )
    if mode == "embedded" and not global_segment_size:
        raise ConfigError(
            f'mode, global_segment_size: mode "embedded" in {where} contributes global_segment_size bytes, '
            'but it is 0 or missing; give a size such as "4GB", or use mode "standalone-store"'
        )


def _check_keys(
    values: Mapping[str, Any], where: str, also_accepted: Sequence[str] = ()
) -> Mapping[str, Any]:
    accepted = set(_FIELDS) | set(also_accepted)
    unknown = sorted(set(values) - accepted)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(unknown)} in {where}; accepted keys: {', '.join(sorted(accepted))}"
        )
    return values


def _coerce(key: str, value: Any) -> Any:
    if key in _SIZE_FIELDS:
        return _parse_size_or_zero(key, value)
    if key == "tenant_id":
        return _tenant_id(value)
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def _tenant_id(value: Any) -> str:
    """vLLM's rule: null or blank is the default tenant, surrounding blanks are dropped."""
    if value is None:
        return DEFAULT_TENANT_ID
    if not isinstance(value, str) or not value.isprintable():
        raise ConfigError(f"tenant_id: expected a string of printable characters or null, got {value!r}")
    return value.strip() or DEFAULT_TENANT_ID


def _parse_size_or_zero(key: str, value: Any) -> int:
    """Like ``parse_size``, but 0 (or "0GB") means "no memory"."""
    if not isinstance(value, bool):
        if value == 0 or (isinstance(value, str) and _ZERO_SIZE_RE.match(value)):
            return 0
    return parse_size(key, value)


def route_address(host: str) -> str:
    """The local IP the kernel would use to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
