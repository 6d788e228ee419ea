"""Pool hit rates by request priority: retention classes against plain LRU, under mixed traffic.

Rounds of 1 high-priority and 4 low-priority requests run through a real vLLM
engine (CPU build, ``--scheduling-policy priority``, vLLM's own prefix cache
off so every cached token is a pool hit). High-priority requests reuse 4
prefixes, low-priority ones 16; every prefix is 32 blocks, and the pool holds
about half of the 640 blocks they make, so it must evict all along. Each
system runs in a fresh engine with a fresh pool:

* ``lru``: no ``priority_cutoffs``: one class, least recently used evicted first;
* ``priority``: ``priority_cutoffs: [0]``: the high-priority requests' blocks
  (vLLM priority 0) are class 1, evicted only when no class-0 block is left
  (embedded pool) or soft-pinned (``--backend mooncake``: a real
  ``mooncake_master`` and memory owner on loopback, one per system);
* Mooncake only: ``priority, pins kept`` (the master never evicts soft-pinned
  values) and ``priority, pins kept, eviction headroom`` (its eviction also
  starts earlier and frees more: see ``MOONCAKE_SYSTEMS``).

The hit rate of a request is the share of its prefix that came from the pool,
counted only for requests whose prefix an earlier round stored (the first
sight of a prefix cannot hit); the table gives it per priority, token
weighted.

    .venv/bin/python -m benchmarks.priority [--backend local|mooncake] [--quick]
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._engine import BLOCK_SIZE, ROOT, value_bytes
from benchmarks._report import arguments, print_markdown, write_results

HIGH, LOW = 0, 1  # vLLM priorities: lower is more important
PREFIX_BLOCKS = 32
HIGH_PREFIXES, LOW_PREFIXES = 4, 16
SUFFIX_TOKENS = 16  # a partial block: never stored, makes every prompt unique
# system -> (priority_cutoffs, mooncake_master flags)
SYSTEMS = {"lru": ([], ()), "priority": ([HIGH], ())}
# Mooncake's master may evict soft-pinned values once nothing else is left
# (its default); these never do. The master evicts only once its segments are
# --eviction_high_watermark_ratio full (0.9), and then --eviction_ratio of them
# (0.05): a put arriving meanwhile is refused for space whatever its class, so a
# high-priority prefix could take several sightings to be stored at all. With
# eviction starting at 70% and freeing 20%, puts find room.
PINS_KEPT = ("--allow_evict_soft_pinned_objects=false",)
HEADROOM = ("--eviction_high_watermark_ratio=0.7", "--eviction_ratio=0.2")
MOONCAKE_SYSTEMS = {"priority, pins kept": ([HIGH], PINS_KEPT),
                    "priority, pins kept, eviction headroom": ([HIGH], PINS_KEPT + HEADROOM)}


def traffic(rounds: int, seed: int = 5) -> list[list[tuple[int, str, int]]]:
    """Per round: (priority, prefix name, suffix seed) of 1 high and 4 low requests."""
    rng = random.Random(seed)
    return [[(HIGH, f"h{r % HIGH_PREFIXES}", rng.random())]
            + [(LOW, f"l{rng.randrange(LOW_PREFIXES)}", rng.random()) for _ in range(4)] for r in range(rounds)]


def prompt(prefix: str, suffix_seed: float) -> list[int]:
    head = random.Random(prefix)
    tail = random.Random(suffix_seed)
    return ([head.randrange(3, 2048) for _ in range(PREFIX_BLOCKS * BLOCK_SIZE)]
            + [tail.randrange(3, 2048) for _ in range(SUFFIX_TOKENS)])


# ---------------------------------------------------------------- one engine (a process of its own)

def run_engine(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(spec["model"], max_model_len=2048, block_size=BLOCK_SIZE, enforce_eager=True,
              enable_prefix_caching=False, max_num_seqs=8, scheduling_policy="priority",
              distributed_executor_backend="mp",
              kv_transfer_config=spec["kv_transfer_config"], disable_log_stats=False, seed=0)
    params = SamplingParams(max_tokens=1, temperature=0)
    seen: set[str] = set()
    rows = []
    for batch in spec["rounds"]:
        prompts = [TokensPrompt(prompt_token_ids=prompt(name, s)) for _, name, s in batch]
        outputs = llm.generate(prompts, params, priority=[p for p, _, _ in batch], use_tqdm=False)
        for (priority, name, _), out in zip(batch, outputs):
            rows.append({"priority": priority, "warm": name in seen,
                         "hit": min(out.num_cached_tokens, PREFIX_BLOCKS * BLOCK_SIZE)})
        seen |= {name for _, name, _ in batch}
    counters = {m.name[len("vllm:aio_"):]: m.value for m in llm.get_metrics() if m.name.startswith("vllm:aio_")}
    return {"rows": rows, "counters": counters}


# ---------------------------------------------------------------- the driver

def kv_config(backend: str, pool_bytes: int, cutoffs: list[int], pool) -> dict:
    extra: dict = {"priority_cutoffs": cutoffs}
    if backend == "local":
        extra["local_pool_size"] = pool_bytes
    else:
        extra.update(backend="mooncake", **pool.config)
    return {"kv_connector": "AioConnector", "kv_connector_module_path": "vllm_aio.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def run_system(model: Path, backend: str, pool_bytes: int, cutoffs: list[int], master_args: tuple[str, ...],
               rounds: list) -> dict:
    from vllm_aio.devtools.mooncake_pool import MooncakePool

    pool = MooncakePool(pool_bytes, master_args=master_args).start() if backend == "mooncake" else None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
            spec_path.write_text(json.dumps({"model": str(model), "rounds": rounds,
                                             "kv_transfer_config": kv_config(backend, pool_bytes, cutoffs, pool)}))
            env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "PYTHONPATH": str(ROOT)}
            engine = [sys.executable, "-m", "benchmarks.priority", "--engine", str(spec_path), str(out_path)]
            done = subprocess.run(engine, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if done.returncode:
                raise RuntimeError(f"engine failed:\n{done.stdout[-12000:]}")
            return json.loads(out_path.read_text())
    finally:
        if pool is not None:
            pool.stop()


def hit_rate(rows: list[dict], priority: int) -> tuple[float, int]:
    warm = [r for r in rows if r["priority"] == priority and r["warm"]]
    return sum(r["hit"] for r in warm) / (len(warm) * PREFIX_BLOCKS * BLOCK_SIZE), len(warm)


def main() -> int:
    if sys.argv[1:2] == ["--engine"]:
        spec_path, out_path = sys.argv[2:4]
        Path(out_path).write_text(json.dumps(run_engine(json.loads(Path(spec_path).read_text()))))
        return 0
    parser = arguments(__doc__, "priority")
    parser.add_argument("--backend", choices=("local", "mooncake"), default="local")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny")
    args = parser.parse_args()
    started = time.perf_counter()
    rounds = traffic(8 if args.quick else args.rounds)
    working_set = (HIGH_PREFIXES + LOW_PREFIXES) * PREFIX_BLOCKS * value_bytes(args.model)
    pool_bytes = max(working_set // 2, 16 << 20)  # mooncake_client's minimum: 16 MB
    print(f"{len(rounds) * 5} requests, working set {working_set / 2**20:.1f} MiB, "
          f"pool {pool_bytes / 2**20:.1f} MiB ({pool_bytes / working_set:.0%}), backend {args.backend}")
    results, body = {}, []
    systems = {**SYSTEMS, **(MOONCAKE_SYSTEMS if args.backend == "mooncake" else {})}
    for system, (cutoffs, master_args) in systems.items():
        results[system] = run_system(args.model, args.backend, pool_bytes, cutoffs, master_args, rounds)
        (high, n_high), (low, n_low) = (hit_rate(results[system]["rows"], p) for p in (HIGH, LOW))
        counters = results[system]["counters"]
        body.append([system, f"{high:.1%} ({n_high})", f"{low:.1%} ({n_low})",
                     *(f"{counters.get(name, 0):.0f}" for name in ("save_failures", "load_failures"))])
    print_markdown(["system", "high-priority hit rate (requests)", "low-priority hit rate (requests)",
                    "save failures", "load failures"], body, left=1,
                   title=f"Pool hit rate by priority ({args.backend})")
    write_results(args.json, "priority", started,
                  backend=args.backend, pool_bytes=pool_bytes, working_set=working_set, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
