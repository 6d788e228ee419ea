"""One movable request: streamed from its instance, moved when the monitor orders it, resumed on the
target as prompt + generated tokens, its chunks rewritten into the one completion the client sees."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from vllm_aio.log import get_logger
from vllm_aio.migration.driver import MigrationError, move_kv
from vllm_aio.migration.router.flight import Flight, MoveRecord
from vllm_aio.migration.router.monitor import Monitor
from vllm_aio.migration.router.upstream import END, Upstream, UpstreamError

logger = get_logger(__name__)

# Fields that make a completion impossible to resume as one sequence elsewhere.
_UNMOVABLE = {"n": 1, "best_of": 1, "echo": False}
_WOKEN, _STALLED = object(), object()


def movable(body: dict) -> bool:
    """Whether a completion can resume elsewhere: one prompt, one sequence, no echo."""
    prompt = body.get("prompt")
    one_prompt = isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt))
    return one_prompt and all(body.get(k, default) in (None, default) for k, default in _UNMOVABLE.items())


class Relay:
    """Streams ``flight`` from its instance, moves it when ordered, and yields the chunks the client
    should see (``replies.py`` turns them into the client's reply)."""

    def __init__(self, http: aiohttp.ClientSession, monitor: Monitor, flight: Flight, stall_s: float) -> None:
        self.http, self.monitor, self.flight, self.stall_s = http, monitor, flight, stall_s
        self.finish_reason: str | None = None
        self.resumed = False  # moved at least once
        self.created = int(time.time())
        self.model: str | None = None

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
                if item is END:
                    return
                if item is _STALLED:
                    moved = await self._move(stalled=True)
                elif isinstance(item, Exception):
                    raise item if isinstance(item, UpstreamError) else UpstreamError(502, str(item))
                else:
                    yield self._rewrite(item)
                    if self.finish_reason is None and flight.order is not None and self._at_boundary():
                        moved = await self._move(stalled=False)
                if moved:
                    await upstream.close()  # aborts the request on the source
                    self.resumed = True
                    upstream = self._upstream()
        finally:
            await upstream.close()

    def _upstream(self) -> Upstream:
        flight = self.flight
        body = {**flight.body, "prompt": flight.prompt + flight.generated, "stream": True,
                "return_token_ids": True, "stream_options": {"include_usage": False}}
        # The rest of the request: what the client asked, less what was generated already.
        for key in ("max_tokens", "min_tokens"):
            if flight.body.get(key) is not None:
                body[key] = max(0, flight.body[key] - len(flight.generated))
        return Upstream(self.http, flight.instance, body)

    async def _next(self, upstream: Upstream) -> Any:
        """The next chunk; ``_WOKEN`` when a move was ordered meanwhile; ``_STALLED`` when, ordered,
        no chunk came within ``stall_s``."""
        if self.flight.order is not None:
            try:
                return await asyncio.wait_for(upstream.queue.get(), self.stall_s)
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
        return (len(self.flight.prompt) + len(self.flight.generated)) % self.monitor.block_size == 1

    async def _move(self, stalled: bool) -> bool:
        """Move the flight to its ordered target; False: it stays where it is."""
        flight = self.flight
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
            self.monitor.release(flight)
        flight.instance = target
        self.monitor.moves.append(MoveRecord(flight.request_id, flight.priority, source.url, target.url,
                                             len(flight.generated), stalled, mode, time.monotonic() - started,
                                             error))
        return True

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
