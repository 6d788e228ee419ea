"""The end-to-end tests' comparisons of what an engine generated against a reference run.

Greedy tokens must agree until they part, and they may part only at a near tie of the reference
(where rounding may pick either: ``vllm_aio/devtools/greedy.py``); logprobs must agree within the
tolerance of the dtype the reference ran in until then.
"""

from __future__ import annotations

from types import SimpleNamespace

from vllm_aio.devtools.greedy import LOGPROB_TOLERANCE, NEAR_TIE, agreement


def assert_same_generation(got: list[dict], want: list[dict], tolerance: float | None = None) -> None:
    """Prompt by prompt: the same greedy tokens until they part, and they part only at a near tie of
    the baseline (where rounding may pick either: ``devtools/greedy.py``); logprobs within
    ``tolerance`` (default: ``LOGPROB_TOLERANCE`` for the dtype the baseline ran in) until then."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["dtype"] == w["dtype"], f"prompt {i}: {g['dtype']} against a {w['dtype']} baseline"
        _assert_agree(SimpleNamespace(**g), SimpleNamespace(**w), w["dtype"], tolerance, f"prompt {i}: ")


def assert_same_continuation(got, want, dtype: str = "float32") -> None:
    """``assert_same_generation`` for two ``migration.driver.Generation`` of one prompt, from servers
    that ran in ``dtype`` (the migration tests' servers: float32, as ``SERVER_ARGS`` in servers.py)."""
    _assert_agree(got, want, dtype)


def _assert_agree(got, want, dtype: str, tolerance: float | None = None, label: str = "") -> None:
    """``got`` against ``want``, each with ``token_ids`` and ``logprobs`` (``want`` with ``margins``)."""
    match = agreement(got.token_ids, got.logprobs, want.token_ids, want.logprobs, want.margins, NEAR_TIE[dtype])
    bound = LOGPROB_TOLERANCE[dtype] if tolerance is None else tolerance
    assert match.same_tokens, f"{label}tokens part at token {match.compared}, not at a near tie"
    assert match.worst_logprob_gap <= bound, f"{label}logprob differs by {match.worst_logprob_gap}"


def assert_output_varies(results: list[dict]) -> None:
    """An equality check on a model that repeats one token would prove nothing."""
    assert all(len(set(r["token_ids"])) >= len(r["token_ids"]) // 2 for r in results), "output does not vary"
