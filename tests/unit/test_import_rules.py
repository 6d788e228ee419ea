"""The package's import rules (``docs/architecture.md``, "Import rules"), read off the sources.

``shared/`` sits below the connector, the dynamic buffer and migration; the buffer and migration
never reach into the connector (the composition root); the buffer reaches vLLM only through
``vllm_compat``. Over the whole package, no module reaches itself through its imports, and no two
sub-packages import each other. Every import counts: at module level, inside functions (the lazy
ones) and under ``TYPE_CHECKING``, so each file is parsed with ``ast`` rather than imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
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


# The package's import graph: module -> {module of the package it imports: "file:line" of the first such import}.
Graph = Mapping[str, Mapping[str, str]]


def _targets(node: ast.Import | ast.ImportFrom, path: Path, modules: Mapping[str, Path]) -> Iterator[str]:
    """The package's modules one import statement loads: ``from a import b`` loads ``a.b`` where that is
    a module, else ``a`` (a package's ``__init__`` runs too, before any of its modules, and is not counted:
    a package that re-exports its modules would otherwise close a circle with each of them)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names if alias.name in modules)
        return
    base, *named = _imported(node, path)
    for module in named:
        target = module if module in modules else base
        if target in modules:
            yield target


def import_graph() -> dict[str, dict[str, str]]:
    modules = {_module_of(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, dict[str, str]] = {}
    for module, path in sorted(modules.items()):
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, path, modules):
                    if target != module:
                        edges.setdefault(target, f"{path.relative_to(ROOT)}:{node.lineno}")
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, {}):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while (member := stack.pop()) != module:
                component.append(member)
            if component:
                found.append(sorted([module, *component]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def _one_circle(graph: Graph, component: list[str]) -> str:
    """One path round ``component`` (its first module back to itself), each step with its import line."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first, inside the component, back to the start
        module = frontier.pop(0)
        for target in graph[module]:
            if target == start:
                steps = [*paths[module], start]
                return " -> ".join(f"{a} ({graph[a][b]})" for a, b in zip(steps, steps[1:])) + f" -> {start}"
            if target in members and target not in paths:
                paths[target] = [*paths[module], target]
                frontier.append(target)
    return ", ".join(component)


def unit_of(module: str) -> str:
    """The sub-package a module belongs to: the first component under ``vllm_aio``. A loose module of
    the root is a unit of its own (``config.py``): the root is no layer but entry points (``registration``,
    which imports the connector), the contract with the user and vLLM (``config``, ``vllm_compat``) and
    bottom modules (``errors``, ``log``) that everything imports, so only its modules one by one can
    be held to the rule."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return parts[1] if (PACKAGE / parts[1]).is_dir() else f"{parts[1]}.py"


def mutual_units(graph: Graph) -> list[str]:
    """Each pair of units that import each other, at any depth, with one import line each way."""
    between: dict[tuple[str, str], str] = {}
    for module, edges in sorted(graph.items()):
        for target, where in sorted(edges.items()):
            pair = (unit_of(module), unit_of(target))
            if pair[0] != pair[1]:
                between.setdefault(pair, f"{where} imports {target}")
    return [
        f"{a} <-> {b}: {between[(a, b)]}; {between[(b, a)]}"
        for a, b in sorted(between)
        if a < b and (b, a) in between
    ]


def test_no_module_reaches_itself_through_its_imports():
    graph = import_graph()
    assert [_one_circle(graph, component) for component in circles(graph)] == []


def test_no_two_subpackages_import_each_other():
    assert mutual_units(import_graph()) == []


def test_the_graph_checks_find_a_circle_and_a_mutual_pair():
    graph = {
        "vllm_aio.buffer.plan": {"vllm_aio.registration": "plan.py:1"},
        "vllm_aio.registration": {"vllm_aio.connector.worker.worker": "registration.py:2"},
        "vllm_aio.connector.worker.worker": {"vllm_aio.buffer.plan": "worker.py:3", "vllm_aio.log": "worker.py:4"},
        "vllm_aio.log": {},
        "vllm_aio.migration.driver": {"vllm_aio.devtools.greedy": "driver.py:5"},
        "vllm_aio.devtools.greedy": {},
        "vllm_aio.devtools.load": {"vllm_aio.migration.transport": "load.py:6"},
        "vllm_aio.migration.transport": {},
    }
    assert circles(graph) == [["vllm_aio.buffer.plan", "vllm_aio.connector.worker.worker", "vllm_aio.registration"]]
    assert "vllm_aio.buffer.plan (plan.py:1) -> vllm_aio.registration" in _one_circle(graph, circles(graph)[0])
    assert mutual_units(graph) == [
        "devtools <-> migration: load.py:6 imports vllm_aio.migration.transport; "
        "driver.py:5 imports vllm_aio.devtools.greedy",
    ]


def test_shared_imports_nothing_of_connector_buffer_or_migration():
    assert violations("shared", "vllm_aio.connector", "vllm_aio.buffer", "vllm_aio.migration") == []


def test_buffer_imports_nothing_of_connector():
    assert violations("buffer", "vllm_aio.connector") == []


def test_migration_imports_nothing_of_connector():
    assert violations("migration", "vllm_aio.connector") == []


def test_scheduler_half_imports_no_torch_and_nothing_of_the_worker_half():
    assert violations("connector/scheduler", "torch", "vllm_aio.connector.worker") == []


def test_worker_half_imports_nothing_of_the_scheduler_half():
    assert violations("connector/worker", "vllm_aio.connector.scheduler") == []


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
