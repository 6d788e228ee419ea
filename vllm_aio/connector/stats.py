"""Connector statistics, reported through vLLM's ``KVConnectorStats``.

Workers record transfers; vLLM sums the dicts over workers and steps
(``aggregate``), prints ``reduce()`` in its periodic "KV Transfer metrics" log
line and feeds the same dict to ``AioPromMetrics.observe`` for ``/metrics``.
Lookup counts come from the scheduler through the step metadata and are
recorded by rank 0 only, so TP does not multiply them. ``failed_hit_tokens``
are tokens the scheduler counted as hits whose load then failed on some rank
(vLLM recomputed them): the gap between what the pool promised and delivered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

# The tiered store's (backends/tiered.py): values loaded from each tier, and
# values saved in the local tier that never reached the remote one.
TIER_COUNTERS = ("local_tier_hits", "remote_tier_hits", "remote_tier_dropped")
COUNTERS = (
    "hit_tokens",
    "miss_tokens",
    "failed_hit_tokens",  # counted as hits at lookup, then not loaded: recomputed
    "load_blocks",
    "load_bytes",
    "load_seconds",
    "load_failures",
    "save_blocks",
    "save_bytes",
    "save_seconds",
    "save_skipped",
    "save_failures",
    *TIER_COUNTERS,
)


@dataclass
class AioConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, **amounts: float) -> None:
        for name, amount in amounts.items():
            self.data[name] += amount

    def reset(self) -> None:
        self.data = {name: 0 for name in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> "AioConnectorStats":
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        return self

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        looked_up = d["hit_tokens"] + d["miss_tokens"]
        return {
            "pool_hit_rate": round(d["hit_tokens"] / looked_up, 3) if looked_up else 0.0,
            "hit_tokens": d["hit_tokens"],
            "failed_hit_tokens": d["failed_hit_tokens"],
            "loaded_MB": round(d["load_bytes"] / 2**20, 2),
            "load_GBps": _rate(d["load_bytes"], d["load_seconds"]),
            "saved_MB": round(d["save_bytes"] / 2**20, 2),
            "save_GBps": _rate(d["save_bytes"], d["save_seconds"]),
            "load_failures": d["load_failures"],
            "save_failures": d["save_failures"],
            **{name: d[name] for name in TIER_COUNTERS if d[name]},  # only where a tiered store counts
        }


def _rate(nbytes: float, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else 0.0


class AioPromMetrics(KVConnectorPromMetrics):
    """One ``vllm:aio_<counter>_total`` Prometheus counter per statistic."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:aio_{name}",
                    documentation=f"vllm_aio connector: {name.replace('_', ' ')}",
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for name in COUNTERS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters.items():
            amount = transfer_stats_data.get(name, 0)
            if amount:
                per_engine[engine_idx].inc(amount)
