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
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

RESULTS = Path(__file__).resolve().parent / "results"
T = TypeVar("T")
Series = dict[str, tuple[Sequence[float], Sequence[float]]]  # name -> (xs, ys)


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


def plot_argument(parser: argparse.ArgumentParser) -> None:
    """``--plot PATH``: off unless given (a plot needs matplotlib, from the ``test`` extra; GPU hosts have
    torch only)."""
    parser.add_argument("--plot", type=Path, help="also draw the main comparison as a PNG at PATH (needs matplotlib)")


def bar_chart(path: Path, title: str, panels: dict[str, dict[str, float]]) -> None:
    """Bar charts side by side, one per panel (its axis label -> {bar label: value}), the bars in the given order."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 4.8), dpi=100, squeeze=False)
    for ax, (axis, bars) in zip(axes[0], panels.items()):
        ax.bar(range(len(bars)), list(bars.values()), color=[f"C{i}" for i in range(len(bars))])
        ax.set_xticks(range(len(bars)), list(bars), rotation=30, ha="right", fontsize="small")
        ax.set(ylabel=axis)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")


def progress(items: Iterable[T], total: int, what: str, quick: bool) -> Iterator[T]:
    """``items`` with a progress bar on stderr, only where someone watches: a terminal, not ``--quick``."""
    if quick or not sys.stderr.isatty():
        yield from items
        return
    from tqdm import tqdm  # vLLM's dependency; imported only when a bar is drawn

    yield from tqdm(items, total=total, desc=what, file=sys.stderr, leave=False)


def plot(path: Path, title: str, axes: tuple[str, str], series: Series, ceilings: Series | None = None,
         log: str = "") -> None:
    """One line chart: a line with markers per series, a dashed line per ceiling (what the series are bound by).

    ``log`` names the logarithmic axes: "", "x", "y" or "xy".
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4), dpi=100)
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    for name, (xs, ys) in (ceilings or {}).items():
        ax.plot(xs, ys, linestyle="--", label=name)
    ax.set(title=title, xlabel=axes[0], ylabel=axes[1], xscale="log" if "x" in log else "linear",
           yscale="log" if "y" in log else "linear")
    if "y" not in log:
        ax.set_ylim(bottom=0)  # ratios to the ceiling read true from zero
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")
