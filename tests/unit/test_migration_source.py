"""Unit tests of ``vllm_aio.migration.source.flush``: waiting for a running request's blocks, failing fast."""

from __future__ import annotations

import pytest

from vllm_aio.migration import source
from vllm_aio.migration.target import MigrationRefused


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.5  # each look at the clock is half a second later
        return self.now


class Flushes:
    """A stand-in for ``FlushRequests`` whose requests always are in one state."""

    def __init__(self, matches: bool | None) -> None:
        self.matches, self.asked, self.forgotten = matches, [], []

    def ask(self, last_hash, count):
        self.asked.append((last_hash, count))

    def state(self, last_hash):
        return self.matches

    def forget(self, last_hash):
        self.forgotten.append(last_hash)


class Backend:
    def __init__(self, answers: list[int]) -> None:
        self.answers = answers

    def count_complete_blocks(self, parts, hashes):
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


HASHES = [b"h0", b"h1", b"h2"]
PARTS = "parts"


def test_flush_returns_at_once_when_every_block_is_stored():
    flushes = Flushes(matches=False)
    assert source.flush(flushes, Backend([3]), PARTS, HASHES, deadline=10, clock=Clock()) == 3
    assert flushes.asked == []


def test_flush_asks_for_the_blocks_and_waits_until_the_blocks_are_stored():
    flushes = Flushes(matches=True)
    assert source.flush(flushes, Backend([2, 2, 2, 3]), PARTS, HASHES, deadline=100, clock=Clock()) == 3
    assert flushes.asked == [(b"h2", 3)] and flushes.forgotten == [b"h2"]


def test_flush_fails_fast_when_no_running_request_holds_the_sequence():
    flushes = Flushes(matches=False)
    clock = Clock()
    with pytest.raises(MigrationRefused) as err:
        source.flush(flushes, Backend([2]), PARTS, HASHES, deadline=100, clock=clock)
    assert err.value.status == 409 and "finished" in str(err.value)
    assert flushes.forgotten == [b"h2"] and clock.now < 2


def test_flush_on_an_engine_that_runs_no_step_fails_after_the_idle_time():
    flushes = Flushes(matches=None)
    clock = Clock()
    with pytest.raises(MigrationRefused) as err:
        source.flush(flushes, Backend([2]), PARTS, HASHES, deadline=100, clock=clock)
    assert err.value.status == 409 and source.IDLE_S <= clock.now < source.IDLE_S + 2


def test_flush_of_a_matched_request_gives_up_at_the_deadline():
    flushes = Flushes(matches=True)
    with pytest.raises(MigrationRefused) as err:
        source.flush(flushes, Backend([2]), PARTS, HASHES, deadline=5, clock=Clock())
    assert err.value.status == 504
