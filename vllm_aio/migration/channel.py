"""The unix-socket channel from the OpenAI API server to the engine-core process.

The engine core serves the migration operations on a ``ControlServer``: HTTP/1.1,
``POST /{op}`` with a JSON object body, a JSON object reply. The API server
relays each ``/v1/kv_migration/{op}`` call to it with ``forward``. Both sides
find the socket with ``socket_path(engine_id)``.

The socket lives in a per-user directory of mode 0700, so only this user's
processes can connect: the API server's ``--api-key`` guards the network side,
the file system guards this one.

Standard library only: the engine-core side imports this module too, and the
API server side must not import torch for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import socket
import socketserver
import stat
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from vllm_aio.log import get_logger

logger = get_logger(__name__)

# A request body limit on both sides of the channel. The largest body the
# protocol sends is a request's token ids: 1M ids as JSON are about 8 MB.
MAX_BODY_BYTES = 32 * 1024 * 1024

# sun_path holds 108 bytes on Linux, the terminating NUL included.
_MAX_SOCKET_PATH = 107
# An engine id is used verbatim in the file name only when it is plainly safe there.
_PLAIN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A peer that stops sending mid-request must not hold a server thread forever.
_IO_TIMEOUT_S = 60.0

# The reply when no control server listens: the engine core was started without migration.
NOT_ENABLED = json.dumps({
    "error": "KV migration is not enabled on this instance: "
    'set "migration": true in kv_connector_extra_config'
}).encode()

Handler = Callable[[str, dict], tuple[int, dict]]


def socket_path(engine_id: str) -> Path:
    """Where the engine core with ``engine_id`` listens (the directory is created if missing)."""
    directory = _private_dir()
    path = directory / f"control-{engine_id}.sock"
    if not _PLAIN_ID.fullmatch(engine_id) or not _fits(path):
        path = directory / _hashed_name(engine_id)
    return path


def _hashed_name(engine_id: str) -> str:
    return f"control-{hashlib.sha256(engine_id.encode()).hexdigest()[:32]}.sock"


def _fits(path: Path) -> bool:
    return len(os.fsencode(path)) <= _MAX_SOCKET_PATH


def _private_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    directory = Path(f"/tmp/vllm_aio-{os.getuid()}")
    if runtime and os.path.isabs(runtime) and os.access(runtime, os.W_OK | os.X_OK):
        # A runtime dir too deep for even a hashed name is passed over for /tmp.
        if _fits(Path(runtime) / "vllm_aio" / _hashed_name("")):
            directory = Path(runtime) / "vllm_aio"
    directory.mkdir(mode=0o700, exist_ok=True)
    _check_private(directory)
    return directory


def _check_private(directory: Path) -> None:
    # /tmp is shared: another user may have made this name first, to read or
    # answer our calls. Only a real directory of ours is used.
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{directory} is not a directory owned by uid {os.getuid()}")
    if stat.S_IMODE(st.st_mode) != 0o700:  # mkdir's mode is subject to the umask
        os.chmod(directory, 0o700)


class ControlServer:
    """Serves ``POST /{op}`` on a unix socket by calling ``handle(op, body)``."""

    def __init__(self, path: Path, handle: Handler) -> None:
        self.path = path
        self._handle = handle
        self._server: _UnixHTTPServer | None = None

    def start(self) -> None:
        _remove_stale_socket(self.path)
        self._server = _UnixHTTPServer(str(self.path), _request_handler(self._handle))
        threading.Thread(target=self._server.serve_forever, name="vllm_aio-control", daemon=True).start()
        logger.info("KV migration control socket: %s", self.path)

    def close(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self.path.unlink(missing_ok=True)
        self._server = None


def _remove_stale_socket(path: Path) -> None:
    """Unlink a socket file left by a dead server; refuse to take over a live one."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink()
            return
    raise RuntimeError(f"another control server is live on {path}")


class _UnixHTTPServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True


def _request_handler(handle: Handler) -> type[BaseHTTPRequestHandler]:
    class ControlRequestHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = _IO_TIMEOUT_S

        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            status, payload = self._dispatch()
            self._reply(status, payload)

        def _dispatch(self) -> tuple[int, bytes]:
            op = self.path.lstrip("/")
            body, problem = self._read_body()
            if problem is not None:
                return problem[0], json.dumps(problem[1]).encode()
            try:
                status, reply = handle(op, body)
                if not isinstance(status, int) or not isinstance(reply, dict):
                    raise TypeError(f"the handler returned ({status!r}, a {type(reply).__name__}), "
                                    "not (status, a JSON object)")
                return status, json.dumps(reply).encode()
            except Exception as exc:  # the server must outlive a failing operation
                logger.exception("KV migration op %s failed", op)
                return 500, json.dumps({"error": f"{op}: {type(exc).__name__}: {_one_line(str(exc))}"}).encode()

        def _read_body(self) -> tuple[dict, tuple[int, dict] | None]:
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                self.close_connection = True
                return {}, (411, {"error": "a Content-Length header is required"})
            if int(length) > MAX_BODY_BYTES:
                # The body stays unread, so the connection cannot carry another request.
                self.close_connection = True
                return {}, (413, {"error": f"body of {length} bytes exceeds the {MAX_BODY_BYTES} byte limit"})
            try:
                body = json.loads(self.rfile.read(int(length)))
            except ValueError as exc:
                return {}, (400, {"error": f"body is not JSON: {exc}"})
            if not isinstance(body, dict):
                return {}, (400, {"error": f"body must be a JSON object, got {type(body).__name__}"})
            return body, None

        def _reply(self, status: int, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def address_string(self) -> str:
            return "unix"  # a unix peer has no address; the default indexes into ''

        def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's signature)
            logger.debug("control socket: " + format, *args)

    return ControlRequestHandler


def _one_line(text: str) -> str:
    return " ".join(text.split())


async def forward(path: Path, op: str, body: bytes, timeout: float) -> tuple[int, bytes]:
    """``POST /{op}`` with ``body`` to the control server at ``path``: (status, JSON reply)."""
    try:
        return await asyncio.wait_for(_exchange(path, op, body), timeout)
    except (FileNotFoundError, ConnectionRefusedError):
        return 503, NOT_ENABLED
    except asyncio.TimeoutError:
        return 504, _error(f"the engine core did not answer {op} within {timeout:g} s")
    except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        return 502, _error(f"bad reply from the engine core's control socket: {type(exc).__name__}: {exc}")


async def _exchange(path: Path, op: str, body: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        head = (
            f"POST /{op} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode("ascii") + body)
        await writer.drain()
        return await _read_response(reader)
    finally:
        writer.close()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """Status and body of the one response on a ``Connection: close`` exchange (ValueError if malformed)."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    status_line, *header_lines = head.split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ValueError(f"status line {status_line!r}")
    length = None
    for line in header_lines:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = value.strip()
    if length is None or not length.isdigit():
        raise ValueError("no Content-Length in the reply")
    return int(parts[1]), await reader.readexactly(int(length))


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()
