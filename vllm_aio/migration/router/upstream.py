"""One completion on one instance, as the router reads it."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from vllm_aio.migration.driver import Instance

END = object()  # the stream's end, in an ``Upstream``'s queue


class UpstreamError(Exception):
    """An instance refused or broke a completion; the client gets its status and text."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"{status}: {text[:300]}")
        self.status, self.text = status, text

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=self.text, content_type="application/json")


class Upstream:
    """One streamed completion on one instance. A task pumps its chunks into a queue, so the relay
    can wait for a chunk and for a move order at once; closing it closes the connection, which
    aborts the request in vLLM."""

    def __init__(self, http: aiohttp.ClientSession, instance: Instance, body: dict) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()  # chunks, then an exception or not, then END
        self._task = asyncio.create_task(self._pump(http, instance, body))

    async def _pump(self, http: aiohttp.ClientSession, instance: Instance, body: dict) -> None:
        try:
            async with http.post(f"{instance.url}/v1/completions", json=body, headers=instance.headers()) as up:
                if up.status != 200:
                    raise UpstreamError(up.status, await up.text())
                async for line in up.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[len(b"data: "):].strip()
                    if data == b"[DONE]":
                        break
                    await self.queue.put(json.loads(data))
        except (aiohttp.ClientError, UpstreamError, ValueError) as exc:  # ValueError: a chunk that is not JSON
            await self.queue.put(exc)
        await self.queue.put(END)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def forward(http: aiohttp.ClientSession, request: web.Request, instance: Instance,
                  body: dict) -> web.StreamResponse:
    """A request the router cannot move, passed through unchanged."""
    async with http.post(f"{instance.url}/v1/completions", json=body, headers=instance.headers()) as up:
        out = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers.get(
            "Content-Type", "application/json")})
        await out.prepare(request)
        async for data in up.content.iter_any():
            await out.write(data)
        await out.write_eof()
        return out
