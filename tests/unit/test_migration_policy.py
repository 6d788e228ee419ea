"""The priority policy's decisions (``vllm_aio.migration.policy``), on made-up loads and requests."""

from __future__ import annotations

from vllm_aio.migration.policy import Candidate, Load, Move, pick_moves, pressured, waiting_blocks

BLOCK = 32
A, B, C = "http://a", "http://b", "http://c"
CALM = Load(waiting=0, preemptions=3, kv_usage=0.2, kv_blocks=1000)  # 800 free
BUSY = Load(waiting=2, preemptions=3, kv_usage=0.99, kv_blocks=100)  # 1 free


def preempting(load: Load) -> Load:
    return Load(load.waiting, load.preemptions + 1, load.kv_usage, load.kv_blocks)


def request(rid: str, instance: str = A, priority: int = 1, arrival: float = 0.0, tokens: int = 300) -> Candidate:
    return Candidate(rid, instance, priority, arrival, tokens)


def test_waiting_at_two_polls_running_is_pressure():
    assert pressured(BUSY, BUSY)


def test_waiting_with_room_in_the_kv_cache_is_no_pressure():
    # Requests wait for the step's token budget too (a burst of prefills): no move relieves that.
    roomy = Load(waiting=2, preemptions=3, kv_usage=0.77, kv_blocks=56)
    assert not pressured(roomy, roomy)
    assert not pressured(roomy, BUSY)


def test_waiting_with_fewer_blocks_free_than_the_smallest_waiting_prompt_is_pressure():
    # A CI run: two 10-block prompts waited for seconds with 8 of 56 blocks free (86% used), nothing preempted.
    short = Load(waiting=2, preemptions=3, kv_usage=48 / 56, kv_blocks=56)
    assert pressured(short, short, waiting_need=10)
    assert not pressured(short, short, waiting_need=8)  # room for it: it waits for the token budget
    assert not pressured(short, short)  # nothing known about what waits: only a nearly full cache counts


def test_waiting_blocks_are_the_smallest_unstarted_request_per_instance():
    candidates = [Candidate("r1", A, 1, 0.0, 300, started=False), Candidate("r2", A, 1, 0.0, 200, started=False),
                  Candidate("b", B, 1, 0.0, 33, started=False), Candidate("running", A, 1, 0.0, 40, started=True)]
    assert waiting_blocks(candidates, BLOCK) == {A: 7, B: 2}  # 200 tokens: 7 blocks of 32


def test_a_waiting_prompt_without_room_moves_the_most_important_request():
    short = Load(waiting=2, preemptions=3, kv_usage=48 / 56, kv_blocks=56)
    candidates = [Candidate("high", A, 0, 1.0, 400, started=True), Candidate("low", A, 1, 0.0, 300, started=False)]
    assert pick_moves({A: short, B: CALM}, {A: short, B: CALM}, candidates, BLOCK) == [Move("high", A, B)]


def test_waiting_at_one_poll_only_is_no_pressure():
    calm_before = Load(0, 3, 0.5, 100)
    assert not pressured(calm_before, BUSY)
    assert not pressured(None, BUSY)  # a first poll has nothing to compare with


def test_a_preemption_since_the_last_poll_is_pressure():
    quiet = Load(0, 3, 0.9, 100)
    assert pressured(quiet, preempting(quiet))
    assert not pressured(quiet, quiet)


def test_the_highest_priority_request_moves_to_the_instance_with_the_most_free_kv():
    before = {A: BUSY, B: CALM, C: CALM}
    now = {A: BUSY, B: Load(0, 0, 0.5, 1000), C: CALM}
    candidates = [request("low1", priority=5), request("high", priority=0, arrival=9.0), request("low2", priority=5)]
    assert pick_moves(before, now, candidates, BLOCK) == [Move("high", A, C)]


def test_among_equal_priorities_the_earliest_arrival_moves():
    candidates = [request("late", arrival=2.0), request("early", arrival=1.0), request("later", arrival=3.0)]
    assert pick_moves({A: BUSY, B: CALM}, {A: BUSY, B: CALM}, candidates, BLOCK) == [Move("early", A, B)]


def test_equally_free_targets_go_to_the_first_instance():
    loads = {A: BUSY, B: CALM, C: CALM}
    assert pick_moves(loads, loads, [request("r")], BLOCK) == [Move("r", A, B)]


def test_nothing_moves_when_no_instance_is_pressured():
    loads = {A: CALM, B: CALM}
    assert pick_moves(loads, loads, [request("r"), request("s", B)], BLOCK) == []


def test_nothing_moves_without_a_target_that_has_room():
    small = Load(0, 0, 0.9, 100)  # 10 free blocks: not enough for a 300-token request
    assert pick_moves({A: BUSY, B: small}, {A: BUSY, B: small}, [request("r")], BLOCK) == []


def test_a_pressured_instance_is_no_target():
    loads = {A: BUSY, B: BUSY}
    assert pick_moves(loads, loads, [request("r"), request("s", B)], BLOCK) == []


def test_requests_of_calm_instances_stay():
    loads = {A: BUSY, B: CALM}
    assert pick_moves(loads, loads, [request("calm", B, priority=0), request("r", A, priority=3)], BLOCK) == [
        Move("r", A, B)]


def test_instances_with_a_move_in_flight_are_neither_sources_nor_targets():
    loads = {A: BUSY, B: CALM, C: CALM}
    assert pick_moves(loads, loads, [request("r")], BLOCK, busy={A}) == []
    assert pick_moves(loads, loads, [request("r")], BLOCK, busy={B}) == [Move("r", A, C)]


def test_one_target_is_not_overfilled_by_two_sources_at_one_poll():
    d = "http://d"
    target = Load(0, 0, 0.0, 15)  # room for one 300-token request (10 blocks with its next token), not two
    loads = {A: BUSY, d: BUSY, B: target}
    moves = pick_moves(loads, loads, [request("r", A), request("s", d)], BLOCK)
    assert moves == [Move("r", A, B)]


def test_free_blocks_come_from_usage_and_the_cache_size():
    assert Load(0, 0, 0.25, 1000).free_blocks == 750
