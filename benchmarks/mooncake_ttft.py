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

Engines are ``benchmarks/_engine.py`` subprocesses (through ``_engine_tp.py``
for TP), started by ``benchmarks/ttft.py``'s ``EngineProc``; block size 32,
eager, ``VLLM_CPU_KVCACHE_SPACE=1``, ``PYTHONHASHSEED=0``; TP=1 binds OpenMP to
``0-{ncpu-1}``, TP=2 uses the ``mp`` executor with ``VLLM_CPU_OMP_THREADS_BIND=0|1``.

    .venv/bin/python benchmarks/mooncake_ttft.py --tp 1,2 --lengths 1024,2048,4096 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import ttft  # noqa: E402  (EngineProc, make_prompts, fmt/print helpers)
from ttft import EngineFailed, EngineProc, make_prompts  # noqa: E402

ttft.RUNNER = HERE / "_engine_tp.py"  # EngineProc starts this runner: _engine.py plus TP settings
RESULTS = HERE / "results" / "mooncake_ttft.json"
SYSTEMS = ("recompute", "MooncakeStoreConnector", "vllm_aio")
CONNECTORS = SYSTEMS[1:]
MIN_HIT = 0.8
KV_GIB = 1
# Settings of the environment that would change what an engine does; every engine starts without them.
SCRUB_ENV = ("MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER", "MOONCAKE_GLOBAL_SEGMENT_SIZE",
             "MOONCAKE_REQUESTER_LOCAL_HOSTNAME", "MOONCAKE_PREFERRED_SEGMENT",
             "VLLM_AIO_BACKEND", "VLLM_AIO_LOCAL_POOL_SIZE")
# Log lines worth keeping from an engine (their connector's and ours).
LOG_PATTERNS = re.compile(r"(?i)(mooncake|aio|kv transfer|error|warning|traceback|exception|failed)")


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


def aio_kv_config(pool_config: dict) -> dict:
    return {
        "kv_connector": "AioConnector",
        "kv_connector_module_path": "vllm_aio.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"backend": "mooncake", **pool_config, "global_segment_size": 0},
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
    """One TP size: two fresh pools, engines A (store), engines B (measure)."""

    def __init__(self, model_dir: Path, tp: int, lengths: list[int], args: argparse.Namespace,
                 workdir: Path) -> None:
        self.model_dir, self.tp, self.lengths, self.args = model_dir, tp, lengths, args
        self.workdir = workdir / f"tp{tp}"
        self.workdir.mkdir(parents=True)
        self.max_len = max(8192, max(lengths) + 512)
        self.count = 0
        self.live: list[EngineProc] = []
        base = {k: v for k, v in os.environ.items() if k not in SCRUB_ENV}
        self.base_env = {
            **base,
            "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB),
            "PYTHONHASHSEED": "0",
            "VLLM_CPU_OMP_THREADS_BIND": (args.tp2_bind if tp == 2 else f"0-{os.cpu_count() - 1}"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
        self.pools: dict = {}
        self.theirs_config_path = self.workdir / "mooncake_store.json"

    # -- engines -----------------------------------------------------------------------------

    def start(self, system: str, phase: str) -> EngineProc:
        self.count += 1
        env = dict(self.base_env)
        kv = None
        if system == "MooncakeStoreConnector":
            env["MOONCAKE_CONFIG_PATH"] = str(self.theirs_config_path)
            # Their requester address is get_ip() unless overridden; the pool is on loopback.
            env["MOONCAKE_REQUESTER_LOCAL_HOSTNAME"] = "127.0.0.1"
            kv = theirs_kv_config(20000 + self.tp * 1000 + self.count + os.getpid() % 500)
        elif system == "vllm_aio":
            kv = aio_kv_config(self.pools["vllm_aio"].config)
        spec = {
            "model": str(self.model_dir),
            "max_model_len": self.max_len,
            "enable_prefix_caching": False,
            "kv_transfer_config": kv,
            "warmup": make_prompts(20_000 + self.tp * 100 + self.count, [64])[0],  # distinct per engine
        }
        if self.tp > 1:
            spec.update(tensor_parallel_size=self.tp, distributed_executor_backend="mp")
        engine = EngineProc(f"{system}-tp{self.tp}-{phase}", spec, self.workdir, env)
        engine.system, engine.kv_config = system, kv
        self.live.append(engine)
        return engine

    def close(self, engine: EngineProc) -> None:
        engine.close()
        self.live.remove(engine)

    def kill_all(self) -> None:
        for e in self.live:
            e.kill()
        self.live.clear()

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> dict:
        from vllm_aio.devtools.mooncake_pool import MooncakePool

        args, lengths = self.args, self.lengths
        prompts = dict(zip(lengths, make_prompts(1000, lengths)))
        samples = {s: {n: [] for n in lengths} for s in SYSTEMS}
        cold: dict[str, dict[int, dict]] = {s: {} for s in SYSTEMS}
        errors: dict[str, str] = {}
        engines_info: list[dict] = []
        logs: dict[str, str] = {}

        def failed(system: str, exc: BaseException, engine: EngineProc | None) -> None:
            errors[system] = str(exc)
            print(f"\n!! {system} TP={self.tp}: {exc}\n", flush=True)
            if engine is not None and engine in self.live:
                engine.kill()
                self.live.remove(engine)

        def keep_log(e: EngineProc) -> None:
            e._log.flush()
            text = e.log_path.read_text(errors="replace")
            logs[e.name] = "\n".join(line for line in text.splitlines() if LOG_PATTERNS.search(line))[-20000:]
            if e.ready:
                engines_info.append({"engine": e.name, "start_s": e.ready["start_s"],
                                     "init_s": e.ready["init_s"], "warmup": e.ready["warmup"]})

        try:
            for system in CONNECTORS:  # one fresh pool each: neither sees the other's data
                self.pools[system] = MooncakePool(args.pool_size, log_dir=self.workdir / f"pool-{system}").start()
            self.theirs_config_path.write_text(
                json.dumps(theirs_store_config(self.pools["MooncakeStoreConnector"].config), indent=1))
            print(f"TP={self.tp}: pools MooncakeStoreConnector@{self.pools['MooncakeStoreConnector'].master_address}"
                  f" vllm_aio@{self.pools['vllm_aio'].master_address}; logs in {self.workdir}", flush=True)

            # Engines A: compute (and store) every prompt once, then exit.
            a = {s: self.start(s, "A") for s in CONNECTORS}
            for s, e in list(a.items()):
                try:
                    r = e.wait_ready(args.timeout)
                    print(f"  {e.name}: ready after {r['start_s']:.0f}s", flush=True)
                except EngineFailed as exc:
                    failed(s, exc, e)
                    keep_log(e)
                    del a[s]
            for n in lengths:
                for s, e in list(a.items()):
                    try:
                        cold[s][n] = e.request(f"store/{n}", prompts[n], args.timeout)
                    except EngineFailed as exc:
                        failed(s, exc, e)
                        keep_log(e)
                        del a[s]
                    time.sleep(args.gap)
            # Saves may still be in flight (theirs run on a sending thread): engines A exit only once
            # both pools hold every full block of the prompts and the warm-up, once per TP rank.
            expected = (sum(n // 32 for n in lengths) + 64 // 32) * self.tp
            pool_state = {"after_A": settle(self.pools, expected, args.settle)}
            print(f"  pools after engines A: {pool_state['after_A']}", flush=True)
            for e in a.values():
                keep_log(e)
                self.close(e)

            # Engines B: all three alive at once, requests interleaved one at a time.
            b = {s: self.start(s, "B") for s in SYSTEMS if s not in errors}
            for s, e in list(b.items()):
                try:
                    r = e.wait_ready(args.timeout)
                    print(f"  {e.name}: ready after {r['start_s']:.0f}s", flush=True)
                except EngineFailed as exc:
                    failed(s, exc, e)
                    keep_log(e)
                    del b[s]
            time.sleep(args.gap)
            turn = 0
            for r in range(args.repeats):
                for n in lengths:
                    order = SYSTEMS[turn % len(SYSTEMS):] + SYSTEMS[:turn % len(SYSTEMS)]
                    turn += 1
                    for s in order:
                        if s not in b:
                            continue
                        try:
                            samples[s][n].append(b[s].request(f"warm/{n}/r{r}", prompts[n], args.timeout))
                        except EngineFailed as exc:
                            failed(s, exc, b[s])
                            keep_log(b.pop(s))
                        time.sleep(args.gap)  # let the last engine's spinning threads go idle
            for e in b.values():
                keep_log(e)
                self.close(e)
            pool_state["after_B"] = {s: pool_summary(p) for s, p in self.pools.items()}
        except BaseException:
            self.kill_all()
            raise
        finally:
            for pool in self.pools.values():
                pool.stop()

        rows = []
        for n in lengths:
            row = {"model": self.args.model, "tp": self.tp, "prompt_tokens": n}
            for s in SYSTEMS:
                ss = samples[s][n]
                if not ss:
                    row[s] = {"error": errors.get(s, "no samples")}
                    continue
                row[s] = {
                    "ttft_s": statistics.median(x["ttft_s"] for x in ss),
                    "ttft_min_s": min(x["ttft_s"] for x in ss),
                    "wall_s": statistics.median(x["wall_s"] for x in ss),
                    "engine_s": statistics.median(x["engine_s"] for x in ss),
                    "cached_min": min(x["cached"] for x in ss),
                    "cached_max": max(x["cached"] for x in ss),
                    "samples": ss,
                    "cold": cold[s].get(n),
                }
            rows.append(row)
        return {"tp": self.tp, "rows": rows, "errors": errors, "engines": engines_info, "pools": pool_state,
                "omp_bind": self.base_env["VLLM_CPU_OMP_THREADS_BIND"],
                "configs": {"MooncakeStoreConnector": {
                                "kv_transfer_config": theirs_kv_config(0) | {"kv_connector_extra_config":
                                                                             {"lookup_rpc_port": "<per engine>"}},
                                "MOONCAKE_CONFIG_PATH": json.loads(self.theirs_config_path.read_text()),
                                "env": {"MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1"}},
                            "vllm_aio": {"kv_transfer_config": aio_kv_config(
                                {k: v for k, v in self.pools["vllm_aio"].config.items()})}},
                "engine_logs": logs}


def check_hits(row: dict) -> list[str]:
    n, bad = row["prompt_tokens"], []
    if "error" not in row["recompute"] and row["recompute"]["cached_max"] != 0:
        bad.append(f"recompute cached {row['recompute']['cached_max']} tokens (want 0)")
    for s in CONNECTORS:
        if "error" in row[s]:
            bad.append(f"{s} failed: {row[s]['error'].splitlines()[0]}")
        elif row[s]["cached_min"] < MIN_HIT * n:
            bad.append(f"{s} cached only {row[s]['cached_min']}/{n} tokens (want >= {MIN_HIT:.0%})")
    return bad


def print_tables(rows: list[dict]) -> None:
    def ms(cell: dict, key: str = "ttft_s") -> str:
        return "FAIL" if "error" in cell else f"{cell[key] * 1e3:.1f}"

    def ratio(a: dict, b: dict, key: str = "ttft_s") -> str:
        return "-" if "error" in a or "error" in b else f"{a[key] / b[key]:.2f}"

    head = ("model", "TP", "tokens", "recompute ms", "MooncakeStore ms", "vllm_aio ms", "aio/theirs")
    table = [head, ("", "", "", "", "", "", "(<= 0.5)")]
    for r in rows:
        table.append((r["model"], str(r["tp"]), str(r["prompt_tokens"]), ms(r["recompute"]),
                      ms(r["MooncakeStoreConnector"]), ms(r["vllm_aio"]),
                      ratio(r["vllm_aio"], r["MooncakeStoreConnector"])))
    ttft._print(table, "Warm-request TTFT in a fresh engine, Mooncake pool (median; ms)")
    mins = [head]
    for r in rows:
        mins.append((r["model"], str(r["tp"]), str(r["prompt_tokens"]), ms(r["recompute"], "ttft_min_s"),
                     ms(r["MooncakeStoreConnector"], "ttft_min_s"), ms(r["vllm_aio"], "ttft_min_s"),
                     ratio(r["vllm_aio"], r["MooncakeStoreConnector"], "ttft_min_s")))
    ttft._print(mins, "Same, minimum over samples (ms)")
    eng = [("model", "TP", "tokens", "recompute", "MooncakeStore", "vllm_aio", "aio/theirs")]
    for r in rows:
        eng.append((r["model"], str(r["tp"]), str(r["prompt_tokens"]), *(ms(r[s], "engine_s") for s in SYSTEMS),
                    ratio(r["vllm_aio"], r["MooncakeStoreConnector"], "engine_s")))
    ttft._print(eng, "Engine core scheduled-to-first-token (median; ms)")
    cached = [("model", "TP", "tokens", "recompute", "MooncakeStore", "vllm_aio")]
    for r in rows:
        cached.append((r["model"], str(r["tp"]), str(r["prompt_tokens"]),
                       *("FAIL" if "error" in r[s] else str(r[s]["cached_min"]) for s in SYSTEMS)))
    ttft._print(cached, "num_cached_tokens of the warm requests (min over samples)")
    cold = [("model", "TP", "tokens", "MooncakeStore store", "vllm_aio store")]
    for r in rows:
        cold.append((r["model"], str(r["tp"]), str(r["prompt_tokens"]),
                     *("-" if "error" in r[s] or not r[s]["cold"] else f"{r[s]['cold']['ttft_s'] * 1e3:.1f}"
                       for s in CONNECTORS)))
    ttft._print(cold, "Cold request in engine A (computes and stores), one sample each (ms)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes, e.g. 1,2")
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pool-size", default="1GB", help="memory of each connector's Mooncake pool")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds an engine may take to start, or to answer one request")
    parser.add_argument("--gap", type=float, default=1.5,
                        help="idle seconds between requests (vLLM workers spin ~1 s after each step)")
    parser.add_argument("--settle", type=float, default=180,
                        help="seconds engines A may take for their saves to land in the pool")
    parser.add_argument("--tp2-bind", default="0|1",
                        help="VLLM_CPU_OMP_THREADS_BIND at TP=2 (one core per rank by default)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--keep-logs", action="store_true", help="keep engine and pool logs")
    args = parser.parse_args()
    tps = [int(x) for x in args.tp.split(",") if x]
    lengths = [int(x) for x in args.lengths.split(",") if x]

    from vllm_aio.devtools.tiny_model import PRESETS, ensure_model

    model_dir = ensure_model(ROOT / "models" / args.model, PRESETS[args.model])
    workdir = Path(tempfile.mkdtemp(prefix="vllm_aio_mooncake_ttft_"))
    started = time.perf_counter()
    out = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "model": args.model, "repeats": args.repeats, "pool_size": args.pool_size, "runs": []}
    rows: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for tp in tps:
            res = Bench(model_dir, tp, lengths, args, workdir).run()
            out["runs"].append(res)
            rows.extend(res["rows"])
            out["rows"] = rows
            args.out.write_text(json.dumps(out, indent=1))  # partial results survive a later failure
    finally:
        if args.keep_logs:
            print(f"kept logs in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    out["elapsed_s"] = time.perf_counter() - started
    out["rows"] = rows
    args.out.write_text(json.dumps(out, indent=1))
    print_tables(rows)
    for run in out["runs"]:
        for s, err in run["errors"].items():
            print(f"\n{s} at TP={run['tp']} failed:\n{err}")
    problems = [f"TP={r['tp']} {r['prompt_tokens']}: {p}" for r in rows for p in check_hits(r)]
    for p in problems:
        print(f"HIT CHECK FAILED: {p}")
    print(f"\nwrote {args.out} ({out['elapsed_s']:.0f}s)")
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
