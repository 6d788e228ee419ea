"""The router's aiohttp app: its routes, and what starts and stops with it."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from vllm_aio.migration.driver import Instance
from vllm_aio.migration.policy import POLICIES
from vllm_aio.migration.router import replies
from vllm_aio.migration.router.flight import Flight
from vllm_aio.migration.router.monitor import Monitor
from vllm_aio.migration.router.relay import Relay, movable
from vllm_aio.migration.router.upstream import UpstreamError, forward


class Router:
    """``POST /v1/completions`` relayed to the instances, ``GET /v1/models``, ``/health`` and
    ``/router/status``; ``policy`` None places requests but moves none."""

    def __init__(self, instances: list[Instance], policy: str | None = "priority", interval_s: float = 0.25,
                 stall_s: float = 1.0) -> None:
        if policy not in (None, *POLICIES):
            raise ValueError(f"unknown policy {policy!r}; policies: {', '.join(POLICIES)}")
        self.instances = instances
        self.stall_s = stall_s
        self.flights: dict[str, Flight] = {}
        self.monitor = Monitor(instances, self.flights, policy, interval_s)
        self.http: aiohttp.ClientSession | None = None  # opened with the app

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
        monitor = asyncio.create_task(self.monitor.run(self.http))
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
        return web.json_response(self.monitor.status())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return replies.error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return replies.error(400, "the body must be a JSON object")
        instance = self.monitor.place(request.headers.get("X-Instance"))
        if instance is None:
            return replies.error(400, f"X-Instance names none of the {len(self.instances)} instances")
        if not movable(body):
            return await forward(self.http, request, instance, body)
        return await self._relay(request, instance, body)

    async def _relay(self, request: web.Request, instance: Instance, body: dict) -> web.StreamResponse:
        """A movable request, a flight the monitor may order moved until its relay ends."""
        priority = body.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            return replies.error(400, f"priority must be an integer, got {priority!r}")
        prompt = body["prompt"]
        if isinstance(prompt, str):
            try:
                prompt = await self._tokenize(instance, prompt)
            except UpstreamError as exc:
                return exc.response()
        rest = {k: v for k, v in body.items() if k != "prompt"}
        flight = Flight(f"cmpl-{uuid.uuid4().hex}", priority, prompt, rest, instance)
        self.flights[flight.request_id] = flight
        relay = Relay(self.http, self.monitor, flight, self.stall_s)
        try:
            if body.get("stream"):
                return await replies.stream(relay, request)
            return await replies.collect(relay)
        except UpstreamError as exc:
            return exc.response()
        finally:
            del self.flights[flight.request_id]
            self.monitor.release(flight)  # finished before an ordered move could happen

    async def _tokenize(self, instance: Instance, text: str) -> list[int]:
        body = {"model": await self._model(instance), "prompt": text}
        async with self.http.post(f"{instance.url}/tokenize", json=body, headers=instance.headers()) as reply:
            if reply.status != 200:
                raise UpstreamError(reply.status, await reply.text())
            return (await reply.json())["tokens"]

    async def _model(self, instance: Instance) -> str:
        async with self.http.get(f"{instance.url}/v1/models", headers=instance.headers()) as reply:
            return (await reply.json())["data"][0]["id"]


def serve(instances: list[Instance], host: str, port: int, policy: str | None, interval_s: float,
          stall_s: float) -> None:
    """Run the router until interrupted."""
    web.run_app(Router(instances, policy, interval_s, stall_s).app(), host=host, port=port, print=None)
