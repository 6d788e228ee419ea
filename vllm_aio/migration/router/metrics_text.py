"""vLLM's Prometheus text (``GET /metrics``) read into the figures the policy weighs."""

from __future__ import annotations

import re

from vllm_aio.migration.policy import Load

_METRIC = re.compile(r'^(vllm:[a-z_]+)(?:\{([^}]*)\})? (\S+)')


def parse_load(text: str) -> Load:
    """The figures ``policy.Load`` needs from vLLM's Prometheus text (summed over engines)."""
    values: dict[str, float] = {}
    blocks = 0
    for line in text.splitlines():
        match = _METRIC.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        values[name] = values.get(name, 0.0) + float(value)
        if name == "vllm:cache_config_info":
            found = re.search(r'num_gpu_blocks="(\d+)"', labels or "")
            blocks += int(found.group(1)) if found else 0
    return Load(waiting=int(values.get("vllm:num_requests_waiting", 0)),
                preemptions=values.get("vllm:num_preemptions_total", 0.0),
                kv_usage=values.get("vllm:kv_cache_usage_perc", 0.0), kv_blocks=blocks)
