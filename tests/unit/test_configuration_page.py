"""docs/configuration.md held against the code: every key of ``kv_connector_extra_config`` (the fields
of ``AioConfig`` and each backend's settings keys) with its default as the code has it, the keys
``transfer_mode`` replaced, every environment variable vllm_aio reads, and nothing that does not exist."""

from __future__ import annotations

import ast
import dataclasses
import enum
import json
import re
from dataclasses import dataclass
from typing import Any

import pytest

from harness.prerequisites import ROOT
from vllm_aio.backends import SETTINGS
from vllm_aio.backends.tiered_settings import REMOTES, WRITE_MODES
from vllm_aio.config import BACKENDS, MIGRATION_PROTOCOLS, REPLACED_MODE_KEYS, TRANSFER_MODES, AioConfig

PAGE = ROOT / "docs" / "configuration.md"
KEY_COLUMNS = ("Name", "Type", "Default", "Description")
ENV_SECTION = "Environment variables"
REQUIRED = "required"  # the Default cell of a key without a default
# The variables of vllm_aio and of the stores it drives (Mooncake's MC_*).
VARIABLE = re.compile(r"(VLLM_AIO|MOONCAKE|MMC|MC)_[A-Z0-9_]+")


@dataclass
class Row:
    section: str
    name: str
    cells: dict[str, str]


def _tables() -> list[tuple[str, tuple[str, ...], list[list[str]]]]:
    """(section heading, column names, rows of cells) of every table on the page."""
    tables, section, current = [], "", None
    for line in PAGE.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        if not line.startswith("|"):
            current = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if current is None:
            current = (section, tuple(cells), [])
            tables.append(current)
        elif not all(set(cell) <= {"-", ":"} for cell in cells):
            current[2].append(cells)
    return tables


def _name(cell: str) -> str:
    match = re.fullmatch(r"`([^`]+)`", cell)
    assert match, f"a Name cell holds one name in backticks: {cell!r}"
    return match.group(1)


def _rows(*, env: bool) -> list[Row]:
    """The rows of the key tables (env False) or of the variable tables (env True)."""
    return [
        Row(section, _name(cells[0]), dict(zip(columns, cells)))
        for section, columns, rows in _tables()
        if columns == KEY_COLUMNS and (section == ENV_SECTION) == env
        for cells in rows
    ]


KEYS = {row.name: row for row in _rows(env=False)}
VARIABLES = {row.name: row for row in _rows(env=True)}


def _page_default(cell: str) -> Any:
    """The default as JSON, the first backticked span of the Default cell (a gloss may follow)."""
    if cell == REQUIRED:
        return REQUIRED
    match = re.match(r"`([^`]+)`", cell)
    assert match, f"a Default cell starts with the JSON value in backticks, or says {REQUIRED}: {cell!r}"
    return json.loads(match.group(1))


def _as_json(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    return list(value) if isinstance(value, tuple) else value


def _code_default(cls: type, key: str) -> Any:
    field = {f.name: f for f in dataclasses.fields(cls)}.get(key)
    if field is None or (field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING):
        return REQUIRED  # a key that is no field with a default (the tiered store's remote_backend) must be given
    return _as_json(field.default if field.default is not dataclasses.MISSING else field.default_factory())


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b  # false is not 0, 30 is not "30"


GENERAL = {f.name: _code_default(AioConfig, f.name)
           for f in dataclasses.fields(AioConfig) if f.name != "backend_settings"}
# A key of several settings classes (the tiered store takes its tiers' keys) is the first one's, as in config.py.
_OWNER: dict[str, type] = {}
for _settings in SETTINGS.values():
    for _key in _settings.keys:
        _OWNER.setdefault(_key, _settings)
BACKEND_KEYS = {
    name: {key: _code_default(settings, key) for key in settings.keys if _OWNER[key] is settings}
    for name, settings in SETTINGS.items()
}


def _backend_section(name: str) -> str:
    (section,) = [s for s, _, _ in _tables() if s.startswith(f"Backend `{name}`")]
    return section


@pytest.mark.parametrize("key", sorted(GENERAL))
def test_every_general_key_has_a_row_outside_the_backend_sections_with_its_default(key):
    assert key in KEYS, f"{key} is not on {PAGE.name}"
    row = KEYS[key]
    assert not row.section.startswith("Backend "), row.section
    assert _same(_page_default(row.cells["Default"]), GENERAL[key]), (row.cells["Default"], GENERAL[key])


@pytest.mark.parametrize(("backend", "key"), [(b, k) for b, keys in BACKEND_KEYS.items() for k in sorted(keys)])
def test_every_backend_key_has_a_row_in_its_backends_section_with_its_default(backend, key):
    assert key in KEYS, f"{key} is not on {PAGE.name}"
    row = KEYS[key]
    assert row.section == _backend_section(backend)
    default = BACKEND_KEYS[backend][key]
    assert _same(_page_default(row.cells["Default"]), default), (row.cells["Default"], default)


def test_the_page_names_no_key_that_does_not_exist_and_each_once():
    names = [row.name for row in _rows(env=False)]
    known = set(GENERAL).union(*BACKEND_KEYS.values())
    assert sorted(set(names) - known) == []
    assert len(names) == len(set(names))


def test_the_replaced_keys_table_names_exactly_the_replaced_keys():
    (replaced,) = [rows for _, columns, rows in _tables() if columns == ("Name", "Replaced by")]
    assert [_name(cells[0]) for cells in replaced] == list(REPLACED_MODE_KEYS)
    for cells in replaced:
        assert f"`transfer_mode: \"{REPLACED_MODE_KEYS[_name(cells[0])].value}\"`" in cells[1]


@pytest.mark.parametrize(
    ("key", "values"),
    [("backend", BACKENDS), ("transfer_mode", TRANSFER_MODES), ("migration_protocol", MIGRATION_PROTOCOLS),
     ("remote_write", WRITE_MODES), ("remote_backend", tuple(REMOTES))],
)
def test_a_key_of_a_few_values_lists_every_accepted_value(key, values):
    assert re.findall(r"`([^`]+)`", KEYS[key].cells["Type"]) == list(values)


def _string_constants() -> set[str]:
    found = set()
    for path in (ROOT / "vllm_aio").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return found


def test_every_variable_vllm_aio_names_has_a_row():
    named = {text for text in _string_constants() if VARIABLE.fullmatch(text)}
    assert named, "no variable found: the search is broken"
    assert sorted(named - set(VARIABLES)) == []


def test_every_variable_on_the_page_is_named_by_the_code_tests_or_benchmarks():
    sources = [p for d in ("vllm_aio", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")] + [ROOT / "Makefile"]
    text = "\n".join(p.read_text() for p in sources if p.name != "test_configuration_page.py")
    missing = [name for name in VARIABLES if not re.search(rf"\b{re.escape(name)}\b", text)]
    assert missing == []
