"""Warm-request TTFT in a FRESH engine: recompute vs ExampleConnector vs vllm_aio vs prefix cache.

For each model and prompt length, the same random token-id prompt is measured by:

* ``recompute``: no connector; the fresh engine never saw the prompt.
* ``ExampleConnector``: vLLM's in-tree disk connector. Engine A computes (stores)
  the prompts and exits; a fresh engine B measures.
* ``vllm_aio``: ``AioConnector`` on the embedded pool, shared by name across the
  two engines. This process attaches to the pool first and holds it, so it
  outlives engine A. Engine A computes (stores) and exits; fresh engine B measures.
* ``prefix-cache``: no connector, vLLM's own prefix caching; the same engine
  computes the prompt, then repeats it (the floor for any external store).

vLLM's prefix caching is OFF in every engine but the last, so every cached
token of a warm request came from the connector. Each request runs alone with
``max_tokens=1`` after an unrelated short warm-up request; TTFT is vLLM's own
first-token latency (``RequestOutput.metrics.first_token_latency``); the median
over ``--repeats`` (x ``--rounds`` fresh engines) is reported.

Every engine runs in a subprocess (``benchmarks/_engine.py``) with the same
pinned environment (``VLLM_CPU_OMP_THREADS_BIND``, ``PYTHONHASHSEED=0``).

    .venv/bin/python benchmarks/ttft.py --models tiny,medium --lengths 1024,2048,4096 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).resolve().parent / "_engine.py"
RESULTS = Path(__file__).resolve().parent / "results" / "ttft.json"
sys.path.insert(0, str(ROOT))

BLOCK_SIZE = 32
POOL_SIZE = "4GB"
SYSTEMS = ("recompute", "ExampleConnector", "vllm_aio", "prefix-cache")
# Per model: KV cache space of each engine (GiB) and max_model_len.
MODEL_SETTINGS = {
    "tiny": {"kv_gib": 1, "max_model_len": 8192},
    "medium": {"kv_gib": 3, "max_model_len": 8192},
}
MIN_HIT = 0.8  # warm requests must have at least this share of their prompt cached


class EngineFailed(RuntimeError):
    pass


def make_prompts(seed: int, lengths: list[int], vocab: int = 2048) -> list[list[int]]:
    """Random token-id prompts (ids 3.. skip the special tokens); as tests/conftest.py."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def slot_bytes(model_dir: Path) -> int:
    """One pool value: one block of every layer (bf16, block size 32)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    page = 2 * cfg["num_key_value_heads"] * head_dim * BLOCK_SIZE * 2
    return cfg["num_hidden_layers"] * page


class Runner:
    """Starts engines (one subprocess each) with one pinned environment."""

    def __init__(self, model_dir: Path, workdir: Path, kv_gib: int, max_model_len: int,
                 timeout: float) -> None:
        self.model_dir, self.workdir = model_dir, workdir
        self.kv_gib, self.max_model_len, self.timeout = kv_gib, max_model_len, timeout
        self._warmups = 0

    def warmup_prompt(self) -> list[int]:
        # Distinct per engine: a warm-up stored by engine A must not hit in engine B.
        self._warmups += 1
        return make_prompts(10_000 + self._warmups, [64])[0]

    def run(self, name: str, steps: list[dict], kv_transfer_config: dict | None = None,
            prefix_caching: bool = False) -> dict:
        spec = {
            "model": str(self.model_dir),
            "max_model_len": self.max_model_len,
            "enable_prefix_caching": prefix_caching,
            "kv_transfer_config": kv_transfer_config,
            "steps": [{"label": "warmup", "prompt": self.warmup_prompt()}, *steps],
        }
        tag = f"{name}-{uuid.uuid4().hex[:6]}"
        spec_path = self.workdir / f"{tag}.json"
        result_path = self.workdir / f"{tag}.out.json"
        log_path = self.workdir / f"{tag}.log"
        spec_path.write_text(json.dumps(spec))
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_gib),
            "PYTHONHASHSEED": "0",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
            "PYTHONPATH": str(ROOT),
        }
        start = time.perf_counter()
        print(f"  engine {name} ...", end="", flush=True)
        try:
            with open(log_path, "w") as log:
                proc = subprocess.run([sys.executable, str(RUNNER), str(spec_path), str(result_path)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=self.timeout, cwd=ROOT)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {self.timeout:.0f}s"
        elapsed = time.perf_counter() - start
        text = log_path.read_text(errors="replace")
        if rc != 0 or not result_path.exists():
            print(" FAILED")
            raise EngineFailed(f"engine {name} failed (exit {rc}); log tail ({log_path}):\n{text[-6000:]}")
        result = json.loads(result_path.read_text())
        result["elapsed_s"] = elapsed
        result["log_tail"] = [l for l in text.splitlines() if "vllm_aio" in l or "KV Transfer" in l][-20:]
        print(f" {elapsed:.0f}s (init {result['init_s']:.0f}s)", flush=True)
        return result


def aio_config(pool_name: str) -> dict:
    return {
        "kv_connector": "AioConnector",
        "kv_connector_module_path": "vllm_aio.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"local_pool_name": pool_name, "local_pool_size": POOL_SIZE},
    }


def example_config(path: Path) -> dict:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def bench_model(name: str, lengths: list[int], repeats: int, rounds: int, timeout: float,
                keep: bool = False) -> dict:
    from vllm_aio.devtools.tiny_model import PRESETS, ensure_model
    from vllm_aio.pool.host_pool import SharedHostPool, slots_for
    from vllm_aio.config import parse_size

    settings = MODEL_SETTINGS.get(name, MODEL_SETTINGS["medium"])
    max_len = max(settings["max_model_len"], max(lengths) + 512)
    model_dir = ensure_model(ROOT / "models" / name, PRESETS[name])
    prompts = dict(zip(lengths, make_prompts(1000, lengths)))  # distinct prompt per length
    slot = slot_bytes(model_dir)
    workdir = Path(tempfile.mkdtemp(prefix=f"vllm_aio_ttft_{name}_"))
    pool_name = f"bench-ttft-{uuid.uuid4().hex[:12]}"
    print(f"model {name}: {model_dir} (pool value {slot} bytes, workdir {workdir})", flush=True)
    runner = Runner(model_dir, workdir, settings["kv_gib"], max_len, timeout)
    holder = SharedHostPool(pool_name, slot, slots_for(parse_size("local_pool_size", POOL_SIZE), slot))
    samples: dict[str, dict[int, list[dict]]] = {s: {n: [] for n in lengths} for s in SYSTEMS}
    cold: dict[str, dict[int, dict]] = {}
    engines: list[dict] = []
    try:
        storage = workdir / "example_storage"
        storage.mkdir()
        configs = {"ExampleConnector": example_config(storage), "vllm_aio": aio_config(pool_name)}
        store_steps = [{"label": f"store/{n}", "prompt": prompts[n]} for n in lengths]
        # Engine A of each connector: compute (and store) every prompt once, then exit.
        for system in ("ExampleConnector", "vllm_aio"):
            res = runner.run(f"{system}-A", store_steps, configs[system])
            engines.append({"engine": f"{system}-A", "init_s": res["init_s"], "elapsed_s": res["elapsed_s"]})
            cold[system] = {s["prompt_len"]: s for s in res["steps"][1:]}
        usage = holder.usage()
        print(f"  pool after engine A: {usage.num_ready} blocks ({usage.bytes_used / 2**20:.0f} MiB)")
        measure = [{"label": f"warm/{n}/r{r}", "prompt": prompts[n]} for r in range(repeats) for n in lengths]
        for rnd in range(rounds):
            order = SYSTEMS if rnd % 2 == 0 else tuple(reversed(SYSTEMS))
            for system in order:
                steps = measure
                if system == "prefix-cache":  # compute once in this engine, then the hits
                    steps = [{"label": f"fill/{n}", "prompt": prompts[n]} for n in lengths] + measure
                res = runner.run(f"{system}-B{rnd}", steps, configs.get(system),
                                 prefix_caching=system == "prefix-cache")
                engines.append({"engine": f"{system}-B{rnd}", "init_s": res["init_s"],
                                "elapsed_s": res["elapsed_s"], "connector_log": res["log_tail"]})
                for s in res["steps"]:
                    if s["label"].startswith("warm/"):
                        samples[system][s["prompt_len"]].append(s)
                    elif s["label"].startswith("fill/"):
                        cold.setdefault("prefix-cache", {})[s["prompt_len"]] = s
    finally:
        holder.close()
        if keep:
            shutil.rmtree(workdir / "example_storage", ignore_errors=True)
            print(f"  kept engine logs in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    rows = []
    for n in lengths:
        row = {"model": name, "prompt_tokens": n}
        for system in SYSTEMS:
            ss = samples[system][n]
            row[system] = {
                "ttft_s": statistics.median(s["ttft_s"] for s in ss),
                "wall_s": statistics.median(s["wall_s"] for s in ss),
                "engine_s": statistics.median(s["engine_s"] for s in ss),
                "cached_min": min(s["cached"] for s in ss),
                "cached_max": max(s["cached"] for s in ss),
                "samples_ttft_s": [s["ttft_s"] for s in ss],
            }
        for system, per_len in cold.items():
            row[system]["cold_ttft_s"] = per_len[n]["ttft_s"]
        rows.append(row)
    return {"rows": rows, "engines": engines, "pool_value_bytes": slot}


def check_hits(row: dict) -> list[str]:
    n, bad = row["prompt_tokens"], []
    if row["recompute"]["cached_max"] != 0:
        bad.append(f"recompute cached {row['recompute']['cached_max']} tokens (want 0)")
    for system in SYSTEMS[1:]:
        if row[system]["cached_min"] < MIN_HIT * n:
            bad.append(f"{system} cached only {row[system]['cached_min']}/{n} tokens (want >= {MIN_HIT:.0%})")
    return bad


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def print_tables(rows: list[dict]) -> None:
    head = ("model", "tokens", "recompute ms", "Example ms", "vllm_aio ms", "prefix ms",
            "aio/Example", "aio/prefix", "aio/recomp")
    goal = ("", "", "", "", "", "", "(<= 0.5)", "(<= 2.0)", "")
    table = [head, goal]
    for r in rows:
        aio = r["vllm_aio"]["ttft_s"]
        table.append((
            r["model"], str(r["prompt_tokens"]),
            fmt_ms(r["recompute"]["ttft_s"]), fmt_ms(r["ExampleConnector"]["ttft_s"]),
            fmt_ms(aio), fmt_ms(r["prefix-cache"]["ttft_s"]),
            f"{aio / r['ExampleConnector']['ttft_s']:.2f}", f"{aio / r['prefix-cache']['ttft_s']:.2f}",
            f"{aio / r['recompute']['ttft_s']:.3f}",
        ))
    _print(table, "Warm-request TTFT in a fresh engine (median; ms)")
    cached = [("model", "tokens", "recompute", "Example", "vllm_aio", "prefix")]
    for r in rows:
        cached.append((r["model"], str(r["prompt_tokens"]),
                       *(f"{r[s]['cached_min']}" for s in SYSTEMS)))
    _print(cached, "num_cached_tokens of the warm requests (min over samples)")
    cold = [("model", "tokens", "recompute ms", "Example store ms", "vllm_aio store ms")]
    for r in rows:
        cold.append((r["model"], str(r["prompt_tokens"]), fmt_ms(r["recompute"]["ttft_s"]),
                     fmt_ms(r["ExampleConnector"]["cold_ttft_s"]), fmt_ms(r["vllm_aio"]["cold_ttft_s"])))
    _print(cold, "Cold request with save, engine A (one sample each; recompute = median, no save)")


def _print(table: list[tuple], title: str) -> None:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    print(f"\n{title}")
    for i, row in enumerate(table):
        print("  ".join(c.rjust(w) if j > 1 else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,medium")
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1,
                        help="fresh measuring engines per system (order alternates per round)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per engine")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--keep-logs", action="store_true", help="keep the engines' specs and logs")
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    lengths = [int(x) for x in args.lengths.split(",") if x]
    started = time.perf_counter()
    out = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "argv": sys.argv,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "repeats": args.repeats, "rounds": args.rounds, "models": {},
    }
    rows = []
    try:
        for name in models:
            res = bench_model(name, lengths, args.repeats, args.rounds, args.timeout, args.keep_logs)
            out["models"][name] = res
            rows.extend(res["rows"])
    except EngineFailed as exc:
        print(f"\n{exc}", file=sys.stderr)
        return 1
    out["elapsed_s"] = time.perf_counter() - started
    out["rows"] = rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print_tables(rows)
    problems = [f"{r['model']} {r['prompt_tokens']}: {p}" for r in rows for p in check_hits(r)]
    for p in problems:
        print(f"HIT CHECK FAILED: {p}")
    print(f"\nwrote {args.out} ({out['elapsed_s']:.0f}s)")
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
