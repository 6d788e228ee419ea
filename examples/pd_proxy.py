"""A minimal prefill/decode proxy for pool-based disaggregation.

Every OpenAI request goes first to the prefill instance (kv_producer) with
``max_tokens: 1``, which computes the prompt and stores its KV in the pool,
then unchanged to the decode instance (kv_consumer), which loads that KV from
the pool and generates. The instances never talk to each other: the pool
(Mooncake, or an embedded pool shared by name on one host) is the only link.

    python examples/pd_proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

See examples/pd_mooncake.sh for the two ``vllm serve`` command lines.
"""

from __future__ import annotations

import argparse
import json
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests

ROUTES = ("/v1/completions", "/v1/chat/completions")


def make_handler(prefill: str, decode: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path not in ROUTES:
                self.send_error(HTTPStatus.NOT_FOUND, f"only {', '.join(ROUTES)}")
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            prefill_body = {**body, "max_tokens": 1, "stream": False}
            prefill_body.pop("stream_options", None)
            done = requests.post(prefill + self.path, json=prefill_body, timeout=600)
            if not done.ok:  # the decode side would recompute, but say why
                self.log_error("prefill failed (%s): %s", done.status_code, done.text[:200])
            self._relay(requests.post(decode + self.path, json=body, stream=True, timeout=600))

        def do_GET(self) -> None:  # noqa: N802
            self._relay(requests.get(decode + self.path, stream=True, timeout=60))

        def _relay(self, upstream: requests.Response) -> None:
            self.send_response(upstream.status_code)
            self.send_header("Content-Type", upstream.headers.get("Content-Type", "application/json"))
            self.end_headers()
            for chunk in upstream.iter_content(chunk_size=None):
                self.wfile.write(chunk)
                self.wfile.flush()

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True, help="base URL of the kv_producer instance")
    parser.add_argument("--decode", required=True, help="base URL of the kv_consumer instance")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), make_handler(args.prefill, args.decode))
    print(f"pd proxy on http://{args.host}:{args.port}: prefill {args.prefill}, decode {args.decode}")
    server.serve_forever()


if __name__ == "__main__":
    main()
