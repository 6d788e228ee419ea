"""The ``vllm-aio`` command: development helpers around the connector.

``vllm-aio serve-mooncake`` starts a Mooncake pool on loopback (a master plus a
memory-owning client, see ``vllm_aio.devtools.mooncake_pool``), prints the
settings engines should use (or writes them to ``--config-out`` for
``MOONCAKE_CONFIG_PATH``) and keeps the pool up until SIGINT or SIGTERM, so
the cached blocks outlive the engines that put them. ``mooncake-pool`` is its
old name, accepted for one release with a warning.

``vllm-aio migrate`` starts a greedy completion on one instance, moves it with
the KV it computed to another after ``--after`` tokens, and prints the whole
generation and the move's figures as JSON (``vllm_aio.migration.driver``).
Both instances run the connector with ``"migration": true``.

``vllm-aio router --policy priority --instance URL --instance URL ...`` runs
the router clients send their completions to: it moves the most important
requests of a pressured instance to the one with the most free KV
(``vllm_aio.migration.router``).

``vllm-aio pool ls | stats NAME | clear NAME [--namespace N]`` lists the
embedded pools of this host, shows one, or evicts its stored values
(``vllm_aio.pool.inspect``).

One module per command family; each adds its parser and the function that runs it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from vllm_aio.cli import migrate, mooncake, pool, router


def parser() -> argparse.ArgumentParser:
    command = argparse.ArgumentParser(prog="vllm-aio", description=__doc__.splitlines()[0])
    commands = command.add_subparsers(dest="command", required=True)
    for family in (mooncake, migrate, router, pool):
        family.add_parser(commands)
    return command


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.run(args)
