"""Concurrent streaming load on a running ``vllm serve``: what the load test and the soak benchmark send.

Traffic as deployments see it: many requests over a few shared prefixes (a
system prompt, a few-shot header, a conversation so far), each with a tail of
its own, streamed, ``concurrency`` of them in flight at a time. Prompts are
token ids (nothing is tokenized) drawn from a seed, so two runs send the same
requests and their outputs can be compared request by request.

Comparing two runs: greedy decoding picks the top token, and on a near tie
(the top two logprobs within ``tolerance``) float rounding that depends on
how the batch was formed can pick either; what follows then legitimately
differs. ``compare`` checks each output token for token until it parts from
the baseline, which it may only at one of the baseline's near ties, and the
logprobs until then within ``tolerance`` (``greedy.py``); a request that parted
at a near tie is counted, so a run where ties hide much can be told apart.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

from vllm_aio.devtools.greedy import agreement
from vllm_aio.migration.margin import top_two_gap


def server_args(max_num_seqs: int, max_model_len: int = 8192, shutdown_timeout: int | None = 30) -> list[str]:
    """``vllm serve`` flags for runs compared token for token: float32 (in bf16 the batch a request
    shares a step with moves its logprobs by up to ~0.03, and near ties are common; in float32 two
    runs differ by ~1e-5), vLLM's own prefix cache off (every cached token is then a pool hit),
    cached tokens reported per request, and a shutdown that drains (``None``: vLLM's default,
    which kills the engine's processes before the connector shuts down)."""
    drain = [] if shutdown_timeout is None else ["--shutdown-timeout", str(shutdown_timeout)]
    return ["--block-size", "32", "--max-model-len", str(max_model_len), "--no-enable-prefix-caching",
            "--enforce-eager", "--enable-prompt-tokens-details", "--dtype", "float32",
            "--max-num-seqs", str(max_num_seqs), *drain]


# The OpenMP thread count changes float rounding: pinned, as the engine tests do.
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0",
              "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}", "VLLM_LOG_STATS_INTERVAL": "1"}


@dataclass(frozen=True)
class LoadMix:
    """``num_requests`` prompts, each a shared prefix (one of ``num_prefixes``) plus a tail of its own."""

    num_requests: int = 200
    num_prefixes: int = 20
    prefix_tokens: tuple[int, int] = (1024, 4096)  # each prefix's length, drawn in this range
    tail_tokens: tuple[int, int] = (16, 160)
    max_tokens: int = 8
    seed: int = 0
    vocab_size: int = 2048

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        token = lambda: rng.randrange(3, self.vocab_size)  # noqa: E731 (ids 0-2 are special)
        prefixes = [[token() for _ in range(rng.randint(*self.prefix_tokens))] for _ in range(self.num_prefixes)]
        return [rng.choice(prefixes) + [token() for _ in range(rng.randint(*self.tail_tokens))]
                for _ in range(self.num_requests)]


@dataclass
class Outcome:
    """One request as the client saw it."""

    index: int
    prompt_tokens: int
    cached_tokens: int = 0
    ttft_s: float | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # top-1 minus top-2 logprob, per token
    longest_gap_s: float = 0.0  # the longest wait for a token, the first one's included
    error: str | None = None
    _last: float = field(default=0.0, repr=False)


def stream_completion(base: str, model: str, index: int, prompt: list[int], max_tokens: int,
                      timeout: float) -> Outcome:
    """A greedy streamed completion; errors are recorded in the outcome, never raised."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "logprobs": 2, "return_tokens_as_token_ids": True, "return_token_ids": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    out = Outcome(index, len(prompt))
    start = out._last = time.perf_counter()
    try:
        with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=timeout) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return out
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    _take_chunk(out, json.loads(line[len(b"data: "):]), start)
    except (requests.RequestException, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    if out.error is None and len(out.token_ids) != max_tokens:
        out.error = f"{len(out.token_ids)} of {max_tokens} tokens"
    return out


def _take_chunk(out: Outcome, chunk: dict, start: float) -> None:
    if "error" in chunk:
        out.error = str(chunk["error"])[:200]
    for choice in chunk.get("choices", []):
        ids = choice.get("token_ids") or []
        if ids:
            now = time.perf_counter()
            out.ttft_s = now - start if out.ttft_s is None else out.ttft_s
            out.longest_gap_s, out._last = max(out.longest_gap_s, now - out._last), now
        out.token_ids += ids
        logprobs = choice.get("logprobs") or {}
        out.logprobs += logprobs.get("token_logprobs") or []
        out.margins += [top_two_gap(top.values()) for top in logprobs.get("top_logprobs") or []]
    usage = chunk.get("usage")
    if usage:
        out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def run_load(base: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
             timeout: float = 600.0, on_done: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Every prompt once, ``concurrency`` in flight at a time; outcomes in prompt order."""
    lock = threading.Lock()

    def one(index: int) -> Outcome:
        outcome = stream_completion(base, model, index, prompts[index], max_tokens, timeout)
        if on_done is not None:
            with lock:
                on_done(outcome)
        return outcome

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(len(prompts))))


@dataclass
class Comparison:
    compared: int = 0  # requests both runs completed
    wrong: list[int] = field(default_factory=list)  # indices whose output parts where it may not
    near_ties: int = 0  # requests that parted from the baseline at one of its near ties
    worst_logprob_gap: float = 0.0


def compare(got: list[Outcome], want: list[Outcome], tolerance: float) -> Comparison:
    result = Comparison()
    for g, w in zip(got, want):
        if g.error or w.error:
            continue
        result.compared += 1
        match = agreement(g.token_ids, g.logprobs, w.token_ids, w.logprobs, w.margins, tolerance)
        result.near_ties += bool(match.parted_at_near_tie)
        result.worst_logprob_gap = max(result.worst_logprob_gap, match.worst_logprob_gap)
        if not match.within(tolerance):
            result.wrong.append(g.index)
    return result


def read_metrics(base: str) -> dict[str, float]:
    """Every counter and gauge of the server's /metrics, summed over labels (``name`` -> value)."""
    values: dict[str, float] = {}
    for line in requests.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{")[0].split(" ")[0], line.rsplit(" ", 1)[1]
            values[name] = values.get(name, 0.0) + float(value)
    return values
