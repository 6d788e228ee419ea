"""What the client receives for a relayed request: one event stream, or one assembled completion."""

from __future__ import annotations

import json

from aiohttp import web

from vllm_aio.migration.router.relay import Relay
from vllm_aio.migration.router.upstream import UpstreamError


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


async def stream(relay: Relay, request: web.Request) -> web.StreamResponse:
    """A streamed completion: the relay's chunks as server-sent events, usage at the end if asked."""
    flight = relay.flight
    chunks = relay.chunks()
    try:
        first = await anext(chunks, None)  # upstream refusals become the client's status, not a broken stream
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        try:
            if first is not None:
                await out.write(_sse(first))
            async for chunk in chunks:
                await out.write(_sse(chunk))
        except UpstreamError as exc:  # mid-stream: the status is sent already
            await out.write(_sse({"error": {"message": str(exc), "code": exc.status}}))
    finally:
        await chunks.aclose()  # a client gone mid-stream: its upstream is closed now, not at collection
    if (flight.body.get("stream_options") or {}).get("include_usage"):
        await out.write(_sse({"id": flight.request_id, "object": "text_completion", "created": relay.created,
                              "model": relay.model, "choices": [], "usage": _usage(relay)}))
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


async def collect(relay: Relay) -> web.Response:
    """A non-streamed completion, assembled from the stream the router reads."""
    text, logprobs = [], None
    async for chunk in relay.chunks():
        for choice in chunk.get("choices", []):
            text.append(choice.get("text", ""))
            if choice.get("logprobs"):
                logprobs = _merge_logprobs(logprobs, choice["logprobs"])
    flight = relay.flight
    choice = {"index": 0, "text": "".join(text), "logprobs": logprobs, "finish_reason": relay.finish_reason}
    if flight.body.get("return_token_ids"):
        choice["token_ids"] = flight.generated
    return web.json_response({"id": flight.request_id, "object": "text_completion", "created": relay.created,
                              "model": relay.model, "choices": [choice], "usage": _usage(relay)})


def _usage(relay: Relay) -> dict:
    """The original prompt and every generated token, wherever they were computed."""
    prompt, completion = len(relay.flight.prompt), len(relay.flight.generated)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _merge_logprobs(into: dict | None, more: dict) -> dict:
    if into is None:
        return {k: list(v or []) for k, v in more.items()}
    for key, values in more.items():
        into.setdefault(key, []).extend(values or [])
    return into


def _sse(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"
