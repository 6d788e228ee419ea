"""The package's import rules (``docs/architecture.md``, "Import rules"), read off the sources.

``shared/`` sits below the connector, the dynamic buffer and migration; the buffer and migration
never reach into the connector (the composition root); the buffer reaches vLLM only through
``vllm_compat``. Every import counts: at module level, inside functions (the lazy ones) and under
``TYPE_CHECKING``, so each file is parsed with ``ast`` rather than imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from harness.prerequisites import ROOT

PACKAGE = ROOT / "vllm_aio"


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, path: Path) -> Iterator[str]:
    """The modules one import statement names: ``from a import b`` names ``a`` and ``a.b`` (``b`` may
    be a module), and a relative import is resolved against the file's package."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = _module_of(path).split(".")
        if path.name != "__init__.py":
            package = package[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    yield base
    yield from (f"{base}.{alias.name}" for alias in node.names)


def _imports_in(source: str, path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in ``source``, at any depth of its syntax tree."""
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield from ((node.lineno, module) for module in _imported(node, path))


def imports(subpackage: str) -> list[tuple[str, str]]:
    """Every (file:line, module) imported anywhere in ``vllm_aio/<subpackage>/``."""
    return [
        (f"{path.relative_to(ROOT)}:{line}", module)
        for path in sorted((PACKAGE / subpackage).rglob("*.py"))
        for line, module in _imports_in(path.read_text(encoding="utf-8"), path)
    ]


def _under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def violations(subpackage: str, *forbidden: str) -> list[tuple[str, str]]:
    return [(where, module) for where, module in imports(subpackage) if _under(module, *forbidden)]


def test_shared_imports_nothing_of_connector_buffer_or_migration():
    assert violations("shared", "vllm_aio.connector", "vllm_aio.buffer", "vllm_aio.migration") == []


def test_buffer_imports_nothing_of_connector():
    assert violations("buffer", "vllm_aio.connector") == []


def test_migration_imports_nothing_of_connector():
    assert violations("migration", "vllm_aio.connector") == []


def test_buffer_imports_vllm_only_through_vllm_compat():
    assert violations("buffer", "vllm") == []


# The checks can fail: imports inside functions and under TYPE_CHECKING are found, relative ones resolved.
_HIDDEN_IMPORTS = """
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def lazy():
    from ..connector import worker
"""


def test_the_rules_see_lazy_type_checking_and_relative_imports():
    found = {module for _, module in _imports_in(_HIDDEN_IMPORTS, PACKAGE / "buffer" / "example.py")}
    assert {"vllm.config", "vllm_aio.connector", "vllm_aio.connector.worker"} <= found
