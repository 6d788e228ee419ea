"""``benchmarks/_report.py``'s progress bar: on stderr, only for someone watching a terminal."""

from __future__ import annotations

import io
import sys

import pytest

from benchmarks._report import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stderr,quick,drawn", [(Terminal(), False, True), (Terminal(), True, False),
                                                (io.StringIO(), False, False)],
                         ids=["terminal", "quick", "not-a-terminal"])
def test_progress_is_drawn_on_a_terminal_stderr_unless_quick(monkeypatch, capsys, stderr, quick, drawn):
    monkeypatch.setattr(sys, "stderr", stderr)
    assert list(progress(iter(range(3)), 3, "cases", quick)) == [0, 1, 2]
    assert ("cases" in stderr.getvalue()) == drawn
    assert capsys.readouterr().out == ""  # never on stdout, where the tables go
