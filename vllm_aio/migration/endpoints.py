"""``POST /v1/kv_migration/{op}`` on vLLM's OpenAI API server: a vLLM endpoint plugin.

Why a plugin and a unix socket: the migration operations need the host pool,
the connector's scheduler state and vLLM's block hash function, which all live
in the engine-core process; the network port and ``--api-key`` belong to the
API server process. The plugin adds the routes to the API server, under
``/v1`` so that ``--api-key`` guards them, and relays each call unchanged to
the engine core's control socket (``channel.py``). That socket sits in a
directory of mode 0700, so joining the two processes opens no new network port.

Enabling it: vLLM loads an endpoint plugin only when ``VLLM_PLUGINS`` names it,
and once ``VLLM_PLUGINS`` is set it is the allowlist of every plugin group, so
it must name our general plugins too (comma-separated, no spaces)::

    VLLM_PLUGINS=vllm_aio_buffer_plan,vllm_aio_connector,vllm_aio_migration

plus any other plugin the deployment relies on (a platform plugin such as
vLLM Ascend's, a LoRA resolver). The engine core then needs ``"migration": true``
in ``kv_connector_extra_config``; until its control socket exists every call
answers 503.

Which engine core: the socket is found by ``kv_transfer_config.engine_id``.
The API server builds the config, ``engine_id`` included (a uuid unless given),
and hands that object to the engine-core process it starts, so both see one
value. That holds for one API server and one engine core, the deployment
migration serves; with ``--api-server-count`` > 1 each API server builds its own
config (set ``engine_id`` explicitly), and data-parallel engine cores append
``_dp{rank}`` to it, so none of them answers here.
"""

from __future__ import annotations

import json
import re
from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI, Request, Response
from starlette.datastructures import State

from vllm_aio.log import get_logger
from vllm_aio.migration.channel import MAX_BODY_BYTES, NOT_ENABLED, forward, socket_path

if TYPE_CHECKING:
    from vllm.engine.protocol import EngineClient

logger = get_logger(__name__)

ROUTE = "/v1/kv_migration/{op}"
_OP = re.compile(r"[a-z_]{1,32}")
# One call may move a whole request's KV (transfer, flush) before it answers.
FORWARD_TIMEOUT_S = 300.0

router = APIRouter()


class MigrationEndpoints:
    """The ``vllm.endpoint_plugins`` entry point (vLLM calls the class with no arguments)."""

    name = "vllm_aio_migration"
    # Only servers with an engine: migration moves running generate requests.
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)

    async def init_state(self, engine_client: EngineClient, state: State, args: Namespace) -> None:
        # engine_client is never None here: required_tasks keeps us off the render server.
        kv_transfer = engine_client.vllm_config.kv_transfer_config
        state.kv_migration_socket = None if kv_transfer is None else socket_path(kv_transfer.engine_id)
        logger.info("KV migration routes %s forward to %s", ROUTE, state.kv_migration_socket)


@router.post(ROUTE)
async def kv_migration(op: str, request: Request) -> Response:
    if not _OP.fullmatch(op):
        return _error(400, f"invalid operation name {op[:40]!r}: names are 1-32 characters from a-z and _")
    body = await _read_limited(request)
    if body is None:
        return _error(413, f"body exceeds the {MAX_BODY_BYTES} byte limit")
    path: Path | None = request.app.state.kv_migration_socket
    if path is None:  # no KV connector at all
        return _json(503, NOT_ENABLED)
    return _json(*await forward(path, op, body, FORWARD_TIMEOUT_S))


async def _read_limited(request: Request) -> bytes | None:
    """The body, or None once it is known to exceed MAX_BODY_BYTES (without reading the rest)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return None
    # Content-Length may be absent (chunked) or wrong: count what actually arrives.
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _error(status: int, message: str) -> Response:
    return _json(status, json.dumps({"error": message}).encode())


def _json(status: int, payload: bytes) -> Response:
    return Response(content=payload, status_code=status, media_type="application/json")
