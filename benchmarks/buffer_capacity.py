"""What the dynamic buffer is for, on one GPU: longer prompts and more prefill under a device-memory cap.

Three engines of one model (random weights, ``load_format="dummy"``), one after the other, each
alone on the device, graphs at vLLM's defaults (the buffer's engine runs piecewise: the connector
asks for it):

1. ``capped``: vLLM alone with ``--cap-gib`` of device KV (``kv_cache_memory_bytes``);
2. ``buffer``: AioConnector, ``transfer_mode: dynamic_buffer`` with ``--buffers`` S, the same cap: L/S
   times the blocks, every layer's KV in page-locked host memory. It runs as ``kv_consumer`` with
   an empty pool, so what it costs is the buffer's streaming alone, not the pool's saves;
3. ``bound``: vLLM alone with the memory the buffer emulates, L/S times the cap (or what the workload
   needs, where that is less: a concurrency's worth of the longest prompts).

Figures, side by side in one run:

(a) the longest prompt each engine can serve (capped: its KV in tokens; the buffer: L/S times that, up
    to the model's context), the buffer's TTFT on its longest against the bound's on the same prompt;
(b) prefill-node throughput: ``--requests`` prompts of each ``--prompt-tokens`` length sent together,
    ``--concurrency`` running at once, one output token: prompt tokens/s, requests/s, mean TTFT; the
    buffer against the bound (what the buffer costs) and the capped engine (what it gains);
(c) decode: one request of ``--decode-context`` tokens generating ``--decode-tokens``: the time per
    output token against the link floor (the context's KV over pinned host-to-device bandwidth,
    measured in this run), since every step streams every layer's context across the link.

    python3 -m benchmarks.buffer_capacity [--model-shape 8b] [--cap-gib 2] [--buffers 2]
        [--prompt-tokens 8192,16384,32768] [--concurrency 8] [--requests 16]

``--quick``: the tiny model on vLLM's CPU build, small sizes (a smoke test of the code path).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks._engine import (
    BLOCK_SIZE, ROOT, EngineFailed, EngineProc, Engines, exit_code, kv_bytes_per_token, make_prompts, thread_binding)
from benchmarks._report import arguments, print_markdown, write_results
from benchmarks.gpu_ttft import SHAPES, link_in_subprocess, versions

GiB = 1 << 30
SYSTEMS = ("capped", "buffer", "bound")


@dataclass(frozen=True)
class Sizes:
    """Token and byte sizes of one run, from the model's config and the options."""

    layers: int
    context: int  # the model's context length
    kv_per_token: int
    cap_bytes: int
    buffers: int
    prompts: tuple[int, ...]
    concurrency: int

    @property
    def cap_blocks(self) -> int:
        return self.cap_bytes // self.kv_per_token // BLOCK_SIZE

    @property
    def cap_tokens(self) -> int:
        """What the cap's blocks hold for one request (vLLM keeps one block back)."""
        return (self.cap_blocks - 1) * BLOCK_SIZE

    @property
    def buffer_tokens(self) -> int:
        """What the buffer's L/S times the blocks hold for one request, up to the model's context."""
        return min((self.cap_blocks * self.layers // self.buffers - 1) * BLOCK_SIZE, self.context)

    def longest(self, system: str) -> int:
        """The longest prompt the system serves (one output token after it)."""
        return (self.cap_tokens if system == "capped" else self.buffer_tokens) - 1

    def kv_bytes(self, system: str) -> int:
        if system != "bound":
            return self.cap_bytes
        need = (self.concurrency * max(self.prompts) + self.buffer_tokens) * self.kv_per_token
        return min(self.cap_bytes * self.layers // self.buffers, need)


def spec_of(system: str, sizes: Sizes, args: argparse.Namespace) -> tuple[dict | None, dict]:
    """The system's kv_transfer_config and engine settings."""
    config = None
    if system == "buffer":
        config = {"kv_connector": "AioConnector", "kv_connector_module_path": "vllm_aio.connector",
                  "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"transfer_mode": "dynamic_buffer",
                                                "dynamic_buffer_count": sizes.buffers,
                                                "local_pool_size": 64 << 20}}
    spec = {"load_format": "dummy", "dtype": "bfloat16", "kv_cache_memory_bytes": sizes.kv_bytes(system),
            "gpu_memory_utilization": args.gpu_share, "max_num_seqs": sizes.concurrency,
            "max_num_batched_tokens": args.max_num_batched_tokens, "enforce_eager": args.eager,
            "max_model_len": sizes.longest(system) + 1, "warmup_at_start": False}
    return config, spec


def run_system(engines: Engines, system: str, sizes: Sizes, args: argparse.Namespace) -> dict:
    """Every figure of one engine: (a), (b) at each length it serves, (c)."""
    config, spec = spec_of(system, sizes, args)
    engine = engines.start(system, config, **spec)
    out: dict = {"kv_bytes": spec["kv_cache_memory_bytes"], "max_model_len": spec["max_model_len"]}
    try:
        ready = engine.wait_ready(args.timeout)
        print(f"  {system}: ready after {ready['start_s']:.0f}s", flush=True)
        ask(engine, "warm-up", make_prompts(1, [64])[0], args, max_tokens=2)  # compiled graphs, first-request costs
        longest = sizes.buffer_tokens - 1
        if system != "capped":
            out["longest"] = ask(engine, "longest", make_prompts(2, [longest])[0], args)
        out["capped_longest"] = ask(engine, "capped-longest", make_prompts(3, [sizes.longest("capped")])[0], args)
        out["prefill"] = {}
        for n in sizes.prompts:
            if n < spec["max_model_len"]:
                prompts = make_prompts(100 + n, [n] * args.requests)
                out["prefill"][n] = ask(engine, f"prefill/{n}", prompts, args)
        if args.decode_context < spec["max_model_len"] - args.decode_tokens:
            prompt = make_prompts(4, [args.decode_context])[0]
            out["decode"] = ask(engine, "decode", prompt, args, max_tokens=args.decode_tokens)
        engines.close([engine])
    except EngineFailed as exc:
        print(f"\n!! {system}: {exc}\n", flush=True)
        engines.kill(engine)
        out["error"] = str(exc).splitlines()[0]
    return out


def ask(engine: EngineProc, label: str, prompt: list, args: argparse.Namespace, max_tokens: int = 1) -> dict:
    step = engine.request(label, prompt, args.timeout, max_tokens=max_tokens)
    print(f"    {engine.name} {label}: {step['prompt_len']} prompt tokens, TTFT {step['ttft_s'] * 1e3:.0f} ms, "
          f"wall {step['wall_s'] * 1e3:.0f} ms", flush=True)
    return step


# ---------------------------------------------------------------- tables

def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a and b else "-"


def longest_table(results: dict[str, dict], sizes: Sizes) -> list[list[str]]:
    bound = results["bound"].get("longest", {}).get("ttft_s")
    rows = []
    for system in SYSTEMS:
        r = results[system]
        step = r.get("longest") if system != "capped" else r.get("capped_longest")
        ttft = step["ttft_s"] if step else None
        rows.append([system, f"{r['kv_bytes'] / GiB:.2f}", str(sizes.longest(system)),
                     f"{sizes.longest(system) / sizes.longest('capped'):.1f}",
                     "FAIL" if "error" in r else f"{ttft * 1e3:.0f}" if ttft else "-",
                     ratio(ttft, bound) if system == "buffer" else "-"])
    return rows


def prefill_table(results: dict[str, dict], sizes: Sizes, requests: int) -> list[list[str]]:
    rows = []
    for n in sizes.prompts:
        cells = {s: results[s].get("prefill", {}).get(n) for s in SYSTEMS}
        rate = {s: c["prompt_len"] / c["wall_s"] for s, c in cells.items() if c}
        for s, c in cells.items():
            if c is None:
                rows.append([str(n), s, "FAIL" if "error" in results[s] else "too long", "-", "-", "-", "-"])
                continue
            rows.append([str(n), s, f"{rate[s]:.0f}", f"{requests / c['wall_s']:.2f}",
                         f"{c['ttft_mean_s'] * 1e3:.0f}", ratio(rate[s], rate.get("bound")),
                         ratio(rate[s], rate.get("capped"))])
    return rows


def decode_table(results: dict[str, dict], sizes: Sizes, h2d_GBps: float, args: argparse.Namespace) -> list[list[str]]:
    floor_ms = args.decode_context * sizes.kv_per_token / (h2d_GBps * 1e9) * 1e3
    rows = []
    for s in SYSTEMS:
        step = results[s].get("decode")
        if step is None:
            rows.append([s, "-", f"{floor_ms:.2f}", "-"])
            continue
        per_token = (step["wall_s"] - step["ttft_s"]) / (args.decode_tokens - 1) * 1e3
        rows.append([s, f"{per_token:.2f}", f"{floor_ms:.2f}", f"{per_token / floor_ms:.2f}"])
    return rows


# ---------------------------------------------------------------- the run

def options() -> argparse.Namespace:
    parser = arguments(__doc__, "buffer_capacity")
    parser.add_argument("--model-shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--cap-gib", type=float, default=2.0, help="device KV of the capped and buffer engines")
    parser.add_argument("--buffers", type=int, default=2, help="the buffer's dynamic_buffer_count (S)")
    parser.add_argument("--prompt-tokens", default="8192,16384,32768", help="prefill lengths of (b)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests running at once (max_num_seqs)")
    parser.add_argument("--requests", type=int, default=16, help="prompts of each length in (b)")
    parser.add_argument("--decode-context", type=int, default=16384, help="the prompt of (c)")
    parser.add_argument("--decode-tokens", type=int, default=65, help="tokens generated in (c)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-share", type=float, default=0.9, help="vLLM's gpu_memory_utilization")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.model_shape, args.cap_gib, args.prompt_tokens = "tiny", 0.0, "256,512"
        args.concurrency, args.requests, args.decode_context, args.decode_tokens = 2, 4, 256, 5
        args.max_num_batched_tokens, args.timeout = 512, min(args.timeout, 300)
    return args


def main() -> int:
    args = options()
    from vllm_aio.devtools.tiny_model import PRESETS, ensure_model

    started = time.perf_counter()
    preset = SHAPES[args.model_shape]
    model_dir = ensure_model(ROOT / "models" / preset, PRESETS[preset])
    cfg = json.loads((model_dir / "config.json").read_text())
    kv_per_token = kv_bytes_per_token(model_dir)
    cap = int(args.cap_gib * GiB) or 16 * BLOCK_SIZE * kv_per_token  # --quick: 16 blocks
    sizes = Sizes(cfg["num_hidden_layers"], cfg["max_position_embeddings"], kv_per_token, cap, args.buffers,
                  tuple(int(x) for x in args.prompt_tokens.split(",") if x), args.concurrency)
    info = versions()
    print(f"command: {Path(sys.executable).name} -m benchmarks.buffer_capacity {' '.join(sys.argv[1:])}")
    print(f"versions: python {info['python']}, vLLM {info['vllm']}, vllm_aio {info['vllm_aio']}", flush=True)
    link = link_in_subprocess([args.decode_context * kv_per_token])
    h2d = link["copies"][args.decode_context * kv_per_token]["h2d_GBps"]
    args.eager = link["device_type"] == "cpu"
    print(f"device: {link['device']}; pinned H2D {h2d:.1f} GB/s; model {preset}: {sizes.layers} layers, "
          f"{kv_per_token} KV bytes/token; cap {cap / GiB:.2f} GiB = {sizes.cap_tokens} tokens", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"} | thread_binding()
    workdir = Path(tempfile.mkdtemp(prefix="vllm_aio_buffer_capacity_"))
    engines = Engines(model_dir, workdir, sizes.buffer_tokens, args.timeout, env)
    try:
        results = {s: run_system(engines, s, sizes, args) for s in SYSTEMS}
    finally:
        engines.kill_all()
        if args.keep_logs:
            print(f"kept engine logs in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    title = f"on {link['device']}, {preset} (random weights), S={args.buffers}, cap {cap / GiB:.2f} GiB of device KV"
    print_markdown(["system", "device KV GiB", "longest prompt", "x capped", "its TTFT ms", "/ bound's"],
                   longest_table(results, sizes), left=1,
                   title=f"(a) The longest prompt served, {title}; TTFT of the buffer's longest (capped: its own)")
    print_markdown(["prompt tokens", "system", "prompt tok/s", "req/s", "mean TTFT ms", "/ bound", "/ capped"],
                   prefill_table(results, sizes, args.requests), left=2,
                   title=f"(b) Prefill node: {args.requests} prompts at once, {args.concurrency} running, "
                         "one token each")
    print_markdown(["system", "ms / output token", "link floor ms", "x floor"], decode_table(results, sizes, h2d, args),
                   left=1, title=f"(c) Decode over a {args.decode_context}-token context: its KV over pinned H2D "
                                 f"({h2d:.1f} GB/s) is the floor of a streamed step")
    problems = [f"{s}: {r['error']}" for s, r in results.items() if "error" in r]
    write_results(args.json, "buffer_capacity", started, versions={**info, "torch": link["torch"]},
                  device=link["device"], h2d_GBps=h2d, sizes=asdict(sizes), results=results, problems=problems)
    return exit_code(problems)


if __name__ == "__main__":
    sys.exit(main())
