"""`make demo`'s script against a real `vllm serve` (OpenAI API server) process.

Also the end-to-end check of observability: the connector's counters must reach
vLLM's Prometheus /metrics and its periodic "KV Transfer metrics" log line.
"""

from __future__ import annotations

import re
import subprocess
import sys

from harness.prerequisites import ROOT


def test_demo_serves_the_warm_request_from_the_pool_and_reports_it(tiny_model):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--model", str(tiny_model)],
        capture_output=True, text=True, timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    hit = re.search(r"vllm:aio_hit_tokens_total=(\d+)", out)
    assert hit and int(hit.group(1)) >= 1600, out[-2000:]
    assert re.search(r"KV Transfer metrics: pool_hit_rate=0\.\d+, hit_tokens=[1-9]", out), out[-2000:]
