"""What every benchmark shares on the way out: its command line basics, its tables, its results file.

No torch and no vLLM here: the engine benchmarks' parent processes import it too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def arguments(doc: str, script: str) -> argparse.ArgumentParser:
    """A parser with the options every benchmark takes: ``--quick`` and where the results go."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the smallest setting that still runs the real code path (a smoke test)")
    default = RESULTS / f"{script}.json"
    parser.add_argument("--json", "--out", dest="json", type=Path, default=default,
                        help=f"results JSON (default {default})")
    return parser


def print_markdown(head: Sequence[str], body: Sequence[Sequence[str]], left: int = 0, title: str = "") -> None:
    """A markdown table: the first ``left`` columns left-aligned, the others right-aligned."""
    if title:
        print(f"\n{title}\n")
    rows = [list(head)] + [list(r) for r in body]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i < left else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    print(line(rows[0]))
    print("|" + "|".join("-" * (w + 2) if i < left else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|")
    for r in rows[1:]:
        print(line(r))


def write_results(path: Path, script: str, started: float, **fields) -> float:
    """The run's JSON (what ran, where, when, how long, then ``fields``); returns the elapsed seconds."""
    elapsed = time.perf_counter() - started
    out = {"script": script, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv, "elapsed_s": elapsed,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, **fields}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"\nwrote {path} ({elapsed:.0f}s)")
    return elapsed
