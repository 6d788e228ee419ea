"""What every backend's settings share: sizes, the base class.

``config.py`` parses ``kv_connector_extra_config`` once, at the boundary: it
hands the keys that belong to the chosen backend to that backend's settings
class (registered in ``backends/__init__.py``), which adds what its own
environment variables and files say. Settings are plain data: parsing them
imports no store library, so the scheduler half imports none until a backend
is opened. This module imports nothing of the project but the contract and ``errors.py``, so
``config.py`` and every backend can import it without a cycle.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from vllm_aio.errors import ConfigError

_SIZE_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*$", re.IGNORECASE)


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


class BackendSettings(ABC):
    """One backend's settings (a frozen dataclass), parsed once by ``load``."""

    name: ClassVar[str]  # the value of ``backend`` that chooses this backend
    title: ClassVar[str]  # the backend's name in messages
    keys: ClassVar[tuple[str, ...]]  # its keys of kv_connector_extra_config

    @classmethod
    @abstractmethod
    def load(cls, inline: Mapping[str, Any], environ: Mapping[str, str]) -> BackendSettings:
        """From its keys of ``kv_connector_extra_config`` and its environment (variables, files)."""
