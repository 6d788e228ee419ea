"""Soak: the load test's traffic for N minutes through ``vllm serve`` with the connector, one table.

200 streamed requests over 20 shared prefixes of 1-4k tokens, 32 in flight,
a pool holding about a third of the working set (so it evicts all along),
repeated in passes (each pass in another order) until the time is up. A
no-connector server runs the same 200 requests once first: every output of the
soak is compared with it, token for token until it parts at a near tie, logprobs within
1e-3 (float32 serving, ``vllm_aio/devtools/load.py``).

The table: requests, errors, wrong outputs, TTFT p50/p99 of requests that hit
the pool and of those that did not (the no-connector run's beside them),
evictions (embedded pool), load failures by cause (from the connector's log
lines), and the growth of each server process's resident memory from the end
of the first pass to the end of the last.

    .venv/bin/python -m benchmarks.soak [--backend local|mooncake] [--minutes 10] [--quick]
"""

from __future__ import annotations

import random
import re
import sys
import tempfile
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

from benchmarks._engine import ROOT
from benchmarks._report import arguments, print_markdown, write_results
from vllm_aio.devtools.load import (
    SERVER_ENV, LoadMix, Outcome, compare, read_metrics, run_load, server_args,
)
from vllm_aio.devtools.serve import free_port, vllm_server, wait_healthy

TOLERANCE = 1e-3
CAUSE = re.compile(r"pool blocks could not be loaded \(([^)]*)\)")


def kv_config(backend: str, pool_size: str, pool_config: dict) -> dict:
    extra = {"local_pool_size": pool_size, "local_pool_name": f"soak-{uuid.uuid4().hex[:8]}"}
    if backend == "mooncake":
        extra = {"backend": "mooncake", **pool_config}
    return {"kv_connector": "AioConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


def group_rss_mb(pgid: int) -> dict[str, float]:
    """Resident memory of every process of the server's group, by process name."""
    out: dict[str, float] = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if int(Path(status.parent, "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        name = f"{fields['Name'].strip()}[{status.parent.name}]"
        out[name] = int(fields.get("VmRSS", "0 kB").split()[0]) / 1024
    return out


def serve(model: str, log: Path, config: dict | None, max_num_seqs: int):
    port = free_port()
    return f"http://127.0.0.1:{port}", vllm_server(model, port, log, server_args(max_num_seqs), config, SERVER_ENV)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = arguments(__doc__, "soak")
    parser.add_argument("--backend", choices=("local", "mooncake"), default="local")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny"))
    args = parser.parse_args()
    started = time.perf_counter()
    mix = LoadMix(num_requests=200, num_prefixes=20, prefix_tokens=(1024, 4096))
    concurrency, pool_size, minutes = 32, "96MB", args.minutes
    if args.quick:
        mix = LoadMix(num_requests=16, num_prefixes=3, prefix_tokens=(512, 1024))
        concurrency, pool_size, minutes = 8, "8MB", 0.0
    prompts = mix.prompts()
    work = Path(tempfile.mkdtemp(prefix="vllm_aio_soak_"))
    print(f"logs: {work}")

    base, server = serve(args.model, work / "baseline.log", None, concurrency)
    with server as proc:
        wait_healthy(proc, base, work / "baseline.log", 600)
        reference = run_load(base, args.model, prompts, concurrency, mix.max_tokens)
    if any(o.error for o in reference):
        raise SystemExit(f"the no-connector run failed: {[o.error for o in reference if o.error][:3]}")

    with ExitStack() as stack:
        pool_config: dict = {}
        if args.backend == "mooncake":
            from vllm_aio.devtools.mooncake_pool import MooncakePool

            pool_config = stack.enter_context(MooncakePool(pool_size, log_dir=work / "mooncake")).config
        config = kv_config(args.backend, pool_size, pool_config)
        base, server = serve(args.model, work / "soak.log", config, concurrency)
        proc = stack.enter_context(server)
        wait_healthy(proc, base, work / "soak.log", 600)
        passes, outcomes, wrong, rss_first = 0, [], 0, {}
        deadline = time.monotonic() + minutes * 60
        while passes == 0 or time.monotonic() < deadline:
            order = list(range(len(prompts)))
            random.Random(passes).shuffle(order)
            got = run_load(base, args.model, [prompts[i] for i in order], concurrency, mix.max_tokens)
            for outcome, i in zip(got, order):
                outcome.index = i
            got.sort(key=lambda o: o.index)
            wrong += len(compare(got, reference, TOLERANCE).wrong)
            outcomes += got
            passes += 1
            if passes == 1:
                rss_first = group_rss_mb(proc.pid)
            print(f"pass {passes}: {len(outcomes)} requests, {wrong} wrong, "
                  f"{sum(o.error is not None for o in outcomes)} errors", flush=True)
        rss_last = group_rss_mb(proc.pid)
        metrics = read_metrics(base)
        evictions = None
        if args.backend == "local":
            from vllm_aio.pool.inspect import snapshot

            evictions = snapshot(config["kv_connector_extra_config"]["local_pool_name"]).usage.evictions
    causes: Counter[str] = Counter()
    for match in CAUSE.finditer((work / "soak.log").read_text(errors="replace")):
        for part in match.group(1).split(", "):
            n, cause = part.split(" ", 1)
            causes[cause] += int(n)
    report(args, started, mix, concurrency, pool_size, passes, outcomes, reference, wrong, metrics, evictions,
           causes, rss_first, rss_last)
    return 0 if wrong == 0 and not any(o.error for o in outcomes) else 1


def report(args, started: float, mix: LoadMix, concurrency: int, pool_size: str, passes: int, outcomes: list[Outcome],
           reference: list[Outcome], wrong: int, metrics: dict[str, float], evictions: int | None,
           causes: Counter[str], rss_first: dict[str, float], rss_last: dict[str, float]) -> None:
    hits = [o.ttft_s * 1e3 for o in outcomes if o.ttft_s is not None and o.cached_tokens > 0]
    misses = [o.ttft_s * 1e3 for o in outcomes if o.ttft_s is not None and o.cached_tokens == 0]
    recompute = [o.ttft_s * 1e3 for o in reference if o.ttft_s is not None]
    errors = sum(o.error is not None for o in outcomes)
    failed = int(metrics.get("vllm:aio_failed_hit_tokens_total", 0))
    rows = [
        ["backend", args.backend], ["passes", str(passes)], ["requests", str(len(outcomes))],
        ["errors", str(errors)], ["wrong outputs", str(wrong)],
        ["concurrency / prompts / prefixes", f"{concurrency} / {mix.num_requests} / {mix.num_prefixes}"],
        ["pool", pool_size],
        ["requests that hit", f"{len(hits)} ({len(hits) / max(1, len(outcomes)):.0%})"],
        ["TTFT p50 / p99, hit (ms)", f"{percentile(hits, .5):.0f} / {percentile(hits, .99):.0f}"],
        ["TTFT p50 / p99, miss (ms)", f"{percentile(misses, .5):.0f} / {percentile(misses, .99):.0f}"],
        ["TTFT p50 / p99, no connector (ms)", f"{percentile(recompute, .5):.0f} / {percentile(recompute, .99):.0f}"],
        ["pool hit tokens / failed hit tokens", f"{int(metrics.get('vllm:aio_hit_tokens_total', 0))} / {failed}"],
        ["evictions", "n/a (Mooncake's master evicts)" if evictions is None else str(evictions)],
        ["save failures (pool full)", str(int(metrics.get("vllm:aio_save_failures_total", 0)))],
        ["load failures by cause", ", ".join(f"{n} {c}" for c, n in causes.most_common()) or "none"],
    ]
    for name in sorted(rss_last):
        if name in rss_first:
            rows.append([f"RSS {name} (MB)", f"{rss_first[name]:.0f} -> {rss_last[name]:.0f} "
                                             f"({rss_last[name] - rss_first[name]:+.0f})"])
    print_markdown(["soak", "value"], rows, left=1, title=f"soak, {args.backend}, {passes} passes")
    write_results(args.json, "soak", started, backend=args.backend, passes=passes, requests=len(outcomes),
                  errors=errors, wrong=wrong, table=rows)


if __name__ == "__main__":
    sys.exit(main())
