"""The ``vllm-aio`` command: development helpers around the connector.

``vllm-aio mooncake-pool`` starts a Mooncake pool on loopback (a master plus a
memory-owning client, see ``vllm_aio.devtools.mooncake_pool``), prints the
settings engines should use (or writes them to ``--config-out`` for
``MOONCAKE_CONFIG_PATH``) and keeps the pool up until SIGINT or SIGTERM, so
the cached blocks outlive the engines that put them.

``vllm-aio migrate`` starts a greedy completion on one instance, moves it with
the KV it computed to another after ``--after`` tokens, and prints the whole
generation and the move's figures as JSON (``vllm_aio.migration.driver``).
Both instances run the connector with ``"migration": true``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from vllm_aio.config import ConfigError, parse_size


def _size(value: str) -> int:
    from vllm_aio.devtools.mooncake_pool import MIN_SIZE

    try:
        size = parse_size("--size", value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    if size < MIN_SIZE:
        raise argparse.ArgumentTypeError(f"mooncake_client needs at least 16MB, got {value!r}")
    return size


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-aio", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pool = commands.add_parser(
        "mooncake-pool",
        help="run a development Mooncake pool (master + memory owner) on loopback",
        description="Start mooncake_master and a memory-owning mooncake_client on 127.0.0.1, "
        "print the engine settings as JSON, and stop both on SIGINT/SIGTERM.",
    )
    pool.add_argument("--size", type=_size, default=parse_size("--size", "2GB"),
                      help="bytes of pool memory the client owns, e.g. 2GB (default 2GB)")
    pool.add_argument("--rpc-port", type=int, help="master RPC port (default: a free port)")
    pool.add_argument("--metrics-port", type=int, help="master metrics port (default: a free port)")
    pool.add_argument("--client-port", type=int, help="memory owner's service port (default: a free port)")
    pool.add_argument("--config-out", type=Path, help="also write the engine settings JSON here "
                      "(point MOONCAKE_CONFIG_PATH at it)")
    pool.add_argument("--log-dir", type=Path, help="where the master and client logs go (default: a temp dir)")
    move = commands.add_parser(
        "migrate",
        help="move a running request, with its KV, from one vLLM instance to another",
        description="Generate on --source, move the request and its KV to --target after --after tokens, "
        "finish it there, and print the generation and the move as JSON.",
    )
    move.add_argument("--source", required=True, help="source instance URL, e.g. http://127.0.0.1:8000")
    move.add_argument("--target", required=True, help="target instance URL")
    prompt = move.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenized by the source)")
    prompt.add_argument("--prompt-token-ids", type=Path, help="a JSON file holding a list of token ids")
    move.add_argument("--max-tokens", type=int, default=64)
    move.add_argument("--after", type=int, default=16, help="tokens generated on the source before the move")
    move.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                      help="the instances' --api-key (default: $VLLM_API_KEY)")
    return parser


def migrate(args: argparse.Namespace) -> int:
    import requests

    from vllm_aio.migration.driver import Instance, MigrationError, generate_migrating

    source, target = Instance(args.source, args.api_key), Instance(args.target, args.api_key)
    try:
        if args.prompt_token_ids:
            token_ids = json.loads(args.prompt_token_ids.read_text())
        else:
            reply = requests.post(f"{source.url}/tokenize", json={"model": source.model(), "prompt": args.prompt},
                                  headers=source.headers(), timeout=source.timeout)
            reply.raise_for_status()
            token_ids = reply.json()["tokens"]
        result = generate_migrating(source, target, token_ids, args.max_tokens, args.after)
    except (MigrationError, requests.RequestException) as exc:
        print(f"vllm-aio migrate: {exc}", file=sys.stderr)
        return 1
    report = result.report
    print(json.dumps({
        "prompt_tokens": len(token_ids), "generated": len(result.token_ids), "moved_after": result.moved_after,
        "text": result.text, "token_ids": result.token_ids, "target_cached_tokens": result.cached_tokens,
        "move": None if report is None else {
            "mode": report.mode, "migration_id": report.migration_id, "full_blocks": report.full_blocks,
            "moved_blocks": report.moved_blocks, "bytes": report.bytes, "gbps": round(report.gbps, 3),
            "seconds": {k: round(v, 4) for k, v in report.seconds.items()},
        },
        "error": result.error,
    }, indent=2))
    return 0 if result.moved_after is not None else 1


def _wait_for_signal(pool_alive: Callable[[], bool]) -> str:
    """Block until SIGINT/SIGTERM (returns its name) or a pool process dies."""
    stop = threading.Event()
    received: list[str] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    while not stop.wait(0.5):
        if not pool_alive():
            return "pool process exited"
    return received[0]


def mooncake_pool(args: argparse.Namespace) -> int:
    from vllm_aio.devtools.mooncake_pool import MooncakePool, PoolError

    pool = MooncakePool(args.size, rpc_port=args.rpc_port, metrics_port=args.metrics_port,
                        client_port=args.client_port, log_dir=args.log_dir)
    try:
        pool.start()
    except PoolError as e:
        print(f"vllm-aio mooncake-pool: {e}", file=sys.stderr)
        return 1
    try:
        text = json.dumps(pool.config, indent=2)
        if args.config_out:
            args.config_out.write_text(text + "\n")
            print(f"# settings written to {args.config_out}; export MOONCAKE_CONFIG_PATH={args.config_out}",
                  file=sys.stderr)
        print(text, flush=True)
        print(f"# pool of {args.size} bytes up (pid {os.getpid()}, logs in {pool.log_dir}); "
              "Ctrl-C or SIGTERM stops it", file=sys.stderr, flush=True)
        reason = _wait_for_signal(pool.alive)
        print(f"# stopping ({reason})", file=sys.stderr, flush=True)
        return 0 if reason in ("SIGINT", "SIGTERM") else 1
    finally:
        pool.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "mooncake-pool":
        return mooncake_pool(args)
    if args.command == "migrate":
        return migrate(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
