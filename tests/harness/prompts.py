"""The prompts the end-to-end tests send: random token ids, and the named sets of the session baseline.

``PROMPTS`` lists every set whose no-connector output the session's ``baseline`` fixture computes
once (``conftest.py``); a test that compares against that baseline sends one of these sets.
"""

from __future__ import annotations

import random


def make_prompts(seed: int, lengths: list[int], vocab: int = 2048) -> list[list[int]]:
    """Random token-id prompts (ids 3.. skip the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# Every prompt the end-to-end tests send; the no-connector baseline runs them once.
PROMPTS = {
    "warm": make_prompts(1, [400, 1000, 2000]),
    "pd": make_prompts(2, [700, 1500]),
    "pd_new": make_prompts(3, [600]),
    "small_pool": make_prompts(4, [900, 1100, 1300]),
    "faults": make_prompts(5, [800, 1200]),
    "garbage": make_prompts(8, [800, 1200]),
    "down": make_prompts(9, [800, 1200]),
    "tp2": make_prompts(6, [900, 1300]),
    "poison": make_prompts(7, [1120]),  # its first 640 tokens stored first (test_e2e_pool.py)
}
