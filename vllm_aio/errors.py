"""The errors the package raises to its user: ``ConfigError`` for a configuration value that cannot be used.

A bottom module: it imports nothing of the package, so every module (the config boundary, each
backend's settings, the connector, the buffer's plan) can import it without a cycle.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key."""
