"""Migration by priority end to end: ``vllm-aio router --policy priority`` in front of two real instances.

A (the source) has a KV cache of 56 blocks of 32 tokens under ``--scheduling-policy
priority``: one high-priority request, then four low-priority ones, 300-token prompts
decoding 640 tokens (512 the low ones), fit with their prompts but not with their growth, so
vLLM preempts the low ones (the high one is never preempted) and they wait. The high one
comes first: arriving among the low ones, it waited on a full A at times (the router then
rerouted it before its first token, with no KV to move), and at others A drained first. B has
room. The router, through which every request goes (placed on A), sees A's
preemptions and waiting requests in its ``/metrics`` and moves A's most important
request, the high-priority one, to B with its KV at a block boundary (and, while A
stays pressured, low-priority ones after it). Its
output must equal the same request run alone on A without any move (greedy), and
every low-priority request must complete with its unmigrated output too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from harness.assertions import assert_same_continuation
from harness.engines import aio_config
from harness.prerequisites import ROOT, require
from harness.prompts import make_prompts
from harness.servers import Servers
from vllm_aio.devtools.serve import free_port, stop_server, wait_healthy
from vllm_aio.migration.driver import Generation, Instance, generate_migrating

# The high-priority request decodes longer than the others, so that it is still running on A
# when the router, on a loaded 2-core machine, sees the pressure and reaches a block boundary.
# The low ones decode long enough to crowd A for seconds after it arrives: at 256 tokens, with
# engines on unpinned threads, they were done 3 s after it came and the router saw no pressure.
HIGH_TOKENS, LOW_TOKENS = 640, 512
HIGH, LOW = 0, 1  # vLLM: lower is more important
PROMPTS = make_prompts(41, [300, 296, 304, 298, 302])  # the first is the high-priority one
# The servers run in float32 (servers.SERVER_ARGS): in bfloat16 a near-tied greedy token of the random
# tiny model flipped (token 26 of one run) between the crowded run and the reference alone, whose
# steps round differently (a batch of five against one request).
PRIORITY = ["--scheduling-policy", "priority"]
# 56 blocks hold the five prompts (50 blocks) but not their first 53 tokens each:
# vLLM preempts low-priority requests from then on. max_model_len must fit the cache.
SMALL_KV = ["--num-gpu-blocks-override", "56", "--max-model-len", "1024"]
NO_EOS = {"ignore_eos": True}
# The scenario needs A pressured while the high-priority request decodes. On two busy cores a CI run's
# low-priority requests, sent 0.5 s after it, reached the router only as it finished 10 s later, and
# only they moved; a local run under load saw the router relay 600 of its tokens in one burst; another
# CI run's move of it timed out in the transfer (it stayed on A, unchanged) and nothing moved. The
# scenario then runs again, every output checked each time.
ATTEMPTS = 3


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    require("vllm")
    require("mooncake.engine")
    require("aiohttp")
    config = aio_config(migration=True, migration_hostname="127.0.0.1", local_pool_size="256MB")
    servers = Servers(tiny_model, tmp_path_factory.mktemp("priority"))
    try:
        yield servers.start({"a": config, "b": config}, {"a": PRIORITY + SMALL_KV, "b": PRIORITY})
    finally:
        servers.close()


@pytest.fixture(scope="module")
def router(cluster, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vllm_aio.cli", "router", "--policy", "priority",
                                 "--instance", cluster["a"].url, "--instance", cluster["b"].url,
                                 "--port", str(port), "--interval", "0.1"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, 60)
        yield Router(url, log)
    finally:
        stop_server(proc, grace_s=10)


@dataclass(frozen=True)
class Router:
    url: str
    log: Path

    def status(self) -> dict:
        return requests.get(f"{self.url}/router/status", timeout=10).json()

    def moves(self) -> list[dict]:
        return self.status()["moves"]

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def alone(instance: Instance, prompt: list[int], max_tokens: int) -> Generation:
    """The whole greedy generation on one instance, nothing else running, no move."""
    result = generate_migrating(instance, instance, prompt, max_tokens, max_tokens + 1, NO_EOS)
    assert result.moved_after is None and len(result.token_ids) == max_tokens
    return result


@dataclass
class Completion:
    """What a completion through the router returned, as ``assert_same_continuation`` compares it."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def take(self, choice: dict) -> None:
        self.token_ids += choice.get("token_ids") or []
        self.logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []


def streamed(router: str, model: str, prompt: list[int], priority: int) -> tuple[Completion, float]:
    """A streamed completion through the router: its tokens and seconds taken."""
    start = time.monotonic()
    body = {"model": model, "prompt": prompt, "max_tokens": HIGH_TOKENS, "temperature": 0.0, "priority": priority,
            "stream": True, "return_token_ids": True, "logprobs": 0, **NO_EOS}
    out = Completion()
    with requests.post(f"{router}/v1/completions", json=body, headers={"X-Instance": "0"}, stream=True,
                       timeout=300) as reply:
        assert reply.status_code == 200, reply.text
        for line in reply.iter_lines():
            if line.startswith(b"data: {"):
                chunk = json.loads(line[len(b"data: "):])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    out.take(choice)
    return out, time.monotonic() - start


def collected(router: str, model: str, prompt: list[int], priority: int) -> Completion:
    """A non-streamed completion through the router."""
    body = {"model": model, "prompt": prompt, "max_tokens": LOW_TOKENS, "temperature": 0.0, "priority": priority,
            "return_token_ids": True, "logprobs": 0, **NO_EOS}
    reply = requests.post(f"{router}/v1/completions", json=body, headers={"X-Instance": "0"}, timeout=300)
    assert reply.status_code == 200, reply.text
    (choice,) = reply.json()["choices"]
    assert choice["finish_reason"] == "length"
    out = Completion()
    out.take(choice)
    return out


def decoding(router: Router, timeout_s: float = 120.0) -> None:
    """Returns once the router relays a token of the high-priority request."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(f["priority"] == HIGH and f["generated"] > 0 for f in router.status()["flights"]):
            return
        time.sleep(0.05)
    raise AssertionError(f"the high-priority request produced no token in {timeout_s:.0f} s\n{router.log_tail()}")


def scenario(url: str, model: str, router: Router | None = None) -> tuple[Completion, float, list[Completion]]:
    """The high-priority request, then the low-priority ones, sent to ``url`` (the router, or an
    instance): the high one's tokens and seconds, the low ones' tokens."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        high = pool.submit(streamed, url, model, PROMPTS[0], HIGH)
        # The high-priority request is decoding when the low ones crowd A (see ATTEMPTS).
        if router is None:
            time.sleep(0.5)
        else:
            decoding(router)
        lows = [pool.submit(collected, url, model, prompt, LOW) for prompt in PROMPTS[1:]]
        tokens, seconds = high.result()
        return tokens, seconds, [low.result() for low in lows]


def test_pressured_instance_moves_its_high_priority_request_which_completes_unchanged(cluster, router):
    a = Instance(cluster["a"].url, timeout=120)
    lengths = [HIGH_TOKENS] + [LOW_TOKENS] * (len(PROMPTS) - 1)
    for prompt in PROMPTS:  # A's pool then holds the prompts' full blocks, as it does when they run below
        alone(a, prompt, 1)
    want = [alone(a, prompt, n) for prompt, n in zip(PROMPTS, lengths)]
    model = a.model()
    for attempt in range(1, ATTEMPTS + 1):
        done = len(router.moves())
        got_high, seconds, got_lows = scenario(router.url, model, router)
        # Each as it would have run alone: equal until they part, which they may only at a near tie.
        for got, alone_ in zip([got_high, *got_lows], want):
            assert_same_continuation(got, alone_)
        moves = router.moves()[done:]
        # The policy moves the most important request it can move at the time: the high-priority one,
        # unless a move of it is refused (it stays: a CI run's transfer timed out on the loaded machine,
        # and the request had finished by the next try); a low-priority one may then go first, or none.
        high = [m for m in moves if m["priority"] == HIGH]
        if high:
            break
        print(f"attempt {attempt}: {len(moves)} moved, not the high-priority request; the scenario again")
    assert high, f"the high-priority request never moved in {ATTEMPTS} runs: {moves}\n{router.log_tail()}"
    first = high[0]
    assert first["source"] == a.url and first["target"] == cluster["b"].url, first
    assert first["mode"] == "copy" and not first["stalled"] and first["after_tokens"] > 0, (first, router.log_tail())
    # The figure, after the checks: the same requests sent to A directly, where nothing moves.
    _, staying, _ = scenario(cluster["a"].url, model)
    print(f"high-priority request: {seconds:.2f} s through the router (moved after {first['after_tokens']} "
          f"tokens, the move {first['seconds']:.3f} s), {staying:.2f} s on A without moves; moves: {moves}")
