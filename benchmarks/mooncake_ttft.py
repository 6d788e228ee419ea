"""Warm-request TTFT in a FRESH engine over a Mooncake pool: vllm_aio vs vLLM's MooncakeStoreConnector.

For each tensor-parallel size and prompt length, the same random token-id
prompt is measured by:

* ``recompute``: no connector; the fresh engine never saw the prompt.
* ``MooncakeStoreConnector``: vLLM's in-tree Mooncake store connector in its
  ``standalone-store`` mode (settings from the JSON file named by
  ``MOONCAKE_CONFIG_PATH``, ``global_segment_size`` 0).
* ``vllm_aio``: ``AioConnector`` with ``backend: mooncake``, the same settings inline.

Each connector gets its own fresh loopback pool (``MooncakePool``: a
``mooncake_master`` plus a memory-owning ``mooncake_client``, started here and
kept up across the engines), so neither sees the other's data. Engine A of each
connector computes (stores) the prompts and exits; fresh engines B (all three
systems alive at once) each run an unrelated warm-up prompt, then time every
warm prompt alone (``max_tokens=1``), their requests interleaved one at a time
in a rotating order, ``--gap`` seconds apart, so load from other processes hits
all systems alike. vLLM's prefix caching is off everywhere: every cached token
came from the pool. TTFT is vLLM's own first-token latency; median of
``--repeats``.

Engines are ``benchmarks/_engine.py`` subprocesses, as in ``benchmarks/ttft.py``
(and checked the same way, ``failed_hit_tokens`` included); block size 32,
eager, ``VLLM_CPU_KVCACHE_SPACE=1``, ``PYTHONHASHSEED=0``; TP=1 binds OpenMP to
``0-{ncpu-1}`` (or the caller's ``VLLM_CPU_OMP_THREADS_BIND``), TP=2 uses the ``mp`` executor
with ``VLLM_CPU_OMP_THREADS_BIND=0|1``.

    .venv/bin/python -m benchmarks.mooncake_ttft --tp 1,2 --lengths 1024,2048,4096 --repeats 3

``--transfer-mode layerwise`` (or ``async``) runs vllm_aio's engines in that mode
(``whole_blocks`` by default). ``--together 4`` measures four prompts sent together
that share each length's prompt as a prefix (the time to their slowest first
token; the hit check then holds for the batch's tokens).

``--systems`` runs a subset (vllm_aio always); ``--quick``, a smoke test of the
real path (TP=1, one 256-token prompt, once, 256 MB pools), runs vllm_aio alone
unless ``--systems`` names more.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks._engine import (
    BLOCK_SIZE, ROOT, EngineFailed, EngineProc, Engines, check_hits, check_loads, chosen, engine_arguments,
    exit_code, make_prompts, plot_ttft, summarize, thread_binding)
from benchmarks._report import arguments, print_markdown, progress, write_results

SYSTEMS = ("recompute", "MooncakeStoreConnector", "vllm_aio")
CONNECTORS = SYSTEMS[1:]
SHORT = {"recompute": "recompute", "MooncakeStoreConnector": "MooncakeStore", "vllm_aio": "vllm_aio"}
KV_GIB = 1
# Settings of the environment that would change what an engine does; every engine starts without them.
SCRUB_ENV = ("MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER", "MOONCAKE_GLOBAL_SEGMENT_SIZE",
             "MOONCAKE_REQUESTER_LOCAL_HOSTNAME", "MOONCAKE_PREFERRED_SEGMENT",
             "VLLM_AIO_BACKEND", "VLLM_AIO_LOCAL_POOL_SIZE")
# Log lines worth keeping from an engine (their connector's and ours).
LOG_PATTERNS = re.compile(r"(?i)(mooncake|aio|kv transfer|error|warning|traceback|exception|failed)")


TAIL = 64  # --together: the i-th prompt's own tail after the shared prefix, (i + 1) x TAIL tokens


def distinct_blocks(prompt: list[int] | list[list[int]]) -> int:
    """Full blocks of a prompt, or of prompts sent together sharing a prefix: each distinct block once."""
    batch = prompt if isinstance(prompt[0], list) else [prompt]
    return len({tuple(p[:end]) for p in batch for end in range(BLOCK_SIZE, len(p) + 1, BLOCK_SIZE)})


def theirs_store_config(pool_config: dict) -> dict:
    """The MOONCAKE_CONFIG_PATH file vLLM's MooncakeStoreConfig.from_file reads (its keys only)."""
    return {
        "metadata_server": pool_config["metadata_server"],
        "master_server_address": pool_config["master_server_address"],
        "protocol": pool_config["protocol"],
        "device_name": pool_config["device_name"],
        "mode": "standalone-store",
        "global_segment_size": 0,
        "local_buffer_size": pool_config["local_buffer_size"],
    }


def theirs_kv_config(lookup_rpc_port: int) -> dict:
    return {
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        # The scheduler reaches worker rank 0 over ipc://.../lookup_rpc_port_{port}_host_{host}_dp_rank0:
        # a distinct port per engine, so two of their engines on this host never share the socket.
        "kv_connector_extra_config": {"lookup_rpc_port": lookup_rpc_port},
    }


def aio_kv_config(pool_config: dict, transfer_mode: str) -> dict:
    return {
        "kv_connector": "AioConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"backend": "mooncake", **pool_config, "global_segment_size": 0,
                                      "transfer_mode": transfer_mode},
    }


def pool_summary(pool) -> dict:
    """The master's key count and memory line (its metrics HTTP port)."""
    base = f"http://{pool.master_address.split(':')[0]}:{pool.metrics_port}"
    try:
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
        keys = next(int(float(line.split()[1])) for line in metrics.splitlines()
                    if line.startswith("master_key_count "))
        summary = urllib.request.urlopen(f"{base}/metrics/summary", timeout=5).read().decode()
        mem = re.search(r"Mem Storage: [^|]*", summary)
        return {"keys": keys, "mem": mem.group(0).strip() if mem else None}
    except (OSError, StopIteration, ValueError) as exc:
        return {"keys": None, "error": str(exc)}


def settle(pools: dict, expected: int, limit_s: float = 180.0) -> dict:
    """Wait until every pool holds ``expected`` keys (saves may be asynchronous), at most ``limit_s``."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if all((pool_summary(p)["keys"] or 0) >= expected for p in pools.values()):
            break
        time.sleep(0.25)
    return {"expected_keys": expected, "waited_s": round(time.monotonic() - start, 2),
            **{s: pool_summary(p) for s, p in pools.items()}}


class Bench:
    """One TP size: a fresh pool per connector, engines A (store), engines B (measure)."""

    def __init__(self, model_dir: Path, tp: int, lengths: list[int], systems: list[str],
                 args: argparse.Namespace, workdir: Path) -> None:
        self.tp, self.lengths, self.systems, self.args = tp, lengths, systems, args
        self.workdir = workdir / f"tp{tp}"
        self.workdir.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if k not in SCRUB_ENV}
        env.update(VLLM_CPU_KVCACHE_SPACE=str(KV_GIB),
                   VLLM_CPU_OMP_THREADS_BIND=(args.tp2_bind if tp == 2
                                              else thread_binding()["VLLM_CPU_OMP_THREADS_BIND"]))
        self.engines = Engines(model_dir, self.workdir, max(8192, max(lengths) + 512), args.timeout, env,
                               seed=20_000 + tp * 100)
        self.pools: dict = {}
        self.theirs_config_path = self.workdir / "mooncake_store.json"

    def start(self, system: str, phase: str) -> EngineProc:
        env, kv = {}, None
        if system == "MooncakeStoreConnector":
            env["MOONCAKE_CONFIG_PATH"] = str(self.theirs_config_path)
            # Their requester address is get_ip() unless overridden; the pool is on loopback.
            env["MOONCAKE_REQUESTER_LOCAL_HOSTNAME"] = "127.0.0.1"
            kv = theirs_kv_config(20000 + self.tp * 1000 + self.engines.count + 1 + os.getpid() % 500)
        elif system == "vllm_aio":
            kv = aio_kv_config(self.pools["vllm_aio"].config, self.args.transfer_mode)
        parallel = {"tensor_parallel_size": self.tp, "distributed_executor_backend": "mp"} if self.tp > 1 else {}
        return self.engines.start(f"{system}-tp{self.tp}-{phase}", kv, env=env, **parallel)

    def run(self) -> dict:
        from vllm_aio.devtools.mooncake_pool import MooncakePool

        args, lengths, engines = self.args, self.lengths, self.engines
        connectors = [s for s in CONNECTORS if s in self.systems]
        prompts = dict(zip(lengths, make_prompts(1000, lengths)))
        if args.together > 1:  # each length: a shared prefix, the prompts' own tails after it
            prompts = {n: [p + t for t in make_prompts(2000 + n, [TAIL * (i + 1) for i in range(args.together)])]
                       for n, p in prompts.items()}
        samples = {s: {n: [] for n in lengths} for s in self.systems}
        cold: dict[str, dict[int, dict]] = {s: {} for s in self.systems}
        errors: dict[str, str] = {}
        logs: dict[str, str] = {}

        def failed(system: str, exc: BaseException, engine: EngineProc) -> None:
            errors[system] = str(exc)
            print(f"\n!! {system} TP={self.tp}: {exc}\n", flush=True)
            if engine in engines.live:
                keep_log(engine)
                engines.kill(engine)

        def keep_log(e: EngineProc) -> None:
            text = e.log_tail(1 << 30)
            logs[e.name] = "\n".join(line for line in text.splitlines() if LOG_PATTERNS.search(line))[-20000:]

        def ready(group: dict[str, EngineProc]) -> None:
            for s, e in list(group.items()):
                try:
                    r = e.wait_ready(args.timeout)
                    print(f"  {e.name}: ready after {r['start_s']:.0f}s", flush=True)
                except EngineFailed as exc:
                    failed(s, exc, e)
                    del group[s]

        def close(group: dict[str, EngineProc]) -> None:
            for e in group.values():
                keep_log(e)
            engines.close(list(group.values()))

        try:
            for system in connectors:  # one fresh pool each: neither sees the other's data
                self.pools[system] = MooncakePool(args.pool_size, log_dir=self.workdir / f"pool-{system}").start()
            if "MooncakeStoreConnector" in self.pools:
                self.theirs_config_path.write_text(
                    json.dumps(theirs_store_config(self.pools["MooncakeStoreConnector"].config), indent=1))
            print(f"TP={self.tp}: pools " + " ".join(f"{s}@{p.master_address}" for s, p in self.pools.items())
                  + f"; logs in {self.workdir}", flush=True)

            # Engines A: compute (and store) every prompt once, then exit.
            a = {s: self.start(s, "A") for s in connectors}
            ready(a)
            for n in lengths:
                for s, e in list(a.items()):
                    try:
                        cold[s][n] = e.request(f"store/{n}", prompts[n], args.timeout)
                    except EngineFailed as exc:
                        failed(s, exc, e)
                        del a[s]
                    time.sleep(args.gap)
            # Saves may still be in flight (theirs run on a sending thread): engines A exit only once
            # both pools hold every full block of the prompts and the warm-up, once per TP rank.
            expected = (sum(distinct_blocks(prompts[n]) for n in lengths) + 64 // BLOCK_SIZE) * self.tp
            pool_state = {"after_A": settle(self.pools, expected, args.settle)}
            print(f"  pools after engines A: {pool_state['after_A']}", flush=True)
            close(a)

            # Engines B: every system alive at once, requests interleaved one at a time.
            b = {s: self.start(s, "B") for s in self.systems if s not in errors}
            ready(b)
            time.sleep(args.gap)
            turn = 0
            for r in progress(range(args.repeats), args.repeats, f"TP={self.tp}", args.quick):
                for n in lengths:
                    order = self.systems[turn % len(self.systems):] + self.systems[:turn % len(self.systems)]
                    turn += 1
                    for s in order:
                        if s not in b:
                            continue
                        try:
                            samples[s][n].append(b[s].request(f"warm/{n}/r{r}", prompts[n], args.timeout))
                        except EngineFailed as exc:
                            failed(s, exc, b.pop(s))
                        time.sleep(args.gap)  # let the last engine's spinning threads go idle
            close(b)
            pool_state["after_B"] = {s: pool_summary(p) for s, p in self.pools.items()}
        except BaseException:
            engines.kill_all()
            raise
        finally:
            for pool in self.pools.values():
                pool.stop()

        rows = [{"model": args.model, "tp": self.tp, "prompt_tokens": n, "together": args.together,
                 "batch_tokens": sum(map(len, prompts[n])) if args.together > 1 else n,
                 **{s: summarize(samples[s][n], cold[s].get(n), errors.get(s)) for s in self.systems}}
                for n in lengths]
        configs = {}
        if "MooncakeStoreConnector" in self.pools:
            configs["MooncakeStoreConnector"] = {
                "kv_transfer_config": theirs_kv_config(0) | {"kv_connector_extra_config":
                                                             {"lookup_rpc_port": "<per engine>"}},
                "MOONCAKE_CONFIG_PATH": json.loads(self.theirs_config_path.read_text()),
                "env": {"MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1"}}
        configs["vllm_aio"] = {
            "kv_transfer_config": aio_kv_config(self.pools["vllm_aio"].config, self.args.transfer_mode)}
        return {"tp": self.tp, "rows": rows, "errors": errors, "engines": engines.info, "pools": pool_state,
                "omp_bind": engines.env["VLLM_CPU_OMP_THREADS_BIND"], "configs": configs, "engine_logs": logs}


def print_tables(rows: list[dict]) -> None:
    def ms(r: dict, system: str, key: str = "ttft_s") -> str:
        cell = r.get(system)
        return "-" if cell is None else "FAIL" if "error" in cell else f"{cell[key] * 1e3:.1f}"

    def ratio(r: dict, key: str = "ttft_s") -> str:
        a, b = r["vllm_aio"], r.get("MooncakeStoreConnector")
        return "-" if b is None or "error" in a or "error" in b else f"{a[key] / b[key]:.2f}"

    def keys(r: dict) -> list[str]:
        return [r["model"], str(r["tp"]), str(r["prompt_tokens"])]

    head = ["model", "TP", "tokens", "recompute ms", "MooncakeStore ms", "vllm_aio ms", "aio/theirs"]
    print_markdown(head, [["", "", "", "", "", "", "(<= 0.5)"]] + [
        keys(r) + [ms(r, s) for s in SYSTEMS] + [ratio(r)] for r in rows],
        left=3, title="Warm-request TTFT in a fresh engine, Mooncake pool (median; ms)")
    print_markdown(head, [keys(r) + [ms(r, s, "ttft_min_s") for s in SYSTEMS] + [ratio(r, "ttft_min_s")]
                          for r in rows], left=3, title="Same, minimum over samples (ms)")
    print_markdown(["model", "TP", "tokens", *(SHORT[s] for s in SYSTEMS), "aio/theirs"],
                   [keys(r) + [ms(r, s, "engine_s") for s in SYSTEMS] + [ratio(r, "engine_s")] for r in rows],
                   left=3, title="Engine core scheduled-to-first-token (median; ms)")
    print_markdown(["model", "TP", "tokens", *(SHORT[s] for s in SYSTEMS)],
                   [keys(r) + ["-" if s not in r else "FAIL" if "error" in r[s] else str(r[s]["cached_min"])
                               for s in SYSTEMS] for r in rows],
                   left=3, title="num_cached_tokens of the warm requests (min over samples)")
    print_markdown(["model", "TP", "tokens", "MooncakeStore store", "vllm_aio store"],
                   [keys(r) + ["-" if s not in r or "error" in r[s] or not r[s]["cold"]
                               else f"{r[s]['cold']['ttft_s'] * 1e3:.1f}" for s in CONNECTORS] for r in rows],
                   left=3, title="Cold request in engine A (computes and stores), one sample each (ms)")


def main() -> int:
    parser = arguments(__doc__, "mooncake_ttft")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes, e.g. 1,2")
    parser.add_argument("--pool-size", default="1GB", help="memory of each connector's Mooncake pool")
    parser.add_argument("--settle", type=float, default=180,
                        help="seconds engines A may take for their saves to land in the pool")
    parser.add_argument("--transfer-mode", default="whole_blocks",
                        choices=("whole_blocks", "layerwise", "async"), help="vllm_aio's transfer_mode")
    parser.add_argument("--together", type=int, default=1,
                        help="prompts per measured request batch: each length is then a prefix they share, "
                             f"each with its own tail ({TAIL} x i tokens), sent in one generate")
    parser.add_argument("--tp2-bind", default="0|1",
                        help="VLLM_CPU_OMP_THREADS_BIND at TP=2 (one core per rank by default)")
    engine_arguments(parser, SYSTEMS)
    args = parser.parse_args()
    if args.quick:
        args.model, args.tp, args.pool_size = "tiny", "1", "256MB"
    lengths, systems = chosen(args, SYSTEMS)
    tps = [int(x) for x in args.tp.split(",") if x]

    from vllm_aio.devtools.tiny_model import PRESETS, ensure_model

    model_dir = ensure_model(ROOT / "models" / args.model, PRESETS[args.model])
    workdir = Path(tempfile.mkdtemp(prefix="vllm_aio_mooncake_ttft_"))
    started = time.perf_counter()
    runs: list[dict] = []
    rows: list[dict] = []
    try:
        for tp in tps:
            runs.append(Bench(model_dir, tp, lengths, systems, args, workdir).run())
            rows.extend(runs[-1]["rows"])
            # partial results survive a later failure
            write_results(args.json, "mooncake_ttft", started, model=args.model, repeats=args.repeats,
                          pool_size=args.pool_size, systems=systems, runs=runs, rows=rows)
    finally:
        if args.keep_logs:
            print(f"kept logs in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print_tables(rows)
    if args.plot:
        plot_ttft(rows, systems, args.plot, f"Warm-request TTFT on one Mooncake pool ({args.model})", "tp")
    for run in runs:
        for s, err in run["errors"].items():
            print(f"\n{s} at TP={run['tp']} failed:\n{err}")
    connectors = [s for s in CONNECTORS if s in systems]
    problems = [f"TP={r['tp']} {r['prompt_tokens']}: {p}" for r in rows for p in check_hits(r, connectors)]
    problems += [f"TP={run['tp']}: {p}" for run in runs for p in check_loads(run["engines"])]
    write_results(args.json, "mooncake_ttft", started, model=args.model, repeats=args.repeats,
                  pool_size=args.pool_size, systems=systems, runs=runs, rows=rows, problems=problems)
    return exit_code(problems)


if __name__ == "__main__":
    sys.exit(main())
