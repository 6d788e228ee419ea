"""Whether two greedy generations of one prompt agree, where rounding leaves them free to part.

Greedy decoding takes the top token. Where the top two logprobs lie within a
few units in the last place of each other (``NEAR_TIE``), rounding that depends
on how the KV was computed (loaded or recomputed, written by a decode or by a
prefill, in which batch, on which CPU kernels) may pick either, and every token
after it then legitimately differs. On CPUs with AMX, for instance, vLLM's recomputed bf16 KV differs from
its decode-written KV by 1-2 ulp, and the greedy tokens seen to part there had
top-two gaps of 0.016-0.031.

So two generations agree when they are equal token for token until they part,
they part (if at all) at a near tie of the reference, and their logprobs lie
within a tolerance until then. Tokens that pass through a near tie together
keep being compared: their context is still the same. A wrong byte moves
logprobs by more than the tolerance, or parts the tokens where the reference
had a clear choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The top-two gap below which a greedy token is a near tie, by the dtype the model ran in. In bf16 a
# logit of magnitude 4-8 has an ulp of 1/32, and KV an ulp or two apart moves logits by about that;
# in float32 two paths differ by ~1e-5.
NEAR_TIE = {"bfloat16": 0.07, "float32": 2e-3}
# Logprobs of two such paths agree to within this before they part (bf16: under two ulps of a logit).
LOGPROB_TOLERANCE = {"bfloat16": 0.05, "float32": 2e-3}


@dataclass(frozen=True)
class Agreement:
    compared: int  # leading tokens equal in both: those whose logprobs were compared
    parted_at_near_tie: bool | None  # None: never parted; False: parted where the reference had a clear choice
    worst_logprob_gap: float  # over the compared tokens

    @property
    def same_tokens(self) -> bool:
        return self.parted_at_near_tie is not False

    def within(self, tolerance: float) -> bool:
        return self.same_tokens and self.worst_logprob_gap <= tolerance


def agreement(got_tokens: Sequence[int], got_logprobs: Sequence[float], want_tokens: Sequence[int],
              want_logprobs: Sequence[float], want_margins: Sequence[float], near_tie: float) -> Agreement:
    """``got`` against the reference ``want``; a margin under ``near_tie`` (``NEAR_TIE``) is a near tie."""
    common = min(len(got_tokens), len(want_tokens))
    parted = next((i for i in range(common) if got_tokens[i] != want_tokens[i]), None)
    if parted is None and len(got_tokens) != len(want_tokens):
        parted = common  # one stopped early: a difference like any other (no margin excuses it)
        at_tie: bool | None = False
    else:
        at_tie = None if parted is None else want_margins[parted] < near_tie
    compared = common if parted is None else parted
    gaps = [abs(a - b) for a, b in zip(got_logprobs[:compared], want_logprobs[:compared])]
    return Agreement(compared, at_tie, max(gaps, default=0.0))
