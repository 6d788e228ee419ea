"""Real vLLM engines serving timed token-id requests, one at a time, on command: the runner and its handle.

``benchmarks/ttft.py``, ``mooncake_ttft.py`` and ``gpu_ttft.py`` start each engine as
a process of its own (``EngineProc``), so every engine is fresh (as a
restarted server would be), and keep several alive at once so that they can
interleave their requests (only one of them computes at any moment). Each
request runs alone with ``max_tokens=1``: its latency is its time to first
token.

    python -m benchmarks._engine spec.json RESULT_FD

spec: {"model", "max_model_len", "enable_prefix_caching", "kv_transfer_config",
       "max_num_batched_tokens", "tensor_parallel_size", "distributed_executor_backend",
       "warmup": [ids], "warmup_at_start": bool (default true), "enforce_eager": bool (default true)},
       and where given vLLM's "load_format", "dtype", "max_num_seqs", "gpu_memory_utilization",
       "kv_cache_memory_bytes"
stdin: one JSON command per line: {"label": str, "prompt": [ids]} (or [[ids], ...]: prompts sent
       together; "reset_prefix_cache": true empties vLLM's prefix cache first, untimed; "max_tokens":
       tokens each generates, 1 unless given, never stopping early) or {"exit": true}
RESULT_FD: one JSON line per event: {"ready": true, "init_s", "warmup": step}
           after start and the warm-up request ("warmup": null without it: the first request is then
           the first command's), then one step per command:
           {"label", "prompt_len", "cached", "wall_s", "ttft_s", "ttft_mean_s", "engine_s"} (and "reset": whether
           vLLM emptied its prefix cache, when asked), and on exit {"exit": true, "aio": {counter: value}}.

``wall_s`` is the wall time of ``llm.generate``; ``ttft_s`` vLLM's own
first-token latency (request arrival to first token, ``RequestOutput.metrics``,
which needs ``disable_log_stats=False``; the slowest of prompts sent together,
``ttft_mean_s`` their mean); ``engine_s`` the engine core's
scheduled-to-first-token time (the step itself, without queueing and IPC).
``aio`` holds AioConnector's own counters (``vllm:aio_<name>_total``; empty for
other engines), read after one more short request: a load that failed is
counted (``failed_hit_tokens``) by the step after it, and ``cached`` cannot
show it (vLLM counts the tokens as cached, then recomputes them).
vLLM's log goes to stdout/stderr, results only to RESULT_FD.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from benchmarks._report import plot, plot_argument

ROOT = Path(__file__).resolve().parent.parent
MIN_HIT = 0.8  # warm requests must have at least this share of their prompt cached
BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# vLLM's arguments a spec may add (passed on where set)
ENGINE_OPTIONS = ("load_format", "dtype", "max_num_seqs", "gpu_memory_utilization", "kv_cache_memory_bytes")


# ---------------------------------------------------------------- the runner (in the engine's process)

def serve(spec_path: str, result_fd: int) -> None:
    os.set_inheritable(result_fd, False)  # not into vLLM's engine-core process
    results = os.fdopen(result_fd, "w", buffering=1)
    with open(spec_path) as f:
        spec = json.load(f)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        spec["model"],
        max_model_len=spec["max_model_len"],
        block_size=BLOCK_SIZE,
        enforce_eager=spec.get("enforce_eager", True),
        enable_prefix_caching=spec["enable_prefix_caching"],
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 8192),
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        distributed_executor_backend=spec.get("distributed_executor_backend"),
        kv_transfer_config=spec.get("kv_transfer_config"),
        disable_log_stats=False,  # RequestOutput.metrics carries the first-token latency
        seed=0,
        **{k: spec[k] for k in ENGINE_OPTIONS if k in spec},
    )
    init_s = time.perf_counter() - t0
    def step(label: str, prompt: list[int] | list[list[int]], max_tokens: int = 1) -> dict:
        """One prompt, or several sent together (one ``generate``: they share its steps); for several,
        the slowest first token and the sums of their prompt and cached tokens."""
        batch = prompt if prompt and isinstance(prompt[0], list) else [prompt]
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        wall = time.perf_counter() - start
        ttft = engine = 0.0
        firsts = []
        for m in (out.metrics for out in outs if out.metrics is not None):
            firsts.append(getattr(m, "first_token_latency", 0.0))
            ttft = max(ttft, firsts[-1])
            engine = max(engine, (m.first_token_ts - m.scheduled_ts) if m.scheduled_ts else 0.0)
        cached, total = sum(o.num_cached_tokens for o in outs), sum(len(o.prompt_token_ids) for o in outs)
        print(f"[bench] {label}: wall={wall * 1e3:.1f}ms ttft={ttft * 1e3:.1f}ms "
              f"engine={engine * 1e3:.1f}ms cached={cached}/{total}", flush=True)
        return {"label": label, "prompt_len": total, "cached": cached,
                "wall_s": wall, "ttft_s": ttft if ttft > 0 else wall,
                "ttft_mean_s": sum(firsts) / len(firsts) if firsts and ttft > 0 else wall, "engine_s": engine,
                "t": time.time()}

    warmup = step("warmup", spec["warmup"]) if spec.get("warmup_at_start", True) else None
    results.write(json.dumps({"ready": True, "init_s": init_s, "warmup": warmup}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("exit"):
            break
        # Before the step: its latency is the request's alone. False when vLLM refused (blocks in use).
        reset = {"reset": llm.reset_prefix_cache()} if cmd.get("reset_prefix_cache") else {}
        results.write(json.dumps({**step(cmd["label"], cmd["prompt"], cmd.get("max_tokens", 1)), **reset}) + "\n")
    step("flush", spec["warmup"][:8])  # the step that reports the last request's failed loads
    prefix = "vllm:aio_"
    counters = {m.name[len(prefix):]: m.value for m in llm.get_metrics() if m.name.startswith(prefix)}
    results.write(json.dumps({"exit": True, "aio": counters}) + "\n")
    results.close()


# ---------------------------------------------------------------- the handle (in the benchmark's process)

def thread_binding() -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for the engines: the caller's where set (with its
    ``OMP_NUM_THREADS``, passed on with the environment), else every core, pinned.

    Pinned, engines started side by side (the test suite's smoke runs) each put their first
    OpenMP thread on core 0; the suite runs them unpinned (``tests/conftest.THREADS``).
    """
    return {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")}


class EngineFailed(RuntimeError):
    pass


def aio_transfer_config(extra: dict) -> dict:
    """``kv_transfer_config`` of AioConnector with ``extra`` as its settings (failed loads recomputed)."""
    return {"kv_connector": "AioConnector", "kv_connector_module_path": "vllm_aio.connector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def offloading_transfer_config(cpu_bytes: int) -> dict:
    """``kv_transfer_config`` of vLLM's in-tree OffloadingConnector with a CPU tier of ``cpu_bytes`` (0.23's form)."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}


def kv_bytes_per_token(model_dir: Path, dtype: str | None = None) -> int:
    """K and V of one token in every layer, as the model's config.json shapes them (in ``dtype`` where
    the model is served in another than its config's)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype = dtype or cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * DTYPE_BYTES[dtype]


def value_bytes(model_dir: Path) -> int:
    """One pool value as the worker sizes it: the entry header, then one block of every layer."""
    from vllm_aio.pool.entry import HEADER_BYTES

    return HEADER_BYTES + BLOCK_SIZE * kv_bytes_per_token(model_dir)


def make_prompts(seed: int, lengths: list[int], vocab: int = 2048) -> list[list[int]]:
    """Random token-id prompts (ids 3.. skip the special tokens); as tests/conftest.py."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


class EngineProc:
    """One engine subprocess (this module) that serves one request per command."""

    def __init__(self, name: str, spec: dict, workdir: Path, env: dict[str, str]) -> None:
        self.name = name
        tag = f"{name}-{uuid.uuid4().hex[:6]}"
        self.spec_path = workdir / f"{tag}.json"
        self.log_path = workdir / f"{tag}.log"
        self.spec_path.write_text(json.dumps(spec))
        read_fd, write_fd = os.pipe()
        self._log = open(self.log_path, "w")
        self.started = time.perf_counter()
        # Own session: on failure the whole engine (runner + engine core + workers) is killed by pgid.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks._engine", str(self.spec_path), str(write_fd)],
            env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
            pass_fds=(write_fd,), start_new_session=True, text=True,
        )
        os.close(write_fd)
        self._results = os.fdopen(read_fd, "r")
        self._buf = ""
        self.ready: dict | None = None
        self.counters: dict[str, float] | None = None  # AioConnector's, once closed

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

    def request(self, label: str, prompt: list[int] | list[list[int]], timeout: float,
                reset_prefix_cache: bool = False, max_tokens: int = 1) -> dict:
        cmd = {"label": label, "prompt": prompt, "reset_prefix_cache": reset_prefix_cache, "max_tokens": max_tokens}
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.fail("stdin closed")
        return self._line(timeout)

    def log_tail(self, chars: int = 6000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def fail(self, why: str) -> None:
        raise EngineFailed(f"engine {self.name} failed: {why}; log tail ({self.log_path}):\n{self.log_tail()}")

    def ask_exit(self) -> None:
        """Tell the engine to exit (it answers with its counters, see ``close``)."""
        try:
            self.proc.stdin.write(json.dumps({"exit": True}) + "\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def close(self, timeout: float = 120) -> None:
        """Let the engine exit (reading its counters); kill its process group if it does not."""
        if not self.proc.stdin.closed:
            self.ask_exit()
        try:  # its last line may be waiting in the pipe after it exited
            self.counters = self._line(timeout)["aio"]
            self.proc.wait(timeout=timeout)
        except (OSError, ValueError, subprocess.TimeoutExpired, EngineFailed):
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

    def info(self) -> dict:
        ready = self.ready or {}
        return {"engine": self.name, "start_s": ready.get("start_s"), "init_s": ready.get("init_s"),
                "warmup": ready.get("warmup"), "aio": self.counters}


class Engines:
    """Starts engines of one model with one pinned environment, each with a warm-up prompt of its own;
    keeps what every closed engine reported (``info``)."""

    def __init__(self, model_dir: Path, workdir: Path, max_model_len: int, timeout: float,
                 env: dict[str, str], seed: int = 10_000) -> None:
        self.model_dir, self.workdir = model_dir, workdir
        self.max_model_len, self.timeout, self.seed = max_model_len, timeout, seed
        self.env = {
            **env,
            "PYTHONHASHSEED": "0",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        }
        self.live: list[EngineProc] = []
        self.info: list[dict] = []
        self.count = 0  # engines started

    def start(self, name: str, kv_transfer_config: dict | None, prefix_caching: bool = False,
              env: dict[str, str] | None = None, **spec) -> EngineProc:
        self.count += 1
        spec = {
            "model": str(self.model_dir),
            "max_model_len": self.max_model_len,
            "enable_prefix_caching": prefix_caching,
            "kv_transfer_config": kv_transfer_config,
            # Distinct per engine: a warm-up stored by engine A must not hit in engine B.
            "warmup": make_prompts(self.seed + self.count, [64])[0],
            **spec,
        }
        engine = EngineProc(name, spec, self.workdir, {**self.env, **(env or {})})
        self.live.append(engine)
        return engine

    def wait_ready(self, engines: list[EngineProc]) -> None:
        for e in engines:
            r = e.wait_ready(self.timeout)
            print(f"  engine {e.name}: ready after {r['start_s']:.0f}s (LLM init {r['init_s']:.0f}s)", flush=True)

    def close(self, engines: list[EngineProc]) -> None:
        for e in engines:  # they shut down side by side
            e.ask_exit()
        for e in engines:
            e.close()
            self.live.remove(e)
            self.info.append(e.info())

    def kill(self, engine: EngineProc) -> None:
        engine.kill()
        self.live.remove(engine)
        self.info.append(engine.info())

    def kill_all(self) -> None:
        for e in list(self.live):
            self.kill(e)


# ---------------------------------------------------------------- options and results

def engine_arguments(parser: argparse.ArgumentParser, systems: tuple[str, ...]) -> None:
    """The options of both engine benchmarks."""
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--systems", default=None, help=f"which of {','.join(systems)} to run "
                                                        "(vllm_aio always; default: all, --quick: vllm_aio)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds an engine may take to start, or to answer one request")
    parser.add_argument("--gap", type=float, default=1.5,
                        help="idle seconds between requests (vLLM workers spin ~1 s after each step)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the engines' specs and logs")
    plot_argument(parser)


def plot_ttft(rows: list[dict], systems: list[str], path: Path, title: str, label: str) -> None:
    """Median warm TTFT against prompt length, a line per system and per ``row[label]`` (model, TP)."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        for system in systems:
            cell = row.get(system)
            if cell and cell.get("ttft_s") is not None:
                xs, ys = series.setdefault(f"{label}={row[label]} {system}", ([], []))
                xs.append(row["prompt_tokens"])
                ys.append(cell["ttft_s"] * 1e3)
    plot(path, title, ("prompt tokens", "TTFT ms (median)"), series, log="y")


def chosen(args: argparse.Namespace, systems: tuple[str, ...]) -> tuple[list[int], list[str]]:
    """The prompt lengths and the systems to run, after ``--quick``'s settings: one 256-token prompt,
    once, vllm_aio alone unless ``--systems`` names more."""
    if args.quick:
        args.lengths, args.systems = "256", args.systems or "vllm_aio"
        args.repeats, args.gap, args.timeout = 1, 0.0, min(args.timeout, 300)
    names = (args.systems or ",".join(systems)).split(",")
    return [int(x) for x in args.lengths.split(",") if x], [s for s in systems if s in names or s == "vllm_aio"]


def summarize(steps: list[dict], cold: dict | None, error: str | None = None) -> dict:
    """One system at one prompt length: its warm requests (``steps``) and the request that stored it."""
    if not steps:
        return {"error": error or "no samples"}
    return {
        "ttft_s": statistics.median(s["ttft_s"] for s in steps),
        "ttft_min_s": min(s["ttft_s"] for s in steps),
        "wall_s": statistics.median(s["wall_s"] for s in steps),
        "engine_s": statistics.median(s["engine_s"] for s in steps),
        "cached_min": min(s["cached"] for s in steps),
        "cached_max": max(s["cached"] for s in steps),
        "samples": steps,
        "cold": cold,
    }


def check_hits(row: dict, hitting: list[str]) -> list[str]:
    """What is wrong with a row: recompute hit something, or a system of ``hitting`` served too little."""
    n, bad = row.get("batch_tokens", row["prompt_tokens"]), []  # prompts sent together: all their tokens
    rec = row.get("recompute", {})
    if rec and "error" not in rec and rec["cached_max"] != 0:
        bad.append(f"recompute cached {rec['cached_max']} tokens (want 0)")
    for s in hitting:
        if "error" in row[s]:
            bad.append(f"{s} failed: {row[s]['error'].splitlines()[0]}")
        elif row[s]["cached_min"] < MIN_HIT * n:
            bad.append(f"{s} cached only {row[s]['cached_min']}/{n} tokens (want >= {MIN_HIT:.0%})")
    return bad


def check_loads(info: list[dict]) -> list[str]:
    """Engines whose AioConnector counted hits it then failed to load (vLLM recomputed them)."""
    return [f"engine {e['engine']}: {e['aio']['failed_hit_tokens']:g} hit tokens failed to load (recomputed)"
            for e in info if (e["aio"] or {}).get("failed_hit_tokens")]


def exit_code(problems: list[str]) -> int:
    for p in problems:
        print(f"HIT CHECK FAILED: {p}")
    return 2 if problems else 0


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
