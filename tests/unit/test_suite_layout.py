"""The test suite's own layout: test modules share code through ``tests/harness/``, never each other.

A test module that imports another runs that module's tests' imports and module fixtures where they do
not belong, and ties the two files to one folder of ``sys.path``; ``conftest.py`` is pytest's to load,
not a module to import from. What tests share lives in ``tests/harness/`` and is imported as ``harness``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from harness.prerequisites import TESTS

CONFTEST_MAX_LINES = 200  # fixtures and hooks only: what they build on is the harness's


def imported_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Each import of ``tree`` (at any depth, relative ones with their dots) as (line, module)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, "." * node.level + (node.module or "")


def names_a_test_module(module: str) -> bool:
    """Whether ``module`` is (or is inside) a test module or a conftest."""
    parts = module.lstrip(".").split(".")
    return module.startswith(".") or any(part == "conftest" or part.startswith("test_") for part in parts)


def test_no_test_module_imports_another_test_module():
    wrong = [f"{path.relative_to(TESTS)}:{line}: imports {module}"
             for path in sorted(TESTS.rglob("test_*.py"))
             for line, module in imported_modules(ast.parse(path.read_text(), str(path)))
             if names_a_test_module(module)]
    assert not wrong, "test modules share code through tests/harness/, not each other:\n" + "\n".join(wrong)


def test_the_rule_names_test_modules_and_conftest_and_spares_the_harness():
    tree = ast.parse("import test_a\nfrom conftest import ROOT\nfrom .x import y\n"
                     "def f():\n    from tests.unit.test_b import c\n"
                     "from harness.engines import Engine\nimport pytest\n")
    assert [module for _, module in imported_modules(tree) if names_a_test_module(module)] == [
        "test_a", "conftest", ".x", "tests.unit.test_b"]


def test_conftest_holds_fixtures_and_hooks_only():
    lines = len((TESTS / "conftest.py").read_text().splitlines())
    assert lines <= CONFTEST_MAX_LINES, f"tests/conftest.py has {lines} lines: move what is not a fixture to harness/"
