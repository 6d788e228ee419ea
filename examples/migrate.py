"""Move a running request, with the KV it computed, from one vLLM instance to another.

Starts two OpenAI-compatible vLLM servers (A and B) on a local model, each with
the AioConnector on an embedded host pool of its own and ``"migration": true``
(or uses two running ones given by ``--source`` and ``--target``). It runs one
greedy request on A unmigrated, then the same request again on A and, after
``--after`` tokens, moves it to B (the KV of every full block, generated tokens
included, goes peer to peer into B's pool) and lets B finish it. Prints both
generations, the move's figures and B's cached tokens; exits non-zero unless
the migrated generation equals the unmigrated one.

    .venv/bin/python examples/migrate.py --model models/tiny
    .venv/bin/python examples/migrate.py --source http://host-a:8000 --target http://host-b:8000

The same move from the command line: ``vllm-aio migrate --source URL --target URL --prompt TEXT``.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from vllm_aio.devtools.greedy import LOGPROB_TOLERANCE, NEAR_TIE, agreement
from vllm_aio.devtools.serve import free_port, vllm_server, wait_healthy
from vllm_aio.migration.driver import Instance, generate_migrating

SERVER_ARGS = ["--block-size", "32", "--max-model-len", "4096", "--enforce-eager", "--no-enable-prefix-caching",
               "--enable-prompt-tokens-details"]
# The migration routes are an endpoint plugin: vLLM loads it only when VLLM_PLUGINS names it
# (and then every other plugin it should load, such as our connector registration and dynamic-buffer plugin).
ENV = {"VLLM_PLUGINS": "vllm_aio_buffer_plan,vllm_aio_connector,vllm_aio_migration", "PYTHONHASHSEED": "0",
       "VLLM_CPU_KVCACHE_SPACE": "1"}


def kv_transfer_config() -> dict:
    return {
        "kv_connector": "AioConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"local_pool_size": "512MB", "migration": True,
                                      "migration_hostname": "127.0.0.1"},
    }


@contextlib.contextmanager
def two_servers(model: str, timeout_s: float) -> Iterator[tuple[str, str]]:
    logs = Path(tempfile.mkdtemp(prefix="vllm_aio_migrate_"))
    ports = free_port(), free_port()
    print(f"server logs: {logs}")
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(vllm_server(model, port, logs / f"{name}.log", SERVER_ARGS,
                                                 kv_transfer_config(), ENV))
                 for name, port in zip("ab", ports)]
        urls = tuple(f"http://127.0.0.1:{port}" for port in ports)
        for proc, url, name in zip(procs, urls, "ab"):
            wait_healthy(proc, url, logs / f"{name}.log", timeout_s)
        yield urls


def run(source: Instance, target: Instance, prompt_tokens: int, max_tokens: int, after: int) -> bool:
    rng = random.Random(7)
    prompt = [rng.randrange(3, 2000) for _ in range(prompt_tokens)]
    no_eos = {"ignore_eos": True}
    want = generate_migrating(source, source, prompt, max_tokens, max_tokens + 1, no_eos)
    got = generate_migrating(source, target, prompt, max_tokens, after, no_eos)
    if got.moved_after is None:
        print(f"not moved: {got.error}")
        return False
    r = got.report
    print(f"prompt {len(prompt)} tokens; {got.moved_after} generated on A, {len(got.token_ids) - got.moved_after} on B")
    print(f"move: {r.mode}, {r.moved_blocks}/{r.full_blocks} blocks, {r.bytes / 2**20:.1f} MiB in "
          f"{r.seconds['total'] * 1e3:.0f} ms (" + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in r.seconds.items()
                                                      if k != "total") + " ms)")
    print(f"B's cached tokens when it resumed: {got.cached_tokens} of {len(prompt) + got.moved_after}")
    print(f"unmigrated ids: {want.token_ids[:12]} ...")
    print(f"migrated ids:   {got.token_ids[:12]} ...")
    # Equal until they part, and parted only where the unmigrated run had a near tie (devtools/greedy.py):
    # there, rounding of KV written by another step may pick either token (bf16, the servers' dtype).
    match = agreement(got.token_ids, got.logprobs, want.token_ids, want.logprobs, want.margins,
                      NEAR_TIE["bfloat16"])
    same = match.within(LOGPROB_TOLERANCE["bfloat16"])
    if match.parted_at_near_tie is not None:
        first = match.compared
        print(f"parted at generated token {first} (top-two gap {want.margins[first]:.3f}"
              f"{', a near tie' if match.parted_at_near_tie else ''})")
    print(f"migrated generation equals the unmigrated one: {same} ({match.compared} tokens compared, "
          f"largest logprob difference {match.worst_logprob_gap:.2e})")
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--source", help="URL of a running source instance (default: start two servers)")
    parser.add_argument("--target", help="URL of a running target instance")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=1000)
    parser.add_argument("--after", type=int, default=40, help="tokens generated on the source before the move")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    if bool(args.source) != bool(args.target):
        parser.error("give both --source and --target, or neither")
    with contextlib.ExitStack() as stack:
        urls = (args.source, args.target) if args.source else stack.enter_context(
            two_servers(args.model, args.startup_timeout))
        ok = run(Instance(urls[0]), Instance(urls[1]), args.prompt_tokens, args.max_tokens, args.after)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
