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
over ``--repeats`` (x ``--rounds`` fresh engines) is reported, the minimum too.

Every engine runs in a subprocess (``benchmarks/_engine.py``) with the same
environment: OpenMP threads pinned to every core unless the caller sets
``VLLM_CPU_OMP_THREADS_BIND`` (``_engine.thread_binding``), ``PYTHONHASHSEED=0``.
The run fails its hit check when a warm request cached less than 80% of its
prompt, recompute cached anything, or a vllm_aio engine counted hits it then
failed to load (``failed_hit_tokens``: vLLM recomputed them, so the sample
timed a recompute).
Measuring engines run in groups that are alive at once, a vllm_aio engine in
every group (``--group-size 2``: vllm_aio+Example, vllm_aio+prefix-cache,
vllm_aio+recompute); within a group the requests interleave one at a time (the
order rotates per prompt, ``--gap`` seconds apart), so load from other
processes on a shared machine hits both sides of each ratio alike. Each ratio
uses the vllm_aio samples of its own group. ``--group-size 4`` runs all four
at once (about 4 GiB of memory per medium engine: four were OOM-killed here
next to other sessions' tests).

What each system computes at a block-aligned length N (block 32): vllm_aio
loads N-1 tokens and computes 1; ExampleConnector and the prefix cache hit
N-32 and compute the last 32. At N = 32k+1 vllm_aio and the prefix cache both
compute 1 token (a like-for-like floor), but ExampleConnector never hits: it
stores under the hash of its first align(N) tokens and looks up align(N-1)
ones, which differ exactly when N-1 is a multiple of the block size.

    .venv/bin/python -m benchmarks.ttft --models tiny,medium --lengths 1024,2048,4096 --repeats 3

``--systems`` runs a subset (vllm_aio always); ``--quick``, a smoke test of the
real path (the tiny model, one 256-token prompt, once), runs vllm_aio alone
unless ``--systems`` names more.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks._engine import (
    ROOT, EngineFailed, Engines, check_hits, check_loads, chosen, engine_arguments, exit_code, make_prompts,
    plot_ttft, summarize, thread_binding, value_bytes)
from benchmarks._report import arguments, print_markdown, progress, write_results

POOL_SIZE = "4GB"
SYSTEMS = ("recompute", "ExampleConnector", "vllm_aio", "prefix-cache")
CONNECTORS = ("ExampleConnector", "vllm_aio")  # engines A store the prompts for these
SHORT = {"recompute": "recompute", "ExampleConnector": "Example", "vllm_aio": "vllm_aio", "prefix-cache": "prefix"}
# Per model: KV cache space of each engine (GiB) and max_model_len.
MODEL_SETTINGS = {
    "tiny": {"kv_gib": 1, "max_model_len": 8192},
    # 1 GiB holds 32k tokens of the medium model: plenty, and keeps several engines in memory at once.
    "medium": {"kv_gib": 1, "max_model_len": 8192},
}


def aio_config(pool_name: str) -> dict:
    return {
        "kv_connector": "AioConnector",
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


def engine_groups(group_size: int, systems: list[str]) -> list[list[str]]:
    """Measuring engines alive at once: vllm_aio in every group, with up to
    ``group_size - 1`` of the others, so each ratio compares interleaved requests."""
    others = [s for s in ("ExampleConnector", "prefix-cache", "recompute") if s in systems]
    step = max(1, group_size - 1)
    return [["vllm_aio", *others[i:i + step]] for i in range(0, len(others), step)] or [["vllm_aio"]]


def bench_model(name: str, lengths: list[int], systems: list[str], args) -> dict:
    from vllm_aio.backends.local import LocalBackend
    from vllm_aio.config import parse_size
    from vllm_aio.devtools.tiny_model import PRESETS, ensure_model

    settings = MODEL_SETTINGS.get(name, MODEL_SETTINGS["medium"])
    max_len = max(settings["max_model_len"], max(lengths) + 512)
    model_dir = ensure_model(ROOT / "models" / name, PRESETS[name])
    prompts = dict(zip(lengths, make_prompts(1000, lengths)))  # distinct prompt per length
    value = value_bytes(model_dir)
    workdir = Path(tempfile.mkdtemp(prefix=f"vllm_aio_ttft_{name}_"))
    pool_name = f"bench-ttft-{uuid.uuid4().hex[:12]}"
    print(f"model {name}: {model_dir} (pool value {value} bytes; logs in {workdir})", flush=True)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(settings["kv_gib"]), **thread_binding()}
    engines = Engines(model_dir, workdir, max_len, args.timeout, env)
    # The pool outlives engine A because this process holds it (opened as the engines open it).
    holder = LocalBackend(pool_name, parse_size("local_pool_size", POOL_SIZE), value, seal=False)
    samples: dict[str, dict[int, list[dict]]] = {s: {n: [] for n in lengths} for s in systems}
    cold: dict[str, dict[int, dict]] = {s: {} for s in systems}
    groups = engine_groups(args.group_size, systems)
    try:
        storage = workdir / "example_storage"
        storage.mkdir()
        configs = {"ExampleConnector": example_config(storage), "vllm_aio": aio_config(pool_name),
                   "recompute": None, "prefix-cache": None}
        # Engines A: compute (and store) every prompt once, then exit.
        a = {s: engines.start(f"{s}-A", configs[s]) for s in CONNECTORS if s in systems}
        engines.wait_ready(list(a.values()))
        for n in lengths:
            for system, e in a.items():
                cold[system][n] = e.request(f"store/{n}", prompts[n], args.timeout)
                time.sleep(args.gap)
        engines.close(list(a.values()))
        usage = holder.pool.usage()
        print(f"  pool after engines A: {usage.num_ready} blocks ({usage.bytes_used / 2**20:.0f} MiB)", flush=True)
        turn = 0
        for rnd in range(args.rounds):
            for gi, group in enumerate(groups):
                # The group's engines B are alive at once; their requests interleave, one at a time.
                b = {s: engines.start(f"{s}-B{rnd}g{gi}", configs[s], prefix_caching=s == "prefix-cache")
                     for s in group}
                engines.wait_ready(list(b.values()))
                time.sleep(args.gap)
                if "prefix-cache" in b:  # the same engine computes the prompt first
                    for n in lengths:
                        cold["prefix-cache"][n] = b["prefix-cache"].request(f"fill/{n}", prompts[n], args.timeout)
                        time.sleep(args.gap)
                for r in progress(range(args.repeats), args.repeats, f"{name} round {rnd} group {gi}", args.quick):
                    for n in lengths:
                        order = group[turn % len(group):] + group[:turn % len(group)]
                        turn += 1
                        for system in order:
                            step = b[system].request(f"warm/{n}/r{r}", prompts[n], args.timeout)
                            samples[system][n].append({**step, "group": gi, "round": rnd})
                            time.sleep(args.gap)  # let the last engine's spinning threads go idle
                engines.close(list(b.values()))
    except BaseException:
        engines.kill_all()
        raise
    finally:
        holder.close()
        if args.keep_logs:
            shutil.rmtree(workdir / "example_storage", ignore_errors=True)
            print(f"  kept engine logs in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    rows = []
    for n in lengths:
        row = {"model": name, "prompt_tokens": n}
        for system in systems:
            row[system] = summarize(samples[system][n], cold[system].get(n))
        # aio/X from the vllm_aio samples of X's own group (interleaved with X's requests).
        for system in systems:
            if system == "vllm_aio":
                continue
            groups_of_x = {s["group"] for s in samples[system][n]}
            aio = [s["ttft_s"] for s in samples["vllm_aio"][n] if s["group"] in groups_of_x]
            xs = [s["ttft_s"] for s in samples[system][n]]
            row["vllm_aio"][f"ratio_to_{system}"] = statistics.median(aio) / statistics.median(xs)
            row["vllm_aio"][f"ratio_min_to_{system}"] = min(aio) / min(xs)
        rows.append(row)
    return {"rows": rows, "engines": engines.info, "pool_value_bytes": value, "groups": groups}


def print_tables(rows: list[dict]) -> None:
    def ms(r: dict, system: str, key: str = "ttft_s") -> str:
        cell = r.get(system)
        return "-" if not cell or cell.get(key) is None else f"{cell[key] * 1e3:.1f}"

    def ratio(r: dict, key: str, spec: str) -> str:
        value = r["vllm_aio"].get(key)
        return "-" if value is None else format(value, spec)

    def ratios(r: dict, kind: str) -> list[str]:
        return [ratio(r, f"{kind}_to_ExampleConnector", ".2f"), ratio(r, f"{kind}_to_prefix-cache", ".2f"),
                ratio(r, f"{kind}_to_recompute", ".3f")]

    head = ["model", "tokens", *(f"{SHORT[s]} ms" for s in SYSTEMS), "aio/Example", "aio/prefix", "aio/recomp"]
    goal = ["", "", "", "", "", "", "(<= 0.5)", "(<= 2.0)", ""]
    print_markdown(head, [goal] + [[r["model"], str(r["prompt_tokens"]), *(ms(r, s) for s in SYSTEMS),
                                    *ratios(r, "ratio")] for r in rows], left=2,
                   title="Warm-request TTFT in a fresh engine (median; ms). Ratios: median of the vllm_aio "
                         "samples taken in the same engine group (interleaved) / median of the other system")
    print_markdown(head[:2] + [SHORT[s] for s in SYSTEMS] + head[6:],
                   [[r["model"], str(r["prompt_tokens"]), *(ms(r, s, "ttft_min_s") for s in SYSTEMS),
                     *ratios(r, "ratio_min")] for r in rows], left=2, title="Same, minimum over samples (ms)")
    print_markdown(["model", "tokens", *(SHORT[s] for s in SYSTEMS)],
                   [[r["model"], str(r["prompt_tokens"]),
                     *(str(r[s]["cached_min"]) if s in r else "-" for s in SYSTEMS)] for r in rows],
                   left=2, title="num_cached_tokens of the warm requests (min over samples)")
    cold = ("prefix-cache", "ExampleConnector", "vllm_aio")
    print_markdown(["model", "tokens", "recompute (median)", "prefix fill", "Example store", "vllm_aio store"],
                   [[r["model"], str(r["prompt_tokens"]), ms(r, "recompute"),
                     *("-" if s not in r or not r[s]["cold"] else f"{r[s]['cold']['ttft_s'] * 1e3:.1f}"
                       for s in cold)] for r in rows],
                   left=2, title="Cold request (computes the prompt; connectors also save it), one sample each (ms)")


def main() -> int:
    parser = arguments(__doc__, "ttft")
    parser.add_argument("--models", default="tiny,medium")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times to repeat the measuring phase with fresh engines")
    parser.add_argument("--group-size", type=int, default=2,
                        help="measuring engines alive at once (vllm_aio + N-1 others); 4 = all, "
                             "needs ~4 GiB per medium engine")
    engine_arguments(parser, SYSTEMS)
    args = parser.parse_args()
    if args.quick:
        args.models, args.rounds = "tiny", 1
    lengths, systems = chosen(args, SYSTEMS)
    models = [m for m in args.models.split(",") if m]
    started = time.perf_counter()
    results, rows = {}, []
    try:
        for name in models:
            results[name] = bench_model(name, lengths, systems, args)
            rows.extend(results[name]["rows"])
    except EngineFailed as exc:
        print(f"\n{exc}", file=sys.stderr)
        return 1
    print_tables(rows)
    if args.plot:
        plot_ttft(rows, systems, args.plot, "Warm-request TTFT in a fresh engine", "model")
    connectors = [s for s in systems if s != "recompute"]
    problems = [f"{r['model']} {r['prompt_tokens']}: {p}" for r in rows for p in check_hits(r, connectors)]
    problems += [p for res in results.values() for p in check_loads(res["engines"])]
    write_results(args.json, "ttft", started, repeats=args.repeats, rounds=args.rounds, systems=systems,
                  models=results, rows=rows, problems=problems)
    return exit_code(problems)


if __name__ == "__main__":
    sys.exit(main())
