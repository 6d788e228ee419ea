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
pinned environment (``VLLM_CPU_OMP_THREADS_BIND``, ``PYTHONHASHSEED=0``).
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

    .venv/bin/python benchmarks/ttft.py --models tiny,medium --lengths 1024,2048,4096 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import select
import shutil
import signal
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
    # 1 GiB holds 32k tokens of the medium model: plenty, and keeps several engines in memory at once.
    "medium": {"kv_gib": 1, "max_model_len": 8192},
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


class EngineProc:
    """One engine subprocess (``_engine.py``) that serves one request per command."""

    def __init__(self, name: str, spec: dict, workdir: Path, env: dict[str, str]) -> None:
        self.name = name
        tag = f"{name}-{uuid.uuid4().hex[:6]}"
        self.spec_path = workdir / f"{tag}.json"
        self.log_path = workdir / f"{tag}.log"
        self.spec_path.write_text(json.dumps(spec))
        read_fd, write_fd = os.pipe()
        self._log = open(self.log_path, "w")
        self.started = time.perf_counter()
        # Own session: on failure the whole engine (runner + engine core + worker) is killed by pgid.
        self.proc = subprocess.Popen(
            [sys.executable, str(RUNNER), str(self.spec_path), str(write_fd)],
            env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
            pass_fds=(write_fd,), start_new_session=True, text=True,
        )
        os.close(write_fd)
        self._results = os.fdopen(read_fd, "r")
        self._buf = ""
        self.ready: dict | None = None

    def _line(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self._results.fileno()
        while "\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.fail(f"no answer within {timeout:.0f}s")
            if select.select([fd], [], [], min(left, 1.0))[0]:
                chunk = os.read(fd, 1 << 20).decode()
                if not chunk:
                    self.proc.wait(timeout=30)
                    self.fail(f"exited (code {self.proc.returncode})")
                self._buf += chunk
        line, self._buf = self._buf.split("\n", 1)
        return json.loads(line)

    def wait_ready(self, timeout: float) -> dict:
        if self.ready is None:
            self.ready = self._line(timeout)
            self.ready["start_s"] = time.perf_counter() - self.started
        return self.ready

    def request(self, label: str, prompt: list[int], timeout: float) -> dict:
        try:
            self.proc.stdin.write(json.dumps({"label": label, "prompt": prompt}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.fail("stdin closed")
        return self._line(timeout)

    def log_tail(self, chars: int = 6000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def fail(self, why: str) -> None:
        raise EngineFailed(f"engine {self.name} failed: {why}; log tail ({self.log_path}):\n{self.log_tail()}")

    def close(self, timeout: float = 120) -> None:
        """Ask the engine to exit; kill its process group if it does not."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"exit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.kill()
        self._results.close()
        self._log.close()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class Engines:
    """Starts engines with one pinned environment; a distinct warm-up prompt each."""

    def __init__(self, model_dir: Path, workdir: Path, kv_gib: int, max_model_len: int,
                 timeout: float) -> None:
        self.model_dir, self.workdir = model_dir, workdir
        self.max_model_len, self.timeout = max_model_len, timeout
        self.env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
            "PYTHONHASHSEED": "0",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
            "PYTHONPATH": str(ROOT),
        }
        self.live: list[EngineProc] = []
        self._count = 0

    def start(self, name: str, kv_transfer_config: dict | None, prefix_caching: bool = False) -> EngineProc:
        self._count += 1
        spec = {
            "model": str(self.model_dir),
            "max_model_len": self.max_model_len,
            "enable_prefix_caching": prefix_caching,
            "kv_transfer_config": kv_transfer_config,
            # Distinct per engine: a warm-up stored by engine A must not hit in engine B.
            "warmup": make_prompts(10_000 + self._count, [64])[0],
        }
        engine = EngineProc(name, spec, self.workdir, self.env)
        self.live.append(engine)
        return engine

    def wait_ready(self, engines: list[EngineProc]) -> None:
        for e in engines:
            r = e.wait_ready(self.timeout)
            print(f"  engine {e.name}: ready after {r['start_s']:.0f}s (LLM init {r['init_s']:.0f}s)", flush=True)

    def close(self, engines: list[EngineProc] | None = None) -> None:
        for e in list(engines if engines is not None else self.live):
            e.close()
            self.live.remove(e)

    def kill_all(self) -> None:
        for e in self.live:
            e.kill()
        self.live.clear()


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


def engine_groups(group_size: int) -> list[list[str]]:
    """Measuring engines alive at once: vllm_aio in every group, with up to
    ``group_size - 1`` of the others, so each ratio compares interleaved requests."""
    others = ["ExampleConnector", "prefix-cache", "recompute"]
    step = max(1, group_size - 1)
    return [["vllm_aio", *others[i:i + step]] for i in range(0, len(others), step)]


def bench_model(name: str, lengths: list[int], repeats: int, rounds: int, timeout: float,
                gap: float, group_size: int, keep: bool = False) -> dict:
    from vllm_aio.config import parse_size
    from vllm_aio.devtools.tiny_model import PRESETS, ensure_model
    from vllm_aio.pool.host_pool import SharedHostPool, slots_for

    settings = MODEL_SETTINGS.get(name, MODEL_SETTINGS["medium"])
    max_len = max(settings["max_model_len"], max(lengths) + 512)
    model_dir = ensure_model(ROOT / "models" / name, PRESETS[name])
    prompts = dict(zip(lengths, make_prompts(1000, lengths)))  # distinct prompt per length
    slot = slot_bytes(model_dir)
    workdir = Path(tempfile.mkdtemp(prefix=f"vllm_aio_ttft_{name}_"))
    pool_name = f"bench-ttft-{uuid.uuid4().hex[:12]}"
    print(f"model {name}: {model_dir} (pool value {slot} bytes; logs in {workdir})", flush=True)
    engines = Engines(model_dir, workdir, settings["kv_gib"], max_len, timeout)
    # The pool outlives engine A because this process holds it.
    holder = SharedHostPool(pool_name, slot, slots_for(parse_size("local_pool_size", POOL_SIZE), slot))
    samples: dict[str, dict[int, list[dict]]] = {s: {n: [] for n in lengths} for s in SYSTEMS}
    cold: dict[str, dict[int, dict]] = {s: {} for s in SYSTEMS}
    info: list[dict] = []

    def record(e: EngineProc) -> None:
        info.append({"engine": e.name, "start_s": e.ready["start_s"], "init_s": e.ready["init_s"],
                     "warmup": e.ready["warmup"]})

    try:
        storage = workdir / "example_storage"
        storage.mkdir()
        configs = {"ExampleConnector": example_config(storage), "vllm_aio": aio_config(pool_name),
                   "recompute": None, "prefix-cache": None}
        # Engines A: compute (and store) every prompt once, then exit.
        a = {s: engines.start(f"{s}-A", configs[s]) for s in ("ExampleConnector", "vllm_aio")}
        engines.wait_ready(list(a.values()))
        for n in lengths:
            for system, e in a.items():
                cold[system][n] = e.request(f"store/{n}", prompts[n], timeout)
                time.sleep(gap)
        for e in a.values():
            record(e)
        engines.close(list(a.values()))
        usage = holder.usage()
        print(f"  pool after engines A: {usage.num_ready} blocks ({usage.bytes_used / 2**20:.0f} MiB)", flush=True)
        groups = engine_groups(group_size)
        turn = 0
        for rnd in range(rounds):
            for gi, group in enumerate(groups):
                # The group's engines B are alive at once; their requests interleave, one at a time.
                b = {s: engines.start(f"{s}-B{rnd}g{gi}", configs[s], prefix_caching=s == "prefix-cache")
                     for s in group}
                engines.wait_ready(list(b.values()))
                time.sleep(gap)
                if "prefix-cache" in b:  # the same engine computes the prompt first
                    for n in lengths:
                        cold["prefix-cache"][n] = b["prefix-cache"].request(f"fill/{n}", prompts[n], timeout)
                        time.sleep(gap)
                for r in range(repeats):
                    for n in lengths:
                        order = group[turn % len(group):] + group[:turn % len(group)]
                        turn += 1
                        for system in order:
                            step = b[system].request(f"warm/{n}/r{r}", prompts[n], timeout)
                            samples[system][n].append({**step, "group": gi, "round": rnd})
                            time.sleep(gap)  # let the last engine's spinning threads go idle
                for e in b.values():
                    record(e)
                engines.close(list(b.values()))
    except BaseException:
        engines.kill_all()
        raise
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
                "ttft_min_s": min(s["ttft_s"] for s in ss),
                "wall_s": statistics.median(s["wall_s"] for s in ss),
                "engine_s": statistics.median(s["engine_s"] for s in ss),
                "cached_min": min(s["cached"] for s in ss),
                "cached_max": max(s["cached"] for s in ss),
                "samples_ttft_s": [s["ttft_s"] for s in ss],
                "cold_ttft_s": cold[system][n]["ttft_s"] if n in cold[system] else None,
            }
        # aio/X from the vllm_aio samples of X's own group (interleaved with X's requests).
        for system in SYSTEMS:
            if system == "vllm_aio":
                continue
            groups_of_x = {s["group"] for s in samples[system][n]}
            aio = [s["ttft_s"] for s in samples["vllm_aio"][n] if s["group"] in groups_of_x]
            xs = [s["ttft_s"] for s in samples[system][n]]
            row["vllm_aio"][f"ratio_to_{system}"] = statistics.median(aio) / statistics.median(xs)
            row["vllm_aio"][f"ratio_min_to_{system}"] = min(aio) / min(xs)
        rows.append(row)
    return {"rows": rows, "engines": info, "pool_value_bytes": slot, "groups": groups}


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
        aio = r["vllm_aio"]
        table.append((
            r["model"], str(r["prompt_tokens"]),
            fmt_ms(r["recompute"]["ttft_s"]), fmt_ms(r["ExampleConnector"]["ttft_s"]),
            fmt_ms(aio["ttft_s"]), fmt_ms(r["prefix-cache"]["ttft_s"]),
            f"{aio['ratio_to_ExampleConnector']:.2f}", f"{aio['ratio_to_prefix-cache']:.2f}",
            f"{aio['ratio_to_recompute']:.3f}",
        ))
    _print(table, "Warm-request TTFT in a fresh engine (median; ms). Ratios: median of the vllm_aio "
                  "samples taken in the same engine group (interleaved) / median of the other system")
    mins = [head[:2] + ("recompute", "Example", "vllm_aio", "prefix", "aio/Example", "aio/prefix", "aio/recomp")]
    for r in rows:
        v, aio = {s: r[s]["ttft_min_s"] for s in SYSTEMS}, r["vllm_aio"]
        mins.append((r["model"], str(r["prompt_tokens"]), *(fmt_ms(v[s]) for s in SYSTEMS),
                     f"{aio['ratio_min_to_ExampleConnector']:.2f}", f"{aio['ratio_min_to_prefix-cache']:.2f}",
                     f"{aio['ratio_min_to_recompute']:.3f}"))
    _print(mins, "Same, minimum over samples (ms)")
    cached = [("model", "tokens", "recompute", "Example", "vllm_aio", "prefix")]
    for r in rows:
        cached.append((r["model"], str(r["prompt_tokens"]),
                       *(f"{r[s]['cached_min']}" for s in SYSTEMS)))
    _print(cached, "num_cached_tokens of the warm requests (min over samples)")
    cold = [("model", "tokens", "recompute (median)", "prefix fill", "Example store", "vllm_aio store")]
    for r in rows:
        cold.append((r["model"], str(r["prompt_tokens"]), fmt_ms(r["recompute"]["ttft_s"]),
                     *(fmt_ms(r[s]["cold_ttft_s"]) for s in ("prefix-cache", "ExampleConnector", "vllm_aio"))))
    _print(cold, "Cold request (computes the prompt; connectors also save it), one sample each (ms)")


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
                        help="times to repeat the measuring phase with fresh engines")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds an engine may take to start, or to answer one request")
    parser.add_argument("--gap", type=float, default=1.5,
                        help="idle seconds between requests (vLLM workers spin ~1 s after each step)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--group-size", type=int, default=2,
                        help="measuring engines alive at once (vllm_aio + N-1 others); 4 = all, "
                             "needs ~4 GiB per medium engine")
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
            res = bench_model(name, lengths, args.repeats, args.rounds, args.timeout, args.gap,
                              args.group_size, args.keep_logs)
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
