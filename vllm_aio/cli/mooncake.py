"""``vllm-aio serve-mooncake``: a development Mooncake pool (master + memory owner) on loopback."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from vllm_aio.config import parse_size
from vllm_aio.errors import ConfigError
from vllm_aio.log import get_logger

logger = get_logger(__name__)

OLD_NAME = "mooncake-pool"  # accepted for one release


def add_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve-mooncake", aliases=[OLD_NAME],
        help="run a development Mooncake pool (master + memory owner) on loopback",
        description="Start mooncake_master and a memory-owning mooncake_client on 127.0.0.1, "
        "print the engine settings as JSON, and stop both on SIGINT/SIGTERM.",
    )
    serve.add_argument("--size", type=_size, default=parse_size("--size", "2GB"),
                       help="bytes of pool memory the client owns, e.g. 2GB (default 2GB)")
    serve.add_argument("--rpc-port", type=int, help="master RPC port (default: a free port)")
    serve.add_argument("--metrics-port", type=int, help="master metrics port (default: a free port)")
    serve.add_argument("--client-port", type=int, help="memory owner's service port (default: a free port)")
    serve.add_argument("--config-out", type=Path, help="also write the engine settings JSON here "
                       "(point MOONCAKE_CONFIG_PATH at it)")
    serve.add_argument("--log-dir", type=Path, help="where the master and client logs go (default: a temp dir)")
    serve.set_defaults(run=run)


def _size(value: str) -> int:
    from vllm_aio.devtools.mooncake_pool import MIN_SIZE

    try:
        size = parse_size("--size", value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    if size < MIN_SIZE:
        raise argparse.ArgumentTypeError(f"mooncake_client needs at least 16MB, got {value!r}")
    return size


def run(args: argparse.Namespace) -> int:
    from vllm_aio.devtools.mooncake_pool import MooncakePool, PoolError

    if args.command == OLD_NAME:
        logger.warning("vllm-aio %s is now vllm-aio serve-mooncake; the old name goes in the next release",
                       OLD_NAME)
    pool = MooncakePool(args.size, rpc_port=args.rpc_port, metrics_port=args.metrics_port,
                        client_port=args.client_port, log_dir=args.log_dir)
    try:
        pool.start()
    except PoolError as e:
        print(f"vllm-aio serve-mooncake: {e}", file=sys.stderr)
        return 1
    try:
        _print_settings(pool.config, args.config_out)
        print(f"# pool of {args.size} bytes up (pid {os.getpid()}, logs in {pool.log_dir}); "
              "Ctrl-C or SIGTERM stops it", file=sys.stderr, flush=True)
        reason = _wait_for_signal(pool.alive)
        print(f"# stopping ({reason})", file=sys.stderr, flush=True)
        return 0 if reason in ("SIGINT", "SIGTERM") else 1
    finally:
        pool.stop()


def _print_settings(config: dict, config_out: Path | None) -> None:
    """The engines' settings on stdout, and in ``config_out`` for ``MOONCAKE_CONFIG_PATH``."""
    text = json.dumps(config, indent=2)
    if config_out:
        config_out.write_text(text + "\n")
        print(f"# settings written to {config_out}; export MOONCAKE_CONFIG_PATH={config_out}", file=sys.stderr)
    print(text, flush=True)


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
