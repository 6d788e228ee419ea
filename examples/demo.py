"""Cold vs warm time-to-first-token through vLLM's OpenAI server with vllm_aio.

Starts an OpenAI-compatible vLLM server on a local model with the AioConnector on
its embedded host-memory pool, sends a COLD request and then a WARM one that
shares a ~2000-token prefix, and prints prompt tokens, cached tokens and TTFT.
vLLM's own prefix caching is off, so every cached token of the warm request was
loaded from the vllm_aio pool. Exits non-zero if the warm request did not hit.

    .venv/bin/python examples/demo.py --model models/tiny   # what `make demo` runs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests

from vllm_aio.devtools.serve import free_port, vllm_server, wait_healthy

KV_TRANSFER_CONFIG = {
    "kv_connector": "AioConnector",
    "kv_role": "kv_both",
    # vLLM's default "fail" fails a request whose block was evicted between the
    # scheduler's lookup and the worker's load; recompute it instead.
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"local_pool_size": "1GB"},
}
SERVER_ARGS = [
    "--block-size", "32",  # the CPU attention backend needs a multiple of 32
    "--max-model-len", "4096",
    "--no-enable-prefix-caching",  # a warm hit can then only come from our pool
    "--enforce-eager",
    "--enable-prompt-tokens-details",  # reports usage.prompt_tokens_details.cached_tokens
]
PARAGRAPH = (
    "The scheduler asks the pool which prefix blocks it already holds, the worker "
    "copies those blocks into the paged cache before the forward pass, and only the "
    "remaining tokens of the prompt are computed again. "
)
MIN_HIT_FRACTION = 0.8


@dataclass
class Result:
    name: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    text: str
    token_ids: list[int]


@contextlib.contextmanager
def demo_server(model: str, port: int, log_path: Path, connector: bool) -> Iterator[subprocess.Popen]:
    # Stats every second, so the connector's "KV Transfer metrics" line shows up.
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOG_STATS_INTERVAL": "1"}
    with vllm_server(model, port, log_path, SERVER_ARGS, KV_TRANSFER_CONFIG if connector else None, env) as proc:
        yield proc


def count_tokens(base: str, model: str, text: str) -> int:
    r = requests.post(f"{base}/tokenize", json={"model": model, "prompt": text}, timeout=30)
    r.raise_for_status()
    return r.json()["count"]


def build_prefix(base: str, model: str, target_tokens: int) -> str:
    # Count with the server's own tokenizer so the prompt is ~target tokens for any model.
    per_paragraph = count_tokens(base, model, PARAGRAPH)
    return PARAGRAPH * max(1, round(target_tokens / per_paragraph))


def complete(base: str, model: str, name: str, prompt: str, max_tokens: int) -> Result:
    """One streamed completion; TTFT is the time to the first chunk carrying a token.

    Counted by token, not by non-empty text: a token can decode to "" (a special
    or partial token), which would push a text-based TTFT past the prefill.
    """
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,  # vLLM extension: each chunk names its tokens
    }
    start = time.perf_counter()
    ttft, text, token_ids, usage = None, "", [], None
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: "):])
            for choice in chunk.get("choices", []):
                if choice.get("token_ids") or choice.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                text += choice.get("text") or ""
                token_ids += choice.get("token_ids") or []
            usage = chunk.get("usage") or usage
    if ttft is None or usage is None:
        raise RuntimeError(f"{name}: no token or no usage in the stream")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Result(name, usage["prompt_tokens"], cached, ttft, text, token_ids)


def warm_up(base: str, model: str, prefix_tokens: int) -> None:
    """The shown pair's paths once, on a prefix of its own, before the pair.

    A first long prefill and a first pool store and load each pay one-time
    costs (kernel selection for new shapes, the pool's compiled copy loops
    compiled on a fresh machine): left in the shown pair they made the first
    `make demo` show warm/cold 0.49 where a second run showed 0.07. No block
    of this prefix is shared with the shown pair's: its first words differ.
    """
    prefix = "Warm-up. " + build_prefix(base, model, prefix_tokens)
    complete(base, model, "warm-up store", prefix + "Question: what is stored?", 2)
    complete(base, model, "warm-up load", prefix + "Question: what is loaded?", 2)


def pool_counters(base: str) -> dict[str, float]:
    """The connector's Prometheus counters (vllm:aio_*) from the server's /metrics."""
    counters: dict[str, float] = {}
    for line in requests.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:aio_") and "_total" in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            counters[name] = counters.get(name, 0.0) + value
    return counters


def last_transfer_log_line(log_path: Path) -> str | None:
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if "KV Transfer metrics" in ln]
    return lines[-1].split("] ", 1)[-1] if lines else None


def print_table(results: list[Result]) -> None:
    print(f"\n{'request':<8} {'prompt tok':>10} {'cached tok':>10} {'TTFT ms':>9}  generated (first words)")
    for r in results:
        # The tiny model's random weights often pick ids that decode to nothing: show ids then.
        shown = repr(" ".join(r.text.split()[:6])) if r.text.strip() else f"ids {r.token_ids[:6]}"
        print(f"{r.name:<8} {r.prompt_tokens:>10} {r.cached_tokens:>10} {r.ttft_s * 1e3:>9.1f}  {shown}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--startup-timeout", type=float, default=180.0)
    parser.add_argument("--no-connector", action="store_true", help="baseline: plain vLLM, no vllm_aio")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress lines show up live under make
    # Turn `kill <demo>` into an exception too, so the server is always stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    connector = not args.no_connector
    log_path = Path(tempfile.mkdtemp(prefix="vllm_aio_demo_")) / "server.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    print(f"server log: {log_path}")
    print(f"connector: {'AioConnector, embedded pool (local_pool_size 1GB)' if connector else 'none (baseline)'}")
    print("vLLM prefix caching: OFF (--no-enable-prefix-caching), so warm cached tokens come only from the pool")

    with demo_server(args.model, port, log_path, connector) as proc:
        t0 = time.monotonic()
        try:
            wait_healthy(proc, base, log_path, args.startup_timeout)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 2
        print(f"server healthy on {base} after {time.monotonic() - t0:.1f} s")

        warm_up(base, args.model, args.prefix_tokens)
        prefix = build_prefix(base, args.model, args.prefix_tokens)
        # Same prefix, different last words: only the shared whole blocks can hit.
        cold = complete(base, args.model, "cold", prefix + "Question: what is reused?", args.max_tokens)
        warm = complete(base, args.model, "warm", prefix + "Question: what is recomputed?", args.max_tokens)
        print_table([cold, warm])
        print(f"\nwarm/cold TTFT ratio: {warm.ttft_s / cold.ttft_s:.2f}")
        hit = warm.cached_tokens / warm.prompt_tokens
        print(f"warm cached fraction: {hit:.1%} of the prompt")
        if connector:
            time.sleep(1.5)  # let one stats interval pass
            counters = pool_counters(base)
            print("\nPrometheus /metrics: " + ", ".join(f"{k}={v:g}" for k, v in sorted(counters.items())))
            print(f"server log: {last_transfer_log_line(log_path)}")
        print("stopping the server ...")
    if connector and hit < MIN_HIT_FRACTION:
        print(f"FAIL: warm request cached < {MIN_HIT_FRACTION:.0%} of its prompt", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the server was already stopped on the way out
        print("interrupted", file=sys.stderr)
        sys.exit(130)
