"""``Residency``: which requests' blocks keep a private slot in every layer of the dynamic buffer."""

from __future__ import annotations

from vllm_aio.buffer.residency import Residency


def test_a_request_that_fits_takes_a_slot_per_block_and_promotes_those_with_kv():
    r = Residency(8)
    assert r.place("a", [7, 8, 9], loaded=2) == [7, 8]  # 9 only gets this step's tokens
    assert [r.slot(b) for b in (7, 8, 9)] == [0, 1, 2]
    assert r.free_slots == 5


def test_a_growing_request_keeps_its_slots_and_promotes_nothing_new():
    r = Residency(8)
    r.place("a", [7, 8], loaded=0)
    assert r.place("a", [7, 8, 9], loaded=2) == []  # block 9 is new: written, not loaded
    assert [r.slot(b) for b in (7, 8, 9)] == [0, 1, 2]


def test_a_request_that_does_not_fit_streams_and_gives_its_slots_back():
    r = Residency(3)
    r.place("a", [7, 8], loaded=0)
    assert r.place("a", [7, 8, 9, 10], loaded=2) == []
    assert r.slot(7) is None and r.free_slots == 3
    assert r.place("b", [1, 2, 3, 4], loaded=4) == [] and r.free_slots == 3


def test_requests_sharing_a_block_share_its_slot_until_the_last_lets_go():
    r = Residency(4)
    r.place("a", [7, 8, 9], loaded=3)
    assert r.place("b", [7, 8, 12], loaded=2) == []  # 7, 8 are resident already; 12 is new
    assert r.free_slots == 0
    r.release("a")
    assert r.slot(7) == 0 and r.slot(9) is None and r.free_slots == 1
    r.release("b")
    assert r.free_slots == 4


def test_a_request_admitted_again_promotes_its_blocks_again():
    r = Residency(4)
    r.place("a", [7, 8], loaded=0)
    r.release("a")  # preempted
    assert r.place("a", [3, 4], loaded=2) == [3, 4]
