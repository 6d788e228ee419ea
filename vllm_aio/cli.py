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
``vllm-aio migrate --policy priority --instance URL --instance URL ...`` runs
the router clients send their completions to instead: it moves the most
important requests of a pressured instance to the one with the most free KV
(``vllm_aio.migration.router``).

``vllm-aio pool ls | stats NAME | clear NAME [--namespace N]`` lists the
embedded pools of this host, shows one, or evicts its stored values
(``vllm_aio.pool.inspect``).
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
from typing import TYPE_CHECKING

from vllm_aio.config import ConfigError, parse_size

if TYPE_CHECKING:
    from vllm_aio.pool.inspect import PoolInfo


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
        "finish it there, and print the generation and the move as JSON. With --policy, run a router in "
        "front of the --instance URLs instead, which moves requests by that policy.",
    )
    move.add_argument("--source", help="source instance URL, e.g. http://127.0.0.1:8000")
    move.add_argument("--target", help="target instance URL")
    prompt = move.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (tokenized by the source)")
    prompt.add_argument("--prompt-token-ids", type=Path, help="a JSON file holding a list of token ids")
    move.add_argument("--max-tokens", type=int, default=64)
    move.add_argument("--after", type=int, default=16, help="tokens generated on the source before the move")
    move.add_argument("--ignore-eos", action="store_true",
                      help="generate all --max-tokens tokens, past the end-of-sequence token (vLLM's ignore_eos): "
                      "a request that ends before the move cannot move")
    move.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                      help="the instances' --api-key (default: $VLLM_API_KEY)")
    routing = move.add_argument_group("router (--policy)")
    routing.add_argument("--policy", choices=["priority"],
                         help="run a router serving /v1/completions in front of the --instance URLs; priority: "
                         "move the most important requests (vLLM's priority field) of a pressured instance to "
                         "the instance with the most free KV")
    routing.add_argument("--instance", action="append", default=[], help="an instance URL (repeat, at least 2)")
    routing.add_argument("--host", default="127.0.0.1", help="the router's address (default 127.0.0.1)")
    routing.add_argument("--port", type=int, default=8000, help="the router's port (default 8000)")
    routing.add_argument("--interval", type=float, default=0.25, help="seconds between polls of the instances' "
                         "/metrics (default 0.25)")
    routing.add_argument("--stall", type=float, default=1.0, help="seconds without a token after which a request "
                         "ordered to move counts as waiting or preempted and moves at once, not at a block "
                         "boundary (default 1)")
    _pool_commands(commands)
    return parser


def _pool_commands(commands: argparse._SubParsersAction) -> None:
    pool = commands.add_parser("pool", help="the embedded pools on this host (/dev/shm): list, inspect, clear",
                               description="Inspect or clear the embedded host pools on this host. Listing "
                               "and stats take no lock and change nothing.")
    actions = pool.add_subparsers(dest="action", required=True)
    actions.add_parser("ls", help="every pool: size, entries, fill, hits, evictions, attached pids, stale files")
    stats = actions.add_parser("stats", help="one pool in detail, with its stored values per key namespace")
    stats.add_argument("name")
    clear = actions.add_parser("clear", help="evict a pool's stored values (values being written stay); "
                               "a pool no live process uses is removed")
    clear.add_argument("name")
    clear.add_argument("--namespace", help="only values of this key namespace (16 hex digits, see stats)")


def _bytes(n: float) -> str:
    unit, larger = "B", ["KiB", "MiB", "GiB"]
    while n >= 1024 and larger:
        n, unit = n / 1024, larger.pop(0)
    return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"


def _pool_row(info: PoolInfo) -> list[str]:
    snap = info.snapshot
    if snap is None:
        return [info.name, "-", "-", "-", "-", "-", "-", f"unreadable: {info.problem}"]
    usage = snap.usage
    pids = ",".join(map(str, snap.pids)) or "-"
    state = "stale (no live process)" if info.stale else "in use"
    if snap.dead_pids:
        state += f", {snap.dead_pids} dead pid(s)"
    return [info.name, _bytes(snap.file_bytes), str(usage.num_ready), f"{usage.num_ready / usage.num_slots:.1%}",
            f"{usage.hits}/{usage.lookups}", str(usage.evictions), pids, state]


def _print_table(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def pool(args: argparse.Namespace) -> int:
    from vllm_aio.pool import inspect

    try:
        if args.action == "ls":
            infos, orphan_locks = inspect.list_pools()
            _print_table(["NAME", "SIZE", "ENTRIES", "FILL", "HITS/LOOKUPS", "EVICTIONS", "PIDS", "STATE"],
                         [_pool_row(i) for i in infos])
            for name in orphan_locks:
                print(f"lock file without a pool (left over, or a pool being created): {name}")
        elif args.action == "stats":
            _print_stats(inspect.read_pool(args.name))
        else:
            done = inspect.clear(args.name, args.namespace)
            which = f"values of namespace {args.namespace}" if args.namespace else "values"
            print(f"evicted {done.evicted} {which} from pool {args.name!r}"
                  + ("; no live process used it: removed" if done.removed else ""))
    except (LookupError, RuntimeError, ValueError, OSError) as exc:
        print(f"vllm-aio pool {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


def _print_stats(info: PoolInfo) -> None:
    from vllm_aio.pool.inspect import namespaces

    snap = info.snapshot
    if snap is None:
        raise RuntimeError(info.problem)
    usage = snap.usage
    hit_rate = f" ({usage.hits / usage.lookups:.1%})" if usage.lookups else ""
    fields = {
        "pool": f"{info.name} ({'stale: no live process attached' if info.stale else 'in use'})",
        "file": f"{_bytes(snap.file_bytes)}",
        "slots": f"{usage.num_slots} of {_bytes(usage.slot_size)}",
        "entries": f"{usage.num_ready} ({usage.num_ready / usage.num_slots:.1%} full, {_bytes(usage.bytes_used)})",
        "being written": str(snap.writing),
        "hits/lookups": f"{usage.hits}/{usage.lookups}{hit_rate}",
        "evictions": str(usage.evictions),
        "attached pids": (",".join(map(str, snap.pids)) or "-")
        + (f" ({snap.dead_pids} dead)" if snap.dead_pids else ""),
    }
    for key, value in fields.items():
        print(f"{key + ':':15}{value}")
    counts = namespaces(snap)
    if counts:
        print()
        _print_table(["NAMESPACE", "ENTRIES"], [[ns, str(n)] for ns, n in counts.most_common()])


def migrate(args: argparse.Namespace) -> int:
    if args.policy:
        return route(args)
    if not (args.source and args.target and (args.prompt or args.prompt_token_ids)):
        print("vllm-aio migrate: --source, --target and --prompt or --prompt-token-ids are required "
              "(or --policy with --instance URLs)", file=sys.stderr)
        return 2
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
        result = generate_migrating(source, target, token_ids, args.max_tokens, args.after,
                                    {"ignore_eos": True} if args.ignore_eos else None)
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


def route(args: argparse.Namespace) -> int:
    import logging

    from vllm_aio.migration.driver import Instance
    from vllm_aio.migration.router import serve

    if len(args.instance) < 2:
        print("vllm-aio migrate --policy: at least two --instance URLs", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")  # its moves, one a line
    instances = [Instance(url.rstrip("/"), args.api_key) for url in args.instance]
    print(f"router on http://{args.host}:{args.port} (policy {args.policy}) in front of "
          f"{', '.join(i.url for i in instances)}", file=sys.stderr, flush=True)
    serve(instances, args.host, args.port, args.policy, args.interval, args.stall)
    return 0


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
    if args.command == "pool":
        return pool(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
