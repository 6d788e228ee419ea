"""Every relative link of README.md and docs/*.md points at a file that exists (and, for a link
into a Markdown file, at one of its headings), so moving or renaming a page cannot leave dead links.

Links are Markdown's inline form, ``[text](target)`` and ``![alt](target)``, outside code spans and
fenced blocks; absolute URLs are not checked (the suite runs offline). Heading anchors follow
GitHub's rule: lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for repeats.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.prerequisites import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _prose(text: str) -> str:
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        slug = _slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text(encoding="utf-8")))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def dead_links(page: Path) -> list[str]:
    dead = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            dead.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            dead.append(f"{target}: no heading #{anchor} in {path or page.name}")
    return dead


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert dead_links(page) == []


def test_links_inside_code_are_not_links(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n`[a](missing.md)`\n\n```\n[b](missing.md)\n```\n[c](#title)\n")
    assert relative_links(page) == ["#title"]
    assert dead_links(page) == []


def test_a_missing_file_or_heading_is_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Some `code` heading (v2)\n")
    page = tmp_path / "page.md"
    page.write_text("[a](gone.md) [b](other.md#some-code-heading-v2) [c](other.md#nope) [d](https://x.org/y)\n")
    assert dead_links(page) == ["gone.md: no such file", "other.md#nope: no heading #nope in other.md"]
