"""The priority router (``vllm_aio.migration.router``) in front of fake instances.

A fake instance serves what the router uses of vLLM: ``/metrics``, a streamed
``/v1/completions`` whose next token is a function of the whole sequence so far
(so a request resumed elsewhere continues exactly as it would have), and the
migration operations answered as a target that already holds every block.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from harness.prerequisites import require

require("aiohttp")
from aiohttp import ClientSession, web  # noqa: E402

from vllm_aio.migration.driver import Instance  # noqa: E402
from vllm_aio.migration.router import Router  # noqa: E402
from vllm_aio.migration.router.metrics_text import parse_load  # noqa: E402

BLOCK = 4
PROMPT = list(range(10, 19))  # 9 tokens: a block boundary after 4, 8, 12, ... generated tokens
CALM = {"waiting": 0, "usage": 0.0, "blocks": 1000}
PRESSURED = {"waiting": 2, "usage": 0.99, "blocks": 100}


def next_token(sequence: list[int]) -> int:
    return (sum(sequence) * 31 + len(sequence)) % 997


def expected(max_tokens: int) -> list[int]:
    sequence = list(PROMPT)
    for _ in range(max_tokens):
        sequence.append(next_token(sequence))
    return sequence[len(PROMPT):]


@dataclass
class Fake:
    """One fake vLLM instance."""

    load: dict
    token_s: float = 0.01  # seconds per generated token
    stalls: bool = False  # accepts completions but never generates (a request waiting for KV)
    refuse_flush: bool = False
    refuse_completions: bool = False  # answers 400, as vLLM does to a request it rejects
    failing_metrics: bool = False  # every other /metrics fails, as a busy server's past the router's timeout
    polls: int = 0
    calls: list[str] = field(default_factory=list)
    completions: list[dict] = field(default_factory=list)
    aborted: int = 0  # streams the client closed before the end

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/kv_migration/{op}", self.migration)
        return app

    async def metrics(self, _request: web.Request) -> web.Response:
        load = self.load
        self.polls += 1
        if self.failing_metrics and self.polls % 2:
            return web.Response(status=503)
        return web.Response(text="\n".join([
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {load["waiting"]}.0',
            'vllm:num_preemptions_total{engine="0",model_name="m"} 0.0',
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {load["usage"]}',
            f'vllm:cache_config_info{{block_size="{BLOCK}",engine="0",num_gpu_blocks="{load["blocks"]}"}} 1.0',
        ]))

    async def migration(self, request: web.Request) -> web.Response:
        op = request.match_info["op"]
        self.calls.append(op)
        body = await request.json()
        if op == "flush" and self.refuse_flush:
            return web.json_response({"error": "no running request holds them"}, status=409)
        if op == "session":
            return web.json_response({"block_size": BLOCK, "namespace": "ns", "hash_seed": "s", "shared_store": None,
                                      "session_id": "x", "weight_version": ""})
        if op == "extra_size":
            full = len(body["token_ids"]) // BLOCK
            return web.json_response({"full_blocks": full, "lacking_blocks": 0, "matched_blocks": full,
                                      "matched_tokens": full * BLOCK})
        return web.json_response({"blocks": len(body.get("token_ids", [])) // BLOCK})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.completions.append(body)
        if self.refuse_completions:
            return web.json_response({"error": {"message": "priority scheduling is off"}}, status=400)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x"}, {"text": "y"}], "forwarded": True})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        sequence = list(body["prompt"])
        try:
            for _ in range(body["max_tokens"]):
                while self.stalls:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(self.token_s)
                token = next_token(sequence)
                sequence.append(token)
                last = len(sequence) - len(body["prompt"]) == body["max_tokens"]
                choice = {"index": 0, "text": f"<{token}>", "token_ids": [token],
                          "finish_reason": "length" if last else None}
                await out.write(b"data: " + json.dumps({"id": "up", "model": "m", "choices": [choice]}).encode()
                                + b"\n\n")
            await out.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.aborted += 1
            raise
        return out


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True)  # a fake notices a client that left
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


class Cluster:
    """Two fake instances (a, b) and a router in front of them, on this event loop."""

    def __init__(self, a: Fake, b: Fake, policy: str | None = "priority") -> None:
        self.a, self.b, self.policy = a, b, policy

    async def __aenter__(self) -> Cluster:
        self.runners = []
        urls = []
        for fake in (self.a, self.b):
            runner, url = await _serve(fake.app())
            self.runners.append(runner)
            urls.append(url)
        self.a_url, self.b_url = urls
        # stall_s: well above a token's gap on a loaded machine, or a decoding request counts as stalled.
        self.router = Router([Instance(u, timeout=10) for u in urls], self.policy, interval_s=0.02, stall_s=1.0)
        runner, self.url = await _serve(self.router.app())
        self.runners.append(runner)
        self.http = ClientSession()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.close()
        for runner in reversed(self.runners):
            await runner.cleanup()

    async def stream(self, max_tokens: int, **fields) -> tuple[list[int], list[dict]]:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "return_token_ids": True,
                **fields}
        tokens, chunks = [], []
        async with self.http.post(f"{self.url}/v1/completions", json=body, headers={"X-Instance": "0"}) as reply:
            assert reply.status == 200, await reply.text()
            async for line in _lines(reply):
                chunk = json.loads(line)
                chunks.append(chunk)
                for choice in chunk["choices"]:
                    tokens += choice.get("token_ids") or []
        return tokens, chunks

    async def status(self) -> dict:
        async with self.http.get(f"{self.url}/router/status") as reply:
            return await reply.json()


async def _lines(reply) -> AsyncIterator[bytes]:
    async for line in reply.content:
        if line.startswith(b"data: {"):
            yield line[len(b"data: "):]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_decoding_request_of_a_pressured_instance_moves_at_a_block_boundary_and_continues_exactly():
    async def scenario():
        async with Cluster(Fake(PRESSURED, token_s=0.02), Fake(CALM)) as c:
            tokens, chunks = await c.stream(60, stream_options={"include_usage": True})
            return tokens, chunks, (await c.status())["moves"], c

    tokens, chunks, moves, c = run(scenario())
    assert tokens == expected(60)
    (move,) = moves
    assert move["source"] == c.a_url and move["target"] == c.b_url and not move["stalled"]
    assert move["mode"] == "none"  # the fake target "holds" every block already
    assert (len(PROMPT) + move["after_tokens"]) % BLOCK == 1  # one token past a whole block
    assert "flush" in c.a.calls and "extra_size" in c.b.calls
    assert c.a.aborted == 1  # the source's stream was closed: vLLM aborts the request
    resumed = c.b.completions[0]
    assert resumed["prompt"] == PROMPT + tokens[: move["after_tokens"]]
    assert resumed["max_tokens"] == 60 - move["after_tokens"]
    assert {chunk["id"] for chunk in chunks} == {chunks[0]["id"]}  # one completion to the client
    assert chunks[-1]["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 60, "total_tokens": 69}


def test_a_stalled_request_moves_at_once_and_the_target_computes_it():
    async def scenario():
        async with Cluster(Fake(PRESSURED, stalls=True), Fake(CALM)) as c:
            tokens, _ = await c.stream(12)
            return tokens, (await c.status())["moves"], c

    tokens, moves, c = run(scenario())
    assert tokens == expected(12)
    (move,) = moves
    assert move["stalled"] and move["after_tokens"] == 0 and move["mode"] is None  # no KV to move
    assert "flush" not in c.a.calls and c.a.aborted == 1


def test_pressure_shows_through_polls_that_fail_in_between():
    async def scenario():
        async with Cluster(Fake(PRESSURED, token_s=0.02, failing_metrics=True), Fake(CALM)) as c:
            tokens, _ = await c.stream(60)
            return tokens, (await c.status())["moves"], c

    tokens, moves, c = run(scenario())
    assert tokens == expected(60)
    (move,) = moves
    assert move["source"] == c.a_url and move["target"] == c.b_url


def test_a_failed_move_leaves_the_decoding_request_on_its_instance():
    async def scenario():
        async with Cluster(Fake(PRESSURED, token_s=0.02, refuse_flush=True), Fake(CALM)) as c:
            tokens, _ = await c.stream(30)
            return tokens, (await c.status())["moves"], c

    tokens, moves, c = run(scenario())
    assert tokens == expected(30)
    assert moves == [] and c.b.completions == [] and c.a.aborted == 0


def test_nothing_moves_without_pressure():
    async def scenario():
        async with Cluster(Fake(CALM, token_s=0.01), Fake(CALM)) as c:
            tokens, _ = await c.stream(30)
            return tokens, (await c.status())["moves"], c

    tokens, moves, c = run(scenario())
    assert tokens == expected(30) and moves == [] and c.b.completions == []


def test_the_most_important_request_is_the_one_moved():
    async def scenario():
        async with Cluster(Fake(CALM, token_s=0.02), Fake(CALM)) as c:
            low = asyncio.ensure_future(c.stream(40, priority=5))
            await asyncio.sleep(0.05)
            high = asyncio.ensure_future(c.stream(40, priority=0))
            await asyncio.sleep(0.05)
            c.a.load = PRESSURED  # both in flight when the pressure shows
            await asyncio.gather(low, high)
            return (await c.status())["moves"]

    moves = run(scenario())
    assert moves and moves[0]["priority"] == 0


def test_a_non_streamed_request_is_assembled_into_one_completion():
    async def scenario():
        async with Cluster(Fake(PRESSURED, token_s=0.02), Fake(CALM)) as c:
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 30, "return_token_ids": True}
            async with c.http.post(f"{c.url}/v1/completions", json=body, headers={"X-Instance": "0"}) as reply:
                return await reply.json(), (await c.status())["moves"]

    reply, moves = run(scenario())
    (choice,) = reply["choices"]
    want = expected(30)
    assert choice["token_ids"] == want and choice["text"] == "".join(f"<{t}>" for t in want)
    assert choice["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 30
    assert len(moves) == 1


def test_requests_that_cannot_resume_elsewhere_are_forwarded_unchanged():
    async def scenario():
        async with Cluster(Fake(CALM), Fake(CALM)) as c:
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 5, "n": 2}
            async with c.http.post(f"{c.url}/v1/completions", json=body, headers={"X-Instance": "1"}) as reply:
                return await reply.json(), c

    reply, c = run(scenario())
    assert reply["forwarded"] and c.b.completions == [{"model": "m", "prompt": PROMPT, "max_tokens": 5, "n": 2}]


def test_an_unknown_instance_name_is_refused():
    async def scenario():
        async with Cluster(Fake(CALM), Fake(CALM)) as c:
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 5}
            async with c.http.post(f"{c.url}/v1/completions", json=body, headers={"X-Instance": "7"}) as reply:
                return reply.status

    assert run(scenario()) == 400


def test_an_instance_refusing_the_request_gives_the_client_its_status_and_reason():
    async def scenario():
        async with Cluster(Fake(CALM, refuse_completions=True), Fake(CALM)) as c:
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 5, "stream": True, "priority": 3}
            async with c.http.post(f"{c.url}/v1/completions", json=body, headers={"X-Instance": "0"}) as reply:
                return reply.status, await reply.text(), c.router.flights

    status, text, flights = run(scenario())
    assert status == 400 and "priority scheduling is off" in text and flights == {}


def test_a_priority_that_is_not_an_integer_is_refused():
    async def scenario():
        async with Cluster(Fake(CALM), Fake(CALM)) as c:
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 5, "priority": "high"}
            async with c.http.post(f"{c.url}/v1/completions", json=body) as reply:
                return reply.status, c

    status, c = run(scenario())
    assert status == 400 and c.a.completions == c.b.completions == []


def test_new_requests_go_to_the_instance_with_the_most_free_kv():
    async def scenario():
        async with Cluster(Fake(PRESSURED), Fake(CALM), policy=None) as c:
            await asyncio.sleep(0.1)  # a poll or two
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 3, "stream": True}
            async with c.http.post(f"{c.url}/v1/completions", json=body) as reply:
                await reply.read()
            return c

    c = run(scenario())
    assert c.a.completions == [] and len(c.b.completions) == 1


def test_metrics_text_gives_the_load():
    text = "\n".join([
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 3.0',
        'vllm:num_preemptions_total{engine="0",model_name="m"} 7.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75',
        'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="56"} 1.0',
    ])
    load = parse_load(text)
    assert (load.waiting, load.preemptions, load.kv_usage, load.kv_blocks) == (3, 7.0, 0.75, 56)
    assert load.free_blocks == 14


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policies: priority"):
        Router([Instance("http://x"), Instance("http://y")], policy="round-robin")

