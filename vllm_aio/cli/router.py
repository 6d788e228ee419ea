"""``vllm-aio router``: the router in front of several instances, moving requests by a policy."""

from __future__ import annotations

import argparse
import logging
import sys

from vllm_aio.cli.migrate import add_api_key
from vllm_aio.migration.policy import POLICIES


def add_parser(commands: argparse._SubParsersAction) -> None:
    router = commands.add_parser(
        "router",
        help="serve /v1/completions in front of several vLLM instances, moving requests by a policy",
        description="Relay completions to the --instance URLs and move running requests between them by "
        "--policy. priority: move the most important requests (vLLM's priority field) of a pressured "
        "instance to the instance with the most free KV.",
    )
    router.add_argument("--policy", choices=POLICIES, default="priority", help="which requests move, and where "
                        "(default priority)")
    router.add_argument("--instance", action="append", required=True, help="an instance URL (repeat, at least 2)")
    router.add_argument("--host", default="127.0.0.1", help="the router's address (default 127.0.0.1)")
    router.add_argument("--port", type=int, default=8000, help="the router's port (default 8000)")
    router.add_argument("--interval", type=float, default=0.25, help="seconds between polls of the instances' "
                        "/metrics (default 0.25)")
    router.add_argument("--stall", type=float, default=1.0, help="seconds without a token after which a request "
                        "ordered to move counts as waiting or preempted and moves at once, not at a block "
                        "boundary (default 1)")
    add_api_key(router)
    router.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from vllm_aio.migration.driver import Instance
    from vllm_aio.migration.router import serve

    if len(args.instance) < 2:
        print("vllm-aio router: at least two --instance URLs", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")  # its moves, one a line
    instances = [Instance(url.rstrip("/"), args.api_key) for url in args.instance]
    print(f"router on http://{args.host}:{args.port} (policy {args.policy}) in front of "
          f"{', '.join(i.url for i in instances)}", file=sys.stderr, flush=True)
    serve(instances, args.host, args.port, args.policy, args.interval, args.stall)
    return 0
