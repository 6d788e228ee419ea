"""Connector statistics, reported through vLLM's ``KVConnectorStats``.

Workers record transfers; vLLM sums the dicts over workers and steps
(``aggregate``), prints ``reduce()`` in its periodic "KV Transfer metrics" log
line and feeds the same dict to ``AioPromMetrics.observe`` for ``/metrics``.
Lookup counts come from the scheduler through the step metadata and are
recorded by rank 0 only, so TP does not multiply them. ``failed_hit_tokens``
are tokens the scheduler counted as hits whose load then failed on some rank
(vLLM recomputed them): the gap between what the pool promised and delivered.

Beside the counters, the stats carry the backend's latest readings of the pool
(``Backend.gauges``: fill, evictions), taken when a worker hands over its stats;
they are not summed: the latest wins, and TP ranks of one pool read the same.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    "save_seconds",  # each save's copy out of the KV cache (saves.py), not the pool puts after it
    "save_already_stored",  # blocks not saved because the pool held them already
    "save_failures",
    "save_dropped",  # blocks never offered to the pool: the puts of earlier saves held the staging
    *TIER_COUNTERS,
)
# Counters under their former name, exported until the next release: old name -> new name.
DEPRECATED_COUNTERS = {"save_skipped": "save_already_stored"}
# The backend's readings of the pool (``Backend.gauges``), each with what it is.
GAUGES = {
    "pool_used_bytes": "bytes of the pool's memory that hold values",
    "pool_capacity_bytes": "bytes of memory the pool has",
    "pool_stored_values": "values the pool holds",
    "pool_evicted_values": "values the pool evicted since it was created",
}


@dataclass
class AioConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, **amounts: float) -> None:
        for name, amount in amounts.items():
            self.data[name] += amount

    def set_gauges(self, readings: Mapping[str, float]) -> None:
        """The backend's latest readings of the pool, replacing earlier ones."""
        if unknown := sorted(set(readings) - set(GAUGES)):
            raise KeyError(", ".join(unknown))
        self.data.update(readings)

    def reset(self) -> None:
        self.data = {name: 0 for name in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> "AioConnectorStats":
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        # The other is a later step or another rank of the same pool: its readings stand.
        self.data.update((name, other.data[name]) for name in GAUGES if name in other.data)
        return self

    def is_empty(self) -> bool:
        # Readings alone are no news: an idle instance reports nothing.
        return not any(self.data[name] for name in COUNTERS)

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        looked_up = d["hit_tokens"] + d["miss_tokens"]
        loaded, saved = round(d["load_bytes"] / 2**20, 2), round(d["save_bytes"] / 2**20, 2)
        # Bytes over the summed latencies of the batches, which overlap: the rate a
        # batch moved at, not the throughput over the interval.
        load_rate, save_rate = _rate(d["load_bytes"], d["load_seconds"]), _rate(d["save_bytes"], d["save_seconds"])
        return {
            "pool_hit_rate": round(d["hit_tokens"] / looked_up, 3) if looked_up else 0.0,
            "hit_tokens": d["hit_tokens"],
            "failed_hit_tokens": d["failed_hit_tokens"],
            "loaded_MiB": loaded,
            "load_batch_GBps": load_rate,
            "saved_MiB": saved,
            "save_batch_GBps": save_rate,
            "load_failures": d["load_failures"],
            "save_failures": d["save_failures"],
            "save_dropped": d["save_dropped"],
            **{name: d[name] for name in TIER_COUNTERS if d[name]},  # only where a tiered store counts
            # The same figures under their former names, until the next release.
            "loaded_MB": loaded,
            "load_GBps": load_rate,
            "saved_MB": saved,
            "save_GBps": save_rate,
        }


def _rate(nbytes: float, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else 0.0


class AioPromMetrics(KVConnectorPromMetrics):
    """One ``vllm:aio_<counter>_total`` Prometheus counter per statistic, one
    ``vllm:aio_<reading>`` gauge per reading of the pool."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, documentation: str):
            metric = self._counter_cls(name=f"vllm:aio_{name}", documentation=documentation, labelnames=labelnames)
            return create_metric_per_engine(metric, per_engine_labelvalues)

        # (the statistic, its counter per engine): a former name counts the same statistic.
        self._counters = [
            *((name, counter(name, f"vllm_aio connector: {name.replace('_', ' ')}")) for name in COUNTERS),
            *((new, counter(old, f"vllm_aio connector: deprecated, goes in the next release: vllm:aio_{new}_total"))
              for old, new in DEPRECATED_COUNTERS.items()),
        ]
        self._gauges = {
            name: create_metric_per_engine(
                self._gauge_cls(name=f"vllm:aio_{name}", documentation=f"vllm_aio connector: {what}",
                                multiprocess_mode="mostrecent", labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, what in GAUGES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters:
            amount = transfer_stats_data.get(name, 0)
            if amount:
                per_engine[engine_idx].inc(amount)
        for name, per_engine in self._gauges.items():
            if name in transfer_stats_data:
                per_engine[engine_idx].set(transfer_stats_data[name])
