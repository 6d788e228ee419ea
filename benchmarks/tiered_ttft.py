"""Warm-request TTFT in a FRESH engine on the tiered store: local-tier hit vs remote-tier hit vs recompute.

One Mooncake pool on loopback (``MooncakePool``) and one named embedded pool
(this host's local tier, held by this process so it outlives engine A). Engine
A (``backend: tiered``, write-through) computes every prompt once, storing it
in both tiers. Then fresh engines, alive at once, time the same prompts:

* ``recompute``: no connector; it never saw the prompts.
* ``local_tier``: the tiered store on A's local pool (another instance on A's
  host): every hit from the local tier.
* ``remote_tier``: the tiered store with a local pool of its own (an instance
  on another node): every hit from the remote tier (each sample is a prompt
  it has not loaded before, since a remote hit is promoted into its local tier).
* ``embedded``: ``backend: local`` on A's local pool, the same values through
  the direct path (pool slots <-> KV cache), which the tiered store does not
  offer (``backends/tiered.py``): what that costs a local-tier hit.

Each sample is a prompt of its own (``--repeats`` per length), stored by A;
requests run alone with ``max_tokens=1``, interleaved one at a time in a
rotating order, ``--gap`` seconds apart. vLLM's prefix caching is off
everywhere. TTFT is vLLM's own first-token latency; median of ``--repeats``.
Engines are ``benchmarks/_engine.py`` subprocesses (checked as in
``benchmarks/ttft.py``, ``failed_hit_tokens`` included); the run also fails
when the local-tier engine loaded anything from the remote tier or the
remote-tier engine nothing from it.

    .venv/bin/python -m benchmarks.tiered_ttft --models tiny,medium --lengths 1024,2048,4096 --repeats 3

``--quick``: the tiny model, one 256-token prompt, the two tiers only.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks._engine import (
    BLOCK_SIZE, ROOT, EngineFailed, Engines, check_hits, check_loads, chosen, engine_arguments, exit_code,
    make_prompts, summarize, thread_binding, value_bytes)
from benchmarks._report import arguments, print_markdown, write_results
from benchmarks.mooncake_ttft import SCRUB_ENV, settle

SYSTEMS = ("recompute", "local_tier", "remote_tier", "embedded")
HITTING = SYSTEMS[1:]
KV_GIB = 1


def kv_config(extra: dict) -> dict:
    return {"kv_connector": "AioConnector", "kv_connector_module_path": "vllm_aio.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def configs(pool_config: dict, node_a: str, node_b: str, pool_size: str) -> dict[str, dict | None]:
    """Per engine: its kv_transfer_config (``A`` stores; the others measure)."""
    def tiered(node: str, write: str) -> dict:
        return kv_config({"backend": "tiered", "remote_backend": "mooncake", **pool_config,
                          "local_pool_name": node, "local_pool_size": pool_size, "remote_write": write})

    return {"A": tiered(node_a, "through"), "recompute": None, "local_tier": tiered(node_a, "background"),
            "remote_tier": tiered(node_b, "background"),
            "embedded": kv_config({"local_pool_name": node_a, "local_pool_size": pool_size})}


def run_model(name: str, args, lengths: list[int], systems: list[str], workdir: Path) -> dict:
    from vllm_aio.backends.local import LocalBackend
    from vllm_aio.config import parse_size
    from vllm_aio.devtools.mooncake_pool import MooncakePool
    from vllm_aio.devtools.tiny_model import PRESETS, ensure_model

    model_dir = ensure_model(ROOT / "models" / name, PRESETS[name])
    value = value_bytes(model_dir)
    env = {k: v for k, v in os.environ.items() if k not in SCRUB_ENV}
    env.update(VLLM_CPU_KVCACHE_SPACE=str(KV_GIB), **thread_binding())
    engines = Engines(model_dir, workdir / name, max(8192, max(lengths) + 512), args.timeout, env, seed=30_000)
    engines.workdir.mkdir(parents=True)
    # One prompt per sample: the remote-tier engine promotes what it loads, so a prompt loads remotely once.
    prompts = {(n, r): p for r in range(args.repeats)
               for n, p in zip(lengths, make_prompts(3000 + 17 * r, lengths))}
    node_a, node_b = (f"bench-tiered-{tag}-{uuid.uuid4().hex[:8]}" for tag in "ab")
    samples = {s: {n: [] for n in lengths} for s in systems}
    cold: dict[int, dict] = {}
    with MooncakePool(args.pool_size, log_dir=engines.workdir / "mooncake") as pool:
        kv = configs(pool.config, node_a, node_b, args.pool_size)
        # The local tier outlives engine A because this process holds it (opened as the engines open it).
        holder = LocalBackend(node_a, parse_size("local_pool_size", args.pool_size), value, seal=False, shared=True)
        try:
            print(f"model {name}: pool {pool.master_address}, local tier {node_a}; logs in {engines.workdir}",
                  flush=True)
            # Every engine warms up on one prompt that A stores: a measuring engine's first load from
            # a tier (the transfer engine's first connection to the memory owner) is not a sample.
            warmup = make_prompts(31_000, [64])[0]
            a = engines.start("A", kv["A"], warmup=warmup)
            engines.wait_ready([a])
            for (n, r), prompt in prompts.items():
                cold[n] = a.request(f"store/{n}/r{r}", prompt, args.timeout)
            expected = sum(len(p) // BLOCK_SIZE for p in prompts.values()) + 64 // BLOCK_SIZE  # + A's warm-up
            after_a = settle({"remote": pool}, expected, args.settle)
            print(f"  remote tier after engine A: {after_a}", flush=True)
            engines.close([a])
            b = {s: engines.start(s, kv[s], warmup=warmup) for s in systems}
            engines.wait_ready(list(b.values()))
            turn = 0
            for r in range(args.repeats):
                for n in lengths:
                    order = systems[turn % len(systems):] + systems[:turn % len(systems)]
                    turn += 1
                    for s in order:
                        samples[s][n].append(b[s].request(f"warm/{n}/r{r}/{s}", prompts[(n, r)], args.timeout))
                        time.sleep(args.gap)
            engines.close(list(b.values()))
        except BaseException:
            engines.kill_all()
            raise
        finally:
            holder.close()
    rows = [{"model": name, "prompt_tokens": n, **{s: summarize(samples[s][n], cold.get(n)) for s in systems}}
            for n in lengths]
    return {"model": name, "rows": rows, "engines": engines.info, "value_bytes": value, "remote_after_A": after_a,
            "configs": {s: kv[s] for s in ["A", *systems]}}


def tier_problems(info: list[dict]) -> list[str]:
    """The local-tier engine must load nothing remotely, the remote-tier engine something."""
    counters = {e["engine"]: e["aio"] or {} for e in info}
    bad = []
    if counters.get("local_tier", {}).get("remote_tier_hits"):
        bad.append(f"local_tier loaded {counters['local_tier']['remote_tier_hits']:g} values from the remote tier")
    if "remote_tier" in counters and not counters["remote_tier"].get("remote_tier_hits"):
        bad.append("remote_tier loaded nothing from the remote tier")
    return bad


def print_tables(rows: list[dict], systems: list[str]) -> None:
    def ms(r: dict, s: str, key: str = "ttft_s") -> str:
        return "-" if s not in r else f"{r[s][key] * 1e3:.1f}"

    def ratio(r: dict, a: str, b: str) -> str:
        return "-" if a not in r or b not in r else f"{r[a]['ttft_s'] / r[b]['ttft_s']:.2f}"

    head = ["model", "tokens", *(f"{s} ms" for s in SYSTEMS), "remote/local", "local/embedded"]
    print_markdown(head, [[r["model"], str(r["prompt_tokens"]), *(ms(r, s) for s in SYSTEMS),
                           ratio(r, "remote_tier", "local_tier"), ratio(r, "local_tier", "embedded")] for r in rows],
                   left=2, title="Warm-request TTFT in a fresh engine, tiered store (median; ms)")
    print_markdown(["model", "tokens", *(f"{s} ms" for s in SYSTEMS)],
                   [[r["model"], str(r["prompt_tokens"]), *(ms(r, s, "ttft_min_s") for s in SYSTEMS)] for r in rows],
                   left=2, title="Same, minimum over samples (ms)")
    print_markdown(["model", "tokens", *SYSTEMS],
                   [[r["model"], str(r["prompt_tokens"]),
                     *("-" if s not in r else str(r[s]["cached_min"]) for s in SYSTEMS)] for r in rows],
                   left=2, title="num_cached_tokens of the warm requests (min over samples)")


def main() -> int:
    parser = arguments(__doc__, "tiered_ttft")
    parser.add_argument("--models", default="tiny")
    parser.add_argument("--pool-size", default="2GB", help="memory of the Mooncake pool and of each local tier")
    parser.add_argument("--settle", type=float, default=180,
                        help="seconds engine A's writes may take to land in the remote tier")
    engine_arguments(parser, SYSTEMS)
    args = parser.parse_args()
    if args.quick:
        args.models, args.pool_size, args.systems = "tiny", "256MB", args.systems or "local_tier,remote_tier"
    lengths, systems = chosen(args, SYSTEMS)
    workdir = Path(tempfile.mkdtemp(prefix="vllm_aio_tiered_ttft_"))
    started = time.perf_counter()
    runs, rows = [], []
    try:
        for name in args.models.split(","):
            try:
                runs.append(run_model(name, args, lengths, systems, workdir))
            except EngineFailed as exc:
                print(f"\n!! model {name}: {exc}\n", flush=True)
                runs.append({"model": name, "error": str(exc), "rows": [], "engines": []})
            rows.extend(runs[-1]["rows"])
            write_results(args.json, "tiered_ttft", started, repeats=args.repeats, systems=systems, runs=runs,
                          rows=rows)
    finally:
        if args.keep_logs:
            print(f"kept logs in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print_tables(rows, systems)
    problems = [f"{r['model']} {r['prompt_tokens']}: {p}" for r in rows
                for p in check_hits(r, [s for s in HITTING if s in systems])]
    for run in runs:
        problems += [f"model {run['model']}: {p}"
                     for p in check_loads(run["engines"]) + tier_problems(run["engines"])]
        if "error" in run:
            problems.append(f"model {run['model']}: {run['error'].splitlines()[0]}")
    write_results(args.json, "tiered_ttft", started, repeats=args.repeats, systems=systems, runs=runs, rows=rows,
                  problems=problems)
    return exit_code(problems)


if __name__ == "__main__":
    sys.exit(main())
