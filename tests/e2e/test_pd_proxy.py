"""The P/D proxy example against two recording upstream servers (the end-to-end
P/D flow itself runs on real vLLM in test_e2e_pool and test_e2e_mooncake)."""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests

from harness.prerequisites import ROOT


def _load_proxy():
    spec = importlib.util.spec_from_file_location("pd_proxy", ROOT / "examples" / "pd_proxy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recording_server(name: str, seen: list) -> ThreadingHTTPServer:
    class Upstream(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((name, self.path, body))
            payload = json.dumps({"from": name}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Upstream)


def _serve(server: ThreadingHTTPServer) -> str:
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_proxy_prefills_with_one_token_then_decodes_the_original_request():
    seen: list = []
    prefill, decode = _recording_server("prefill", seen), _recording_server("decode", seen)
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), _load_proxy().make_handler(_serve(prefill), _serve(decode)))
    base = _serve(proxy)
    try:
        request = {"model": "m", "prompt": "p", "max_tokens": 64, "stream": True, "stream_options": {}}
        reply = requests.post(f"{base}/v1/completions", json=request, timeout=10)
        assert reply.json() == {"from": "decode"}
        (first, first_path, first_body), (second, _, second_body) = seen
        assert (first, first_path) == ("prefill", "/v1/completions")
        assert first_body == {"model": "m", "prompt": "p", "max_tokens": 1, "stream": False}
        assert (second, second_body) == ("decode", request)
    finally:
        for server in (proxy, prefill, decode):
            server.shutdown()
