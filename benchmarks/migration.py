"""Runtime KV migration between two live ``vllm serve`` instances, next to the target recomputing the tokens.

Per model, two servers A and B start with the same settings: AioConnector on
an embedded pool of their own with ``"migration": true``, vLLM's prefix
caching off (every cached token comes from the pool), block size 32. For each
length L (prompt + generated tokens: here a prompt of L random token ids,
block-aligned, so every token sits in a full block) and each repeat:

1. A computes a fresh prompt P (a completion of ``max_tokens=1``; the
   connector stores P's full blocks in A's pool);
2. ``move_kv(A, B, P)`` (``vllm_aio.migration.driver``): session, flush,
   allocate, peer-to-peer TransferEngine transfer on loopback tcp, commit;
   timed per phase by the driver, as the caller sees them (HTTP calls
   included). ``write`` is the source's own account of its TransferEngine
   write, within the transfer phase;
3. B's warm TTFT for P: served from B's pool; its ``cached_tokens`` must
   cover every moved block (all L tokens but the last, which vLLM always
   computes);
4. B's cold TTFT for another fresh prompt of L tokens: the recompute
   baseline (B stores that prompt's blocks too, as any connector instance would).

TTFT is the client's time from sending a streamed ``/v1/completions`` to the
first token's chunk. ``--gap`` idle seconds separate the steps (vLLM's CPU
workers spin a while after each step, stealing the other server's cores).

Steady state, not start-up: before measuring, A computes and moves sequences
until every slot of B's pool has been written by a migration once (A's pool
cycles with it). A write into a slot B's engine-core process has never
touched is several times slower (its pages fault in, one by one, inside
TransferEngine's receive path: ~0.1-0.3 GB/s instead of ~1.5 here); a
just-started target pays that until its pool has cycled once. The warm-up's
own figures (``warm-up``, the first move with the TransferEngine link setup)
are printed and kept in the results.

The table shows the median over ``--repeats`` of each quantity on its own.
``GB/s`` is bytes moved (whole pool slots: entry header + every layer's K and
V of a block) over the whole migration. ``(migrate+warm)/recompute`` < 1
means moving the KV and then serving from it beats the target recomputing the
same tokens; ``recompute/migrate`` is how many migrations fit in one recompute.

    .venv/bin/python -m benchmarks.migration --models tiny,medium --lengths 1024,2048,4096,8192,16384 --repeats 3

``--quick`` (a smoke test): the tiny model, 1k and 2k tokens, once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests

from benchmarks._engine import BLOCK_SIZE, ROOT, kv_bytes_per_token, make_prompts, thread_binding, value_bytes
from benchmarks._report import arguments, print_markdown, progress, write_results
from vllm_aio.devtools.serve import free_port, vllm_server, wait_healthy
from vllm_aio.migration.driver import Instance, MigrationError, MoveReport, move_kv

GiB, MiB = 1 << 30, 1 << 20
# The migration routes are an endpoint plugin: VLLM_PLUGINS must name it, and then our general plugins too.
PLUGINS = "vllm_aio_buffer_plan,vllm_aio_connector,vllm_aio_migration"
PHASES = ("session", "flush", "allocate", "transfer", "commit")
QUICK_LENGTHS = "1024,2048"
WARMUP_TOKENS = 2048  # per warm-up sequence (at most the longest length measured)
# A migration may reserve at most half of the target's pool: twice the longest
# sequence's blocks, and some to spare for what the target stores itself.
SPARE_SLOTS = 64


@dataclass(frozen=True)
class Sizing:
    """What the servers of one model need for sequences of up to ``max_tokens`` tokens."""

    max_model_len: int
    kv_cache_gib: int  # VLLM_CPU_KVCACHE_SPACE: whole GiB
    pool_slots: int
    value_bytes: int
    max_positions: int  # the model's max_position_embeddings

    @classmethod
    def of(cls, model_dir: Path, max_tokens: int) -> Sizing:
        max_model_len = math.ceil((max_tokens + 1) / BLOCK_SIZE) * BLOCK_SIZE  # + the generated token
        kv_gib = max(1, math.ceil(2 * max_model_len * kv_bytes_per_token(model_dir) / GiB))
        positions = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
        slots = 2 * (max_model_len // BLOCK_SIZE) + SPARE_SLOTS
        return cls(max_model_len, kv_gib, slots, value_bytes(model_dir), positions)

    @property
    def pool_bytes(self) -> int:
        return self.pool_slots * self.value_bytes

    def server_args(self) -> list[str]:
        args = ["--block-size", str(BLOCK_SIZE), "--max-model-len", str(self.max_model_len), "--enforce-eager",
                "--no-enable-prefix-caching", "--enable-prompt-tokens-details"]
        if self.max_model_len > self.max_positions:
            # Random weights, plain RoPE: longer positions are as good as any; vLLM only needs the table longer.
            args += ["--hf-overrides", json.dumps({"max_position_embeddings": self.max_model_len})]
        return args

    def connector(self) -> dict:
        return {
            "kv_connector": "AioConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"migration": True, "migration_hostname": "127.0.0.1",
                                          "local_pool_size": self.pool_bytes},
        }

    def env(self) -> dict[str, str]:
        return {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "PYTHONHASHSEED": "0", "VLLM_PLUGINS": PLUGINS,
                **thread_binding(),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


class Source(Instance):
    """Server A: keeps its own answer to the last ``transfer`` (the seconds its TransferEngine write took)."""

    last_transfer: dict | None = None

    def call(self, op: str, body: dict) -> dict:
        answer = super().call(op, body)
        if op == "transfer":
            self.last_transfer = answer
        return answer


@contextlib.contextmanager
def server_pair(model_dir: Path, sizing: Sizing, workdir: Path, timeout: float) -> Iterator[tuple[Source, Instance]]:
    """Servers A and B, started side by side, stopped on exit."""
    with contextlib.ExitStack() as stack:
        servers = []
        for name in ("a", "b"):
            port, log = free_port(), workdir / f"{name}.log"
            proc = stack.enter_context(vllm_server(str(model_dir), port, log, sizing.server_args(),
                                                   sizing.connector(), sizing.env()))
            servers.append((proc, f"http://127.0.0.1:{port}", log))
        for proc, url, log in servers:
            wait_healthy(proc, url, log, timeout)
        (_, a, _), (_, b, _) = servers
        yield Source(a, timeout=timeout), Instance(b, timeout=timeout)


@dataclass
class Answer:
    ttft_s: float
    cached_tokens: int


def first_token(instance: Instance, model: str, prompt: list[int]) -> Answer:
    """A streamed completion of one token: the client's time to its first token, and the prompt's cache hit."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    ttft, cached = None, None
    start = time.perf_counter()
    with requests.post(f"{instance.url}/v1/completions", json=body, stream=True, timeout=instance.timeout) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: "):])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if ttft is None or cached is None:
        raise RuntimeError(f"{instance.url}: the completion streamed no token or no usage")
    return Answer(ttft, cached)


def move_fields(report: MoveReport, write_s: float) -> dict:
    return {"mode": report.mode, "full_blocks": report.full_blocks, "moved_blocks": report.moved_blocks,
            "bytes": report.bytes, "matched_tokens": report.matched_tokens, "seconds": report.seconds,
            "gbps": report.gbps, "write_s": write_s}


def write_gbps(move: dict) -> float:
    return move["bytes"] / move["write_s"] / 1e9 if move["write_s"] else 0.0


class Pair:
    """Servers A and B of one model, fed fresh prompts."""

    def __init__(self, a: Source, b: Instance, seed: int, gap: float) -> None:
        self.a, self.b, self.gap = a, b, gap
        self.model = a.model()
        self.seed = seed

    def prompt(self, tokens: int) -> list[int]:
        self.seed += 1
        return make_prompts(self.seed, [tokens])[0]

    def compute_and_move(self, prompt: list[int]) -> tuple[Answer, dict]:
        """A computes (and stores) ``prompt``, then its KV moves to B."""
        source = first_token(self.a, self.model, prompt)
        time.sleep(self.gap)
        self.a.last_transfer = None
        report = move_kv(self.a, self.b, prompt)
        return source, move_fields(report, self.a.last_transfer["seconds"] if self.a.last_transfer else 0.0)

    def warm_up(self, tokens: int, slots: int) -> list[dict]:
        """Moves of ``tokens``-token sequences until every one of B's ``slots`` was written by one."""
        return [self.compute_and_move(self.prompt(tokens))[1] for _ in range(math.ceil(slots * BLOCK_SIZE / tokens))]

    def sample(self, tokens: int) -> dict:
        """One repeat at one length: A computes, the KV moves, B serves it warm, B recomputes another prompt."""
        moved = self.prompt(tokens)
        source, move = self.compute_and_move(moved)
        time.sleep(self.gap)
        warm = first_token(self.b, self.model, moved)
        time.sleep(self.gap)
        cold = first_token(self.b, self.model, self.prompt(tokens))
        time.sleep(self.gap)
        return {"source": vars(source), "move": move, "warm": vars(warm), "cold": vars(cold)}


def problems_of(tokens: int, samples: list[dict]) -> list[str]:
    """What a length's samples got wrong: a move that was not a full copy, a warm request not served
    from the moved blocks, a cold one that hit anything."""
    blocks = tokens // BLOCK_SIZE
    hit = min(blocks * BLOCK_SIZE, tokens - 1)  # vLLM computes the last prompt token in any case
    bad = []
    for i, s in enumerate(samples):
        move = s["move"]
        if (move["mode"], move["full_blocks"], move["moved_blocks"]) != ("copy", blocks, blocks):
            bad.append(f"repeat {i}: moved {move['moved_blocks']}/{move['full_blocks']} blocks by "
                       f"{move['mode']!r}, want {blocks}/{blocks} by 'copy'")
        if s["warm"]["cached_tokens"] < hit:
            bad.append(f"repeat {i}: the warm request cached {s['warm']['cached_tokens']} tokens, want {hit}")
        for side in ("source", "cold"):
            if s[side]["cached_tokens"]:
                bad.append(f"repeat {i}: the {side} request cached {s[side]['cached_tokens']} tokens, want 0")
    return bad


def summarize(model: str, tokens: int, samples: list[dict]) -> dict:
    def median(get) -> float:
        return statistics.median(get(s) for s in samples)

    return {
        "model": model, "tokens": tokens, "repeats": len(samples), "blocks": samples[0]["move"]["moved_blocks"],
        "bytes": median(lambda s: s["move"]["bytes"]),
        "migrate_s": median(lambda s: s["move"]["seconds"]["total"]),
        "phases_s": {p: median(lambda s: s["move"]["seconds"].get(p, 0.0)) for p in PHASES},
        "gbps": median(lambda s: s["move"]["gbps"]),
        "write_s": median(lambda s: s["move"]["write_s"]),
        "write_gbps": median(lambda s: write_gbps(s["move"])),
        "recompute_s": median(lambda s: s["cold"]["ttft_s"]),
        "source_compute_s": median(lambda s: s["source"]["ttft_s"]),
        "warm_s": median(lambda s: s["warm"]["ttft_s"]),
        "warm_cached_min": min(s["warm"]["cached_tokens"] for s in samples),
        "ratio": median(lambda s: (s["move"]["seconds"]["total"] + s["warm"]["ttft_s"]) / s["cold"]["ttft_s"]),
        "samples": samples,
        "problems": problems_of(tokens, samples),
    }


def bench_model(name: str, lengths: list[int], seed: int, args) -> dict:
    from vllm_aio.devtools.tiny_model import PRESETS, ensure_model

    model_dir = ensure_model(ROOT / "models" / name, PRESETS[name])
    sizing = Sizing.of(model_dir, max(lengths))
    workdir = Path(tempfile.mkdtemp(prefix=f"vllm_aio_migration_{name}_"))
    print(f"model {name}: {model_dir}, max_model_len {sizing.max_model_len}, pool {sizing.pool_slots} slots of "
          f"{sizing.value_bytes} B ({sizing.pool_bytes / MiB:.0f} MiB) each, "
          f"VLLM_CPU_KVCACHE_SPACE={sizing.kv_cache_gib}; logs in {workdir}", flush=True)
    started = time.perf_counter()
    rows, errors = [], {}
    with server_pair(model_dir, sizing, workdir, args.timeout) as (a, b):
        startup_s = time.perf_counter() - started
        print(f"  servers ready after {startup_s:.0f}s", flush=True)
        pair = Pair(a, b, seed, args.gap)
        warm_tokens = min(WARMUP_TOKENS, max(lengths)) // BLOCK_SIZE * BLOCK_SIZE
        warm_up = pair.warm_up(warm_tokens, sizing.pool_slots)
        print(f"  warm-up: {len(warm_up)} moves of {warm_tokens} tokens into slots B had not used: write median "
              f"{statistics.median(map(write_gbps, warm_up)):.2f} GB/s; the first move (TransferEngine link setup "
              f"included) {warm_up[0]['seconds']['total'] * 1e3:.0f} ms", flush=True)
        for tokens in progress(lengths, len(lengths), f"{name} lengths", args.quick):
            try:
                samples = [pair.sample(tokens) for _ in range(args.repeats)]
            except (MigrationError, requests.RequestException, RuntimeError) as exc:
                errors[tokens] = str(exc)
                print(f"  {tokens} tokens: FAILED: {exc}", flush=True)
                continue
            rows.append(summarize(name, tokens, samples))
            print(f"  {tokens} tokens: migrate {rows[-1]['migrate_s'] * 1e3:.0f} ms, "
                  f"recompute {rows[-1]['recompute_s'] * 1e3:.0f} ms", flush=True)
    return {"rows": rows, "errors": errors, "startup_s": startup_s, "warm_up": warm_up,
            "sizing": {**vars(sizing), "pool_bytes": sizing.pool_bytes}, "logs": str(workdir)}


def print_tables(rows: list[dict], errors: dict[tuple[str, int], str]) -> None:
    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.1f}"

    body = []
    for r in rows:
        warm = f"{r['warm_cached_min']}/{r['tokens']}"
        body.append([r["model"], str(r["tokens"]), str(r["blocks"]), f"{r['bytes'] / MiB:.1f}", ms(r["migrate_s"]),
                     ms(r["phases_s"]["transfer"]), f"{r['gbps']:.2f}", ms(r["recompute_s"]), ms(r["warm_s"]),
                     warm + ("" if not r["problems"] else " (!)"), f"{r['ratio']:.3f}",
                     f"{r['recompute_s'] / r['migrate_s']:.1f}"])
    body += [[model, str(tokens), *["-"] * 9, f"failed: {why.splitlines()[0][:60]}"]
             for (model, tokens), why in errors.items()]
    print_markdown(["model", "tokens", "blocks", "MiB moved", "migrate ms", "transfer ms", "GB/s",
                    "recompute ms", "warm TTFT ms", "warm cached", "(migrate+warm)/recompute", "recompute/migrate"],
                   body, left=2,
                   title="KV migration A -> B vs B recomputing the same number of tokens (median per column; "
                         "warm cached: the least cached_tokens of B's warm requests / tokens)")
    print_markdown(["model", "tokens", *(f"{p} ms" for p in PHASES), "total ms", "write ms", "write GB/s",
                    "source compute ms"],
                   [[r["model"], str(r["tokens"]), *(ms(r["phases_s"][p]) for p in PHASES), ms(r["migrate_s"]),
                     ms(r["write_s"]), f"{r['write_gbps']:.2f}", ms(r["source_compute_s"])] for r in rows],
                   left=2, title="Where a migration's time goes: the driver's phases (median, ms); write: the source's "
                                 "TransferEngine write within the transfer phase; source compute: A's TTFT computing "
                                 "the prompt")


def main() -> int:
    parser = arguments(__doc__, "migration")
    parser.add_argument("--models", default="tiny,medium")
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384", help="tokens per sequence, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gap", type=float, default=1.5,
                        help="idle seconds between steps (vLLM workers spin ~1 s after each step)")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds a server may take to start, or to answer one call")
    args = parser.parse_args()
    if args.quick:
        args.models, args.lengths, args.repeats, args.gap = "tiny", QUICK_LENGTHS, 1, 0.5
    lengths = [int(x) for x in args.lengths.split(",") if x]
    models = [m for m in args.models.split(",") if m]
    started = time.perf_counter()
    results, rows, errors = {}, [], {}
    for i, name in enumerate(models):
        try:
            results[name] = bench_model(name, lengths, 100_000 * (i + 1), args)
        except (RuntimeError, requests.RequestException) as exc:  # a server that would not start, a failed warm-up
            print(f"model {name}: FAILED: {exc}", file=sys.stderr, flush=True)
            results[name] = {"error": str(exc)}
            errors.update({(name, n): str(exc) for n in lengths})
            continue
        rows.extend(results[name]["rows"])
        errors.update({(name, n): why for n, why in results[name]["errors"].items()})
    print_tables(rows, errors)
    problems = [f"{r['model']} {r['tokens']}: {p}" for r in rows for p in r["problems"]]
    problems += [f"{model} {tokens}: {why}" for (model, tokens), why in errors.items()]
    write_results(args.json, "migration", started, repeats=args.repeats, gap=args.gap, models=results, rows=rows,
                  problems=problems)
    for p in problems:
        print(f"CHECK FAILED: {p}")
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
