"""The margin of a greedy choice: how far the chosen token's logprob lies above the runner-up's.

The migration driver records it for every token it relays (``driver.py``): where
two generations of one prompt may part is where that margin is a near tie
(``devtools/greedy.py`` compares two generations by it).
"""

from __future__ import annotations

from collections.abc import Iterable


def top_two_gap(logprobs: Iterable[float]) -> float:
    """The margin of a greedy choice: its logprob minus the runner-up's (inf with one candidate)."""
    best = sorted(logprobs, reverse=True) + [float("-inf")] * 2
    return best[0] - best[1]
