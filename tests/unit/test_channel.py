"""The migration control channel: ControlServer on a unix socket and forward() (no vLLM)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vllm_aio.migration.channel import MAX_BODY_BYTES, ControlServer, forward, socket_path


@pytest.fixture(autouse=True)
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    # Sockets of this test go under a dir of its own, not the user's real one;
    # a short one, as a real runtime dir is (pytest's tmp_path can be too deep).
    directory = Path(tempfile.mkdtemp(prefix="ch-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(directory))
    yield directory
    shutil.rmtree(directory)


@pytest.fixture
def serve() -> Iterator[Callable[..., ControlServer]]:
    servers: list[ControlServer] = []

    def start(handle: Callable[[str, dict], tuple[int, dict]], engine_id: str = "engine-a") -> ControlServer:
        server = ControlServer(socket_path(engine_id), handle)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def echo(op: str, body: dict) -> tuple[int, dict]:
    return 200, {"op": op, "body": body}


def call(path: Path, op: str, body: bytes, timeout: float = 10.0) -> tuple[int, dict]:
    status, reply = asyncio.run(forward(path, op, body, timeout))
    return status, json.loads(reply)


def raw_exchange(path: Path, request: bytes) -> bytes:
    """One request written as is; the reply until the server closes or 2 s pass."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        sock.connect(str(path))
        sock.sendall(request)
        # The headers and the body may arrive in separate writes: read until the close.
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except TimeoutError:
            pass
        return reply


def test_a_call_reaches_the_handler_and_returns_its_status_and_reply(serve):
    server = serve(lambda op, body: (201, {"op": op, "got": body}))
    assert call(server.path, "allocate", b'{"blocks": [1, 2]}') == (201, {"op": "allocate", "got": {"blocks": [1, 2]}})


def test_the_token_ids_of_a_million_token_request_fit_the_body_limit(serve):
    server = serve(lambda op, body: (200, {"n": len(body["token_ids"])}))
    body = json.dumps({"token_ids": list(range(1_000_000))}).encode()
    assert len(body) <= MAX_BODY_BYTES
    assert call(server.path, "allocate", body) == (200, {"n": 1_000_000})


def test_a_body_over_the_limit_is_refused_with_413_before_it_is_sent(serve):
    server = serve(echo)
    # Only the headers go out: a 413 that arrives proves the body was not awaited.
    head = f"POST /allocate HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n"
    reply = raw_exchange(server.path, head.encode())
    assert reply.startswith(b"HTTP/1.1 413 ")
    assert b"exceeds the" in reply


def test_a_request_without_content_length_is_refused_with_411(serve):
    server = serve(echo)
    reply = raw_exchange(server.path, b"POST /allocate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 411 ")


def test_a_body_that_is_not_json_is_refused_with_400(serve):
    server = serve(echo)
    status, reply = call(server.path, "allocate", b"{not json")
    assert status == 400 and "not JSON" in reply["error"]


def test_a_body_that_is_not_a_json_object_is_refused_with_400(serve):
    server = serve(echo)
    assert call(server.path, "allocate", b"[1, 2]") == (400, {"error": "body must be a JSON object, got list"})


def test_a_failing_handler_answers_500_with_a_one_line_message_and_logs_it(serve, caplog):
    def fail(op: str, body: dict) -> tuple[int, dict]:
        raise ValueError("pool is\nfull")

    server = serve(fail)
    with caplog.at_level(logging.ERROR, logger="vllm.vllm_aio.migration.channel"):
        assert call(server.path, "commit", b"{}") == (500, {"error": "commit: ValueError: pool is full"})
    assert "KV migration op commit failed" in caplog.text


def test_a_handler_reply_that_is_not_an_object_answers_500(serve):
    server = serve(lambda op, body: (200, ["not", "an", "object"]))
    status, reply = call(server.path, "commit", b"{}")
    assert status == 500 and "not (status, a JSON object)" in reply["error"]


def test_the_server_keeps_serving_after_a_handler_failure(serve):
    server = serve(lambda op, body: (200, {}) if op == "ok" else 1 / 0)
    assert call(server.path, "boom", b"{}")[0] == 500
    assert call(server.path, "ok", b"{}") == (200, {})


def test_forward_without_a_socket_file_answers_503_migration_not_enabled():
    status, reply = call(socket_path("nobody-here"), "session_info", b"{}")
    assert status == 503
    assert '"migration": true in kv_connector_extra_config' in reply["error"]


def test_forward_to_a_socket_nobody_listens_on_answers_503():
    path = _dead_socket_file(socket_path("dead"))
    assert call(path, "session_info", b"{}")[0] == 503


def test_forward_answers_504_when_the_handler_outlasts_the_timeout(serve):
    server = serve(lambda op, body: (time.sleep(1.0), (200, {}))[1])
    status, reply = call(server.path, "transfer", b"{}", timeout=0.2)
    assert status == 504 and "did not answer transfer" in reply["error"]


def test_forward_answers_502_when_the_peer_does_not_speak_http():
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(socket_path("not-http")))
        listener.listen()

        def babble() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"hello there\r\n\r\n")

        threading.Thread(target=babble, daemon=True).start()
        status, reply = call(socket_path("not-http"), "flush", b"{}")
    assert status == 502 and "bad reply" in reply["error"]


def test_a_stale_socket_file_is_replaced_at_start(serve):
    _dead_socket_file(socket_path("engine-a"))
    server = serve(echo)
    assert call(server.path, "flush", b"{}")[0] == 200


def test_a_live_server_on_the_path_is_not_taken_over(serve):
    serve(echo)
    with pytest.raises(RuntimeError, match="live"):
        ControlServer(socket_path("engine-a"), echo).start()


def test_a_path_that_is_not_a_socket_is_not_removed():
    path = socket_path("engine-a")
    path.write_text("someone's file")
    with pytest.raises(FileExistsError):
        ControlServer(path, echo).start()
    assert path.read_text() == "someone's file"


def test_close_removes_the_socket_file(serve):
    server = serve(echo)
    server.close()
    assert not server.path.exists()


def test_the_socket_directory_has_mode_0700(runtime_dir: Path):
    directory = socket_path("engine-a").parent
    assert directory.parent == runtime_dir
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


def test_an_existing_socket_directory_is_tightened_to_0700(runtime_dir: Path):
    (runtime_dir / "vllm_aio").mkdir(mode=0o755)
    directory = socket_path("engine-a").parent
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


def test_a_symlink_in_place_of_the_socket_directory_is_refused(runtime_dir: Path, tmp_path_factory):
    (runtime_dir / "vllm_aio").symlink_to(tmp_path_factory.mktemp("elsewhere"))
    with pytest.raises(PermissionError):
        socket_path("engine-a")


def test_without_a_runtime_dir_sockets_go_to_a_per_user_tmp_dir(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    directory = socket_path("engine-a").parent
    assert directory == Path(f"/tmp/vllm_aio-{os.getuid()}")
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


def test_a_runtime_dir_too_deep_for_a_socket_is_passed_over_for_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    assert socket_path("engine-a").parent == Path(f"/tmp/vllm_aio-{os.getuid()}")


def test_a_plain_engine_id_names_the_socket_file():
    engine_id = "1fbd03d5-1cf1-41f0-85ff-3bca9754d127"
    assert socket_path(engine_id).name == "control-1fbd03d5-1cf1-41f0-85ff-3bca9754d127.sock"


@pytest.mark.parametrize("engine_id", ["x" * 300, "../escape", "a b"])
def test_a_long_or_unsafe_engine_id_is_hashed_into_a_bindable_name(engine_id: str, serve):
    path = socket_path(engine_id)
    assert path.parent == socket_path("engine-a").parent
    assert len(os.fsencode(path)) <= 107
    server = serve(echo, engine_id=engine_id)
    assert call(server.path, "flush", b"{}")[0] == 200


def _dead_socket_file(path: Path) -> Path:
    """A socket file whose server is gone, as a killed engine core leaves it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()
    return path
