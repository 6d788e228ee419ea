"""``vllm-aio migrate``: move one running request, with its KV, from one instance to another."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_aio.migration.driver import Instance


def add_api_key(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                        help="the instances' --api-key (default: $VLLM_API_KEY)")


class _RouterMoved(argparse.Action):
    """``migrate --policy`` ran the router before the router became a command of its own."""

    def __call__(self, parser: argparse.ArgumentParser, *_args: Any) -> None:
        parser.exit(2, "vllm-aio migrate: --policy is gone, the router is a command of its own: "
                    "vllm-aio router --policy priority --instance URL --instance URL\n")


def add_parser(commands: argparse._SubParsersAction) -> None:
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
    move.add_argument("--ignore-eos", action="store_true",
                      help="generate all --max-tokens tokens, past the end-of-sequence token (vLLM's ignore_eos): "
                      "a request that ends before the move cannot move")
    add_api_key(move)
    move.add_argument("--policy", nargs="?", action=_RouterMoved, help=argparse.SUPPRESS)
    move.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import requests

    from vllm_aio.migration.driver import Instance, MigrationError, generate_migrating

    source, target = Instance(args.source, args.api_key), Instance(args.target, args.api_key)
    try:
        token_ids = _prompt_token_ids(args, source)
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


def _prompt_token_ids(args: argparse.Namespace, source: Instance) -> list[int]:
    import requests

    if args.prompt_token_ids:
        return json.loads(args.prompt_token_ids.read_text())
    reply = requests.post(f"{source.url}/tokenize", json={"model": source.model(), "prompt": args.prompt},
                          headers=source.headers(), timeout=source.timeout)
    reply.raise_for_status()
    return reply.json()["tokens"]
