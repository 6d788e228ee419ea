"""``Leases``: promised blocks are leased for a few steps of the engine's recent pace."""

from __future__ import annotations

import pytest

from vllm_aio.connector.scheduler.leases import LEASE_MIN_SECONDS, Leases
from vllm_aio.pool.keys import BlockParts

PARTS = BlockParts("ns", ("pp0.dcp0.h0",), (None,))


class LeasingBackend:
    def __init__(self, fails: bool = False) -> None:
        self.fails, self.leases = fails, []

    def lease_blocks(self, parts, hashes, seconds):
        if self.fails:
            raise ConnectionError("down")
        self.leases.append((parts, hashes, seconds))


def paced(intervals: list[float], max_seconds: float = 30.0) -> Leases:
    now = [0.0]
    leases = Leases(LeasingBackend(), max_seconds, clock=lambda: now[0])
    leases.tick()
    for interval in intervals:
        now[0] += interval
        leases.tick()
    return leases


@pytest.mark.parametrize(("intervals", "lease"), [
    ([], LEASE_MIN_SECONDS),  # no pace measured yet
    ([0.01] * 8, LEASE_MIN_SECONDS),  # fast steps: the floor
    ([2.0] * 8 + [600.0], 4 * 2.0),  # a few steps of the recent pace; an idle gap does not count
    ([20.0] * 8, 30.0),  # never longer than a load may take
])
def test_a_lease_lasts_a_few_steps_of_the_recent_pace(intervals, lease):
    assert paced(intervals).seconds() == pytest.approx(lease)


def test_held_blocks_are_leased_for_the_current_lease_time():
    backend = LeasingBackend()
    Leases(backend, 30.0, clock=lambda: 0.0).hold(PARTS, [b"h0", b"h1"])
    assert backend.leases == [(PARTS, [b"h0", b"h1"], LEASE_MIN_SECONDS)]


def test_a_store_that_fails_the_lease_fails_nothing_else():
    Leases(LeasingBackend(fails=True), 30.0, clock=lambda: 0.0).hold(PARTS, [b"h0"])
