"""A priority-aware router in front of several vLLM instances: ``vllm-aio migrate --policy priority``.

Why a router: a migration re-issues the rest of a request on the target
(``driver.py``), so whoever moves a request must own the client's stream and
know the request's tokens so far. The router forwards ``POST /v1/completions``
(streamed or not, vLLM's ``priority`` field passed through) to an instance,
always streaming from it with token ids, so it knows every in-flight request's
instance, priority, prompt and generated tokens. It polls each instance's
``/metrics`` and, with the ``priority`` policy (``policy.py``), moves the most
important request of a pressured instance to the one with the most free KV.

A move, in the request's relay (``_Relay``):
- decoding: at the next block boundary, ``move_kv`` (flush, allocate,
  transfer, commit), then the source's stream is closed (vLLM aborts the
  request) and the rest is requested from the target as prompt + generated
  tokens; the target computes one token, as the source would have. A failed
  move leaves the request decoding on the source;
- stalled (no token for ``stall_s`` after the order: waiting for KV, or
  preempted): at once. Its full blocks move if the source's pool has them
  (the connector copies a preempted request's blocks out); otherwise the target
  recomputes them, which still beats waiting on the pressured instance.
The client sees one stream: one id, the tokens in order, usage counting the
original prompt and every generated token.

Requests the router cannot resume elsewhere (several prompts, ``n`` or
``best_of`` > 1, ``echo``) are forwarded unchanged and never moved. New
requests go to the instance named by the ``X-Instance`` header (URL or index),
else to the one with the most free KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from vllm_aio.log import get_logger
from vllm_aio.migration.driver import Instance, MigrationError, move_kv
from vllm_aio.migration.policy import Candidate, Load, Move, pick_moves, pressured, waiting_blocks

logger = get_logger(__name__)

POLICIES = ("priority",)
MOVES_KEPT = 1000  # the latest moves, for /router/status
# Fields that make a completion impossible to resume as one sequence elsewhere.
_UNMOVABLE = {"n": 1, "best_of": 1, "echo": False}
_METRIC = re.compile(r'^(vllm:[a-z_]+)(?:\{([^}]*)\})? (\S+)')


def parse_load(text: str) -> Load:
    """The figures ``policy.Load`` needs from vLLM's Prometheus text (summed over engines)."""
    values: dict[str, float] = {}
    blocks = 0
    for line in text.splitlines():
        match = _METRIC.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        values[name] = values.get(name, 0.0) + float(value)
        if name == "vllm:cache_config_info":
            found = re.search(r'num_gpu_blocks="(\d+)"', labels or "")
            blocks += int(found.group(1)) if found else 0
    return Load(waiting=int(values.get("vllm:num_requests_waiting", 0)),
                preemptions=values.get("vllm:num_preemptions_total", 0.0),
                kv_usage=values.get("vllm:kv_cache_usage_perc", 0.0), kv_blocks=blocks)


@dataclass
class MoveRecord:
    """One move the router made (``GET /router/status``)."""

    request_id: str
    priority: int
    source: str
    target: str
    after_tokens: int  # generated on the source before the move
    stalled: bool  # moved at once (waiting or preempted), not at a block boundary
    mode: str | None  # move_kv's: "copy", "shared", "none"; None: no KV moved (the target recomputes)
    seconds: float
    error: str | None = None  # why the KV did not move


@dataclass
class Flight:
    """A request in flight through the router."""

    request_id: str
    priority: int
    prompt: list[int]
    body: dict[str, Any]  # the client's fields, prompt excluded
    instance: Instance
    arrival: float = field(default_factory=time.monotonic)
    generated: list[int] = field(default_factory=list)
    order: Instance | None = None  # where the policy wants it
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def candidate(self) -> Candidate:
        return Candidate(self.request_id, self.instance.url, self.priority, self.arrival,
                         len(self.prompt) + len(self.generated), started=bool(self.generated))


class Router:
    def __init__(self, instances: list[Instance], policy: str | None = "priority", interval_s: float = 0.25,
                 stall_s: float = 1.0) -> None:
        if policy not in (None, *POLICIES):
            raise ValueError(f"unknown policy {policy!r}; policies: {', '.join(POLICIES)}")
        self.instances = instances
        self.policy = policy
        self.interval_s = interval_s
        self.stall_s = stall_s
        self.flights: dict[str, Flight] = {}
        self.moves: deque[MoveRecord] = deque(maxlen=MOVES_KEPT)
        self.loads: dict[str, Load] = {}
        self._before: dict[str, Load] = {}
        self._busy: set[str] = set()  # instances a move is in flight from or to
        self._pressured: set[str] = set()  # at the last poll (/router/status); logged when it becomes so
        self.block_size: int | None = None
        self.http: aiohttp.ClientSession | None = None  # opened with the app

    # ---- the app -----------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/router/status", self.status)
        app.cleanup_ctx.append(self._lifetime)
        return app

    async def _lifetime(self, _app: web.Application) -> AsyncIterator[None]:
        # No connection limit: every stream in flight holds one (aiohttp's default caps them at 100).
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                          timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        monitor = asyncio.create_task(self._monitor())
        yield
        monitor.cancel()
        await asyncio.gather(monitor, return_exceptions=True)
        await self.http.close()

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"instances": len(self.instances)})

    async def models(self, _request: web.Request) -> web.Response:
        async with self.http.get(f"{self.instances[0].url}/v1/models", headers=self.instances[0].headers()) as r:
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    async def status(self, _request: web.Request) -> web.Response:
        return web.json_response({
            "policy": self.policy,
            "instances": [{"url": i.url, "load": asdict(self.loads[i.url]) if i.url in self.loads else None,
                           "pressured": i.url in self._pressured}
                          for i in self.instances],
            "flights": [{"request_id": f.request_id, "priority": f.priority, "instance": f.instance.url,
                         "prompt_tokens": len(f.prompt), "generated": len(f.generated)}
                        for f in self.flights.values()],
            "moves": [asdict(m) for m in self.moves],
        })

    # ---- pressure and the policy ---------------------------------------------------------
    async def _monitor(self) -> None:
        while True:
            try:
                await self._poll()
            except Exception:  # a monitor that dies would silently stop every move
                logger.exception("vllm_aio router: poll failed")
            await asyncio.sleep(self.interval_s)

    async def _poll(self) -> None:
        loads = await asyncio.gather(*(self._load(i) for i in self.instances))
        # Each instance's last load seen: a poll that failed (a busy server's /metrics past its timeout)
        # breaks no comparison.
        self._before = {**self._before, **self.loads}
        self.loads = {i.url: load for i, load in zip(self.instances, loads) if load}
        self._log_pressure()
        if self.policy is None or await self._block() is None:
            return
        candidates = [f.candidate() for f in self.flights.values() if f.order is None]
        for move in pick_moves(self._before, self.loads, candidates, self.block_size, self._busy):
            self._order(move)

    def _log_pressure(self) -> None:
        now = self._pressured_now()
        for url in now - self._pressured:
            load = self.loads[url]
            logger.info("vllm_aio router: %s pressured (%d waiting, %.0f preemptions, %d of %d KV blocks free)",
                        url, load.waiting, load.preemptions, load.free_blocks, load.kv_blocks)
        self._pressured = now

    def _pressured_now(self) -> set[str]:
        needs = {}
        if self.block_size is not None:
            needs = waiting_blocks([f.candidate() for f in self.flights.values()], self.block_size)
        return {url for url, load in self.loads.items() if pressured(self._before.get(url), load, needs.get(url))}

    async def _load(self, instance: Instance) -> Load | None:
        try:
            async with self.http.get(f"{instance.url}/metrics", headers=instance.headers(),
                                      timeout=aiohttp.ClientTimeout(total=5)) as reply:
                return parse_load(await reply.text()) if reply.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None  # unreachable: neither a source nor a target this poll

    async def _block(self) -> int | None:
        """The instances' block size (the protocol requires them equal), once one answers."""
        if self.block_size is None:
            try:
                session = await asyncio.to_thread(self.instances[0].call, "session", {})
                self.block_size = session["block_size"]
            except MigrationError as exc:
                logger.warning("vllm_aio router: no migration session yet: %s", exc)
        return self.block_size

    def _order(self, move: Move) -> None:
        flight = self.flights.get(move.request_id)
        if flight is None:  # finished since the candidates were listed
            return
        flight.order = next(i for i in self.instances if i.url == move.target)
        self._busy.update((move.source, move.target))
        flight.wake.set()
        logger.info("vllm_aio router: moving %s (priority %d) from %s to %s", flight.request_id, flight.priority,
                    move.source, move.target)

    # ---- completions ---------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        instance = self._place(request.headers.get("X-Instance"))
        if instance is None:
            return _error(400, f"X-Instance names none of the {len(self.instances)} instances")
        if not _movable(body):
            return await self._forward(request, instance, body)
        priority = body.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            return _error(400, f"priority must be an integer, got {priority!r}")
        prompt = body["prompt"]
        if isinstance(prompt, str):
            try:
                prompt = await self._tokenize(instance, prompt)
            except _UpstreamError as exc:
                return exc.response()
        rest = {k: v for k, v in body.items() if k != "prompt"}
        flight = Flight(f"cmpl-{uuid.uuid4().hex}", priority, prompt, rest, instance)
        self.flights[flight.request_id] = flight
        relay = _Relay(self, flight)
        try:
            if body.get("stream"):
                return await relay.stream(request)
            return await relay.collect()
        except _UpstreamError as exc:
            return exc.response()
        finally:
            del self.flights[flight.request_id]
            if flight.order is not None:  # finished before the ordered move could happen
                self._release(flight, flight.order)

    def _place(self, named: str | None) -> Instance | None:
        if named is not None:
            if named.isdigit():
                return self.instances[int(named)] if int(named) < len(self.instances) else None
            return next((i for i in self.instances if i.url == named.rstrip("/")), None)
        in_flight = {i.url: 0 for i in self.instances}
        for flight in self.flights.values():
            in_flight[flight.instance.url] += 1
        free = {url: load.free_blocks for url, load in self.loads.items()}
        return max(self.instances, key=lambda i: (free.get(i.url, 0), -in_flight[i.url]))

    def _release(self, flight: Flight, target: Instance) -> None:
        self._busy.discard(flight.instance.url)
        self._busy.discard(target.url)
        flight.order = None
        flight.wake.clear()

    async def _tokenize(self, instance: Instance, text: str) -> list[int]:
        body = {"model": await self._model(instance), "prompt": text}
        async with self.http.post(f"{instance.url}/tokenize", json=body, headers=instance.headers()) as reply:
            if reply.status != 200:
                raise _UpstreamError(reply.status, await reply.text())
            return (await reply.json())["tokens"]

    async def _model(self, instance: Instance) -> str:
        async with self.http.get(f"{instance.url}/v1/models", headers=instance.headers()) as reply:
            return (await reply.json())["data"][0]["id"]

    async def _forward(self, request: web.Request, instance: Instance, body: dict) -> web.StreamResponse:
        """A request the router cannot move, passed through unchanged."""
        async with self.http.post(f"{instance.url}/v1/completions", json=body, headers=instance.headers()) as up:
            out = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers.get(
                "Content-Type", "application/json")})
            await out.prepare(request)
            async for data in up.content.iter_any():
                await out.write(data)
            await out.write_eof()
            return out

    async def move(self, flight: Flight, stalled: bool) -> bool:
        """Move ``flight`` to its ordered target; False: it stays where it is."""
        target, source = flight.order, flight.instance
        started, mode, error = time.monotonic(), None, None
        try:
            if flight.generated:  # a request that never produced a token has no KV worth moving
                try:
                    report = await asyncio.to_thread(move_kv, source, target, flight.prompt + flight.generated)
                    mode = report.mode
                except MigrationError as exc:
                    error = str(exc)
                    if not stalled:  # still decoding on the source: it loses nothing by staying
                        logger.warning("vllm_aio router: %s stays on %s: %s", flight.request_id, source.url, exc)
                        return False
        finally:
            self._release(flight, target)
        flight.instance = target
        self.moves.append(MoveRecord(flight.request_id, flight.priority, source.url, target.url,
                                     len(flight.generated), stalled, mode, time.monotonic() - started, error))
        return True


def _movable(body: dict) -> bool:
    prompt = body.get("prompt")
    one_prompt = isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt))
    return one_prompt and all(body.get(k, default) in (None, default) for k, default in _UNMOVABLE.items())


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


class _UpstreamError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"{status}: {text[:300]}")
        self.status, self.text = status, text

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=self.text, content_type="application/json")


_WOKEN, _STALLED, _END = object(), object(), object()


class _Upstream:
    """One streamed completion on one instance. A task pumps its chunks into a queue, so the relay
    can wait for a chunk and for a move order at once; closing it closes the connection, which
    aborts the request in vLLM."""

    def __init__(self, http: aiohttp.ClientSession, instance: Instance, body: dict) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.create_task(self._pump(http, instance, body))

    async def _pump(self, http: aiohttp.ClientSession, instance: Instance, body: dict) -> None:
        try:
            async with http.post(f"{instance.url}/v1/completions", json=body, headers=instance.headers()) as up:
                if up.status != 200:
                    raise _UpstreamError(up.status, await up.text())
                async for line in up.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[len(b"data: "):].strip()
                    if data == b"[DONE]":
                        break
                    await self.queue.put(json.loads(data))
        except (aiohttp.ClientError, _UpstreamError, ValueError) as exc:  # ValueError: a chunk that is not JSON
            await self.queue.put(exc)
        await self.queue.put(_END)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


class _Relay:
    """One movable request: streams it from its instance, moves it when ordered, and hands the
    client one coherent completion."""

    def __init__(self, router: Router, flight: Flight) -> None:
        self.router, self.flight = router, flight
        self.finish_reason: str | None = None
        self.resumed = False  # moved at least once
        self.created = int(time.time())
        self.model: str | None = None

    def _upstream(self) -> _Upstream:
        flight = self.flight
        body = {**flight.body, "prompt": flight.prompt + flight.generated, "stream": True,
                "return_token_ids": True, "stream_options": {"include_usage": False}}
        # The rest of the request: what the client asked, less what was generated already.
        for key in ("max_tokens", "min_tokens"):
            if flight.body.get(key) is not None:
                body[key] = max(0, flight.body[key] - len(flight.generated))
        return _Upstream(self.router.http, flight.instance, body)

    async def chunks(self) -> AsyncIterator[dict]:
        """The upstream chunks, moves included, as the client should see them."""
        flight = self.flight
        upstream = self._upstream()
        try:
            while True:
                item = await self._next(upstream)
                moved = False
                if item is _WOKEN:
                    continue
                if item is _END:
                    return
                if item is _STALLED:
                    moved = await self.router.move(flight, stalled=True)
                elif isinstance(item, Exception):
                    raise item if isinstance(item, _UpstreamError) else _UpstreamError(502, str(item))
                else:
                    yield self._rewrite(item)
                    if self.finish_reason is None and flight.order is not None and self._at_boundary():
                        moved = await self.router.move(flight, stalled=False)
                if moved:
                    await upstream.close()  # aborts the request on the source
                    self.resumed = True
                    upstream = self._upstream()
        finally:
            await upstream.close()

    async def _next(self, upstream: _Upstream) -> Any:
        """The next chunk; ``_WOKEN`` when a move was ordered meanwhile; ``_STALLED`` when, ordered,
        no chunk came within ``stall_s``."""
        if self.flight.order is not None:
            try:
                return await asyncio.wait_for(upstream.queue.get(), self.router.stall_s)
            except asyncio.TimeoutError:
                return _STALLED
        get = asyncio.ensure_future(upstream.queue.get())
        wake = asyncio.ensure_future(self.flight.wake.wait())
        done, pending = await asyncio.wait({get, wake}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()  # a cancelled queue get loses no item
        return get.result() if get in done else _WOKEN

    def _at_boundary(self) -> bool:
        """One token past a whole block: every token but the newest has its KV in a full block."""
        return (len(self.flight.prompt) + len(self.flight.generated)) % self.router.block_size == 1

    def _rewrite(self, chunk: dict) -> dict:
        flight = self.flight
        self.model = self.model or chunk.get("model")
        for choice in chunk.get("choices", []):
            flight.generated.extend(choice.get("token_ids") or [])
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            if not flight.body.get("return_token_ids"):
                choice.pop("token_ids", None)
            if not flight.body.get("return_token_ids") or self.resumed:
                choice.pop("prompt_token_ids", None)  # a resumed request's prompt is not the client's
        chunk.update(id=flight.request_id, created=self.created)
        return chunk

    def _usage(self) -> dict:
        prompt, completion = len(self.flight.prompt), len(self.flight.generated)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def stream(self, request: web.Request) -> web.StreamResponse:
        chunks = self.chunks()
        try:
            first = await anext(chunks, None)  # upstream refusals become the client's status, not a broken stream
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await out.prepare(request)
            try:
                if first is not None:
                    await out.write(_sse(first))
                async for chunk in chunks:
                    await out.write(_sse(chunk))
            except _UpstreamError as exc:  # mid-stream: the status is sent already
                await out.write(_sse({"error": {"message": str(exc), "code": exc.status}}))
        finally:
            await chunks.aclose()  # a client gone mid-stream: its upstream is closed now, not at collection
        if (self.flight.body.get("stream_options") or {}).get("include_usage"):
            await out.write(_sse({"id": self.flight.request_id, "object": "text_completion", "created": self.created,
                                  "model": self.model, "choices": [], "usage": self._usage()}))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def collect(self) -> web.Response:
        """A non-streamed completion, assembled from the stream the router reads."""
        text, logprobs = [], None
        async for chunk in self.chunks():
            for choice in chunk.get("choices", []):
                text.append(choice.get("text", ""))
                if choice.get("logprobs"):
                    logprobs = _merge_logprobs(logprobs, choice["logprobs"])
        choice = {"index": 0, "text": "".join(text), "logprobs": logprobs, "finish_reason": self.finish_reason}
        if self.flight.body.get("return_token_ids"):
            choice["token_ids"] = self.flight.generated
        return web.json_response({"id": self.flight.request_id, "object": "text_completion",
                                  "created": self.created, "model": self.model, "choices": [choice],
                                  "usage": self._usage()})


def _merge_logprobs(into: dict | None, more: dict) -> dict:
    if into is None:
        return {k: list(v or []) for k, v in more.items()}
    for key, values in more.items():
        into.setdefault(key, []).extend(values or [])
    return into


def _sse(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def serve(instances: list[Instance], host: str, port: int, policy: str | None, interval_s: float,
          stall_s: float) -> None:
    """Run the router until interrupted."""
    web.run_app(Router(instances, policy, interval_s, stall_s).app(), host=host, port=port, print=None)
