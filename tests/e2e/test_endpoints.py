"""POST /v1/kv_migration/{op} on one real `vllm serve`, loaded as documented in
vllm_aio/migration/endpoints.py: VLLM_PLUGINS naming both our plugins, --api-key set.

The engine core is started without "migration", so no control server of its
own listens: the last test stands one up where the engine core would, and
checks that the API server's calls reach it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from harness.engines import EAGER, aio_config
from harness.prerequisites import ROOT, require
from harness.servers import serve
from vllm_aio.migration.channel import MAX_BODY_BYTES, ControlServer, socket_path

API_KEY = "test-key"
VLLM_PLUGINS = "vllm_aio_buffer_plan,vllm_aio_connector,vllm_aio_migration"
# vLLM's connector factory logs this in each process that builds the connector.
ENGINE_CORE_ENGINE_ID = re.compile(r"\(EngineCore[^)]*\).*Creating v1 connector .* engine_id: (\S+)")


@dataclass
class Server:
    base: str
    engine_id: str  # as the engine-core process has it

    def post(self, op: str, data, key: bool = True) -> requests.Response:
        headers = {"Authorization": f"Bearer {API_KEY}"} if key else {}
        return requests.post(f"{self.base}/v1/kv_migration/{op}", data=data, headers=headers, timeout=60)


def _require_entry_point() -> None:
    names = [ep.name for ep in importlib.metadata.entry_points(group="vllm.endpoint_plugins")]
    if "vllm_aio_migration" not in names:
        message = "vllm_aio_migration is not a vllm.endpoint_plugins entry point: reinstall (pip install -e .)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[Server]:
    require("vllm")
    _require_entry_point()
    # A runtime dir of this module's own: the server's socket path and the test's agree through it.
    runtime_dir = tempfile.mkdtemp(prefix="ep-", dir="/tmp")
    log_path = Path(runtime_dir) / "server.log"
    args = ["--api-key", API_KEY, "--block-size", "32", "--max-model-len", "4096", "--enforce-eager"]
    config = aio_config(local_pool_size="64MB")  # no engine_id: the test checks that the generated one reaches both
    env = {"VLLM_PLUGINS": VLLM_PLUGINS, "XDG_RUNTIME_DIR": runtime_dir, "VLLM_CPU_KVCACHE_SPACE": "1", **EAGER,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("XDG_RUNTIME_DIR", runtime_dir)
            with serve(tiny_model, log_path, args, config, env, startup_s=180) as running:
                found = ENGINE_CORE_ENGINE_ID.search(log_path.read_text(errors="replace"))
                assert found, f"no engine_id line from the engine core in {log_path}"
                yield Server(running.url, found.group(1))
    finally:
        shutil.rmtree(runtime_dir)


def test_a_call_without_the_api_key_is_refused_with_401(server: Server):
    assert server.post("session_info", b"{}", key=False).status_code == 401


def test_with_no_control_server_a_call_answers_503_migration_not_enabled(server: Server):
    r = server.post("session_info", b"{}")
    assert r.status_code == 503
    assert '"migration": true in kv_connector_extra_config' in r.json()["error"]


@pytest.mark.parametrize("op", ["Allocate", "alloc8", "a" * 33])
def test_an_invalid_operation_name_is_refused_with_400(server: Server, op: str):
    r = server.post(op, b"{}")
    assert r.status_code == 400 and "invalid operation name" in r.json()["error"]


@pytest.mark.parametrize("framing", ["content_length", "chunked"])
def test_a_body_over_the_limit_is_refused_with_413(server: Server, framing: str):
    size = MAX_BODY_BYTES + 1
    # A generator makes requests send chunks with no Content-Length: the actual size must count.
    data = b"x" * size if framing == "content_length" else (b"x" * (1 << 20) for _ in range((size >> 20) + 1))
    r = server.post("allocate", data)
    assert r.status_code == 413 and "exceeds" in r.json()["error"]


def test_a_call_reaches_the_control_server_of_the_engine_core_and_returns_its_reply(server: Server):
    seen: list[tuple[str, dict]] = []

    def handle(op: str, body: dict) -> tuple[int, dict]:
        seen.append((op, body))
        return 202, {"answered": op}

    # Where the engine core would listen, by its own engine_id: reaching it
    # proves the API server derived the same path from the same id.
    control = ControlServer(socket_path(server.engine_id), handle)
    control.start()
    try:
        r = server.post("allocate", json.dumps({"token_ids": [1, 2, 3]}))
    finally:
        control.close()
    assert (r.status_code, r.json()) == (202, {"answered": "allocate"})
    assert r.headers["content-type"] == "application/json"
    assert seen == [("allocate", {"token_ids": [1, 2, 3]})]


def test_metrics_export_the_pools_readings_and_already_stored_blocks_under_both_names(server: Server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    (model,) = [m["id"] for m in requests.get(f"{server.base}/v1/models", headers=auth, timeout=30).json()["data"]]
    completion = {"model": model, "prompt": "a b c d " * 40, "max_tokens": 1}
    for _ in range(2):  # the second stores nothing new
        assert requests.post(f"{server.base}/v1/completions", json=completion, headers=auth, timeout=120).ok
    text = requests.get(f"{server.base}/metrics", timeout=30).text
    for name in ("vllm:aio_pool_used_bytes", "vllm:aio_pool_capacity_bytes", "vllm:aio_pool_stored_values",
                 "vllm:aio_pool_evicted_values", "vllm:aio_save_already_stored_total", "vllm:aio_save_skipped_total"):
        assert re.search(rf"^{re.escape(name)}\{{", text, re.MULTILINE), f"{name} is not on /metrics"
