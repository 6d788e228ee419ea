"""Comparing two greedy generations (``vllm_aio/devtools/greedy.py``)."""

from __future__ import annotations

from vllm_aio.devtools.greedy import agreement
from vllm_aio.migration.margin import top_two_gap

TIE = 0.05
TOKENS = [5, 6, 7, 8]
LOGPROBS = [-1.0, -2.0, -0.5, -3.0]
MARGINS = [1.0, 0.01, 0.8, 0.6]  # token 1 is a near tie


def test_the_gap_is_the_greedy_choice_over_the_runner_up():
    assert top_two_gap([-2.5, -0.5, -1.0]) == 0.5
    assert top_two_gap([-0.1]) == float("inf")


def test_equal_generations_agree_over_every_token():
    match = agreement(TOKENS, LOGPROBS, TOKENS, LOGPROBS, MARGINS, TIE)
    assert (match.compared, match.parted_at_near_tie, match.within(0.0)) == (4, None, True)


def test_generations_may_part_at_a_near_tie_of_the_reference():
    match = agreement([5, 9, 1, 1], LOGPROBS, TOKENS, LOGPROBS, MARGINS, TIE)
    assert (match.compared, match.parted_at_near_tie, match.same_tokens) == (1, True, True)


def test_parting_where_the_reference_had_a_clear_choice_disagrees():
    match = agreement([5, 6, 9, 8], LOGPROBS, TOKENS, LOGPROBS, MARGINS, TIE)
    assert (match.compared, match.parted_at_near_tie, match.same_tokens) == (2, False, False)


def test_tokens_passing_a_near_tie_together_keep_being_compared():
    got_logprobs = [-1.0, -2.0, -0.5, -3.2]
    match = agreement(TOKENS, got_logprobs, TOKENS, LOGPROBS, MARGINS, TIE)
    assert match.compared == 4 and not match.within(0.1)  # the last token's logprob is 0.2 off


def test_logprobs_are_compared_only_before_the_tokens_part():
    got_logprobs = [-1.0, -2.0, -9.0, -9.0]
    match = agreement([5, 6, 1, 1], got_logprobs, [5, 6, 2, 2], LOGPROBS, [1.0, 1.0, 0.01, 1.0], TIE)
    assert match.within(0.01) and match.compared == 2


def test_a_generation_that_stopped_early_disagrees():
    match = agreement(TOKENS[:2], LOGPROBS[:2], TOKENS, LOGPROBS, MARGINS, TIE)
    assert not match.same_tokens and match.compared == 2
