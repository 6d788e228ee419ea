"""Unit tests of ``vllm_aio.connector.stats.AioConnectorStats`` (no engine started)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from vllm_aio.connector.connector import AioConnector
from vllm_aio.connector.stats import COUNTERS, GAUGES, AioConnectorStats, AioPromMetrics

READINGS = {"pool_used_bytes": 3 << 20, "pool_capacity_bytes": 1 << 30, "pool_stored_values": 12,
            "pool_evicted_values": 5}


def test_new_stats_hold_every_counter_at_zero_and_are_empty():
    stats = AioConnectorStats()
    assert stats.data == {name: 0 for name in COUNTERS}
    assert stats.is_empty()


def test_add_increments_named_counters_only():
    stats = AioConnectorStats()
    stats.add(load_blocks=2, load_bytes=4096)
    stats.add(load_blocks=1)
    assert stats.data["load_blocks"] == 3
    assert stats.data["load_bytes"] == 4096
    assert all(stats.data[n] == 0 for n in COUNTERS if n not in ("load_blocks", "load_bytes"))


def test_add_accepts_float_seconds():
    stats = AioConnectorStats()
    stats.add(save_seconds=0.25)
    stats.add(save_seconds=0.5)
    assert stats.data["save_seconds"] == pytest.approx(0.75)


def test_add_of_unknown_counter_raises():
    with pytest.raises(KeyError):
        AioConnectorStats().add(no_such_counter=1)


def test_any_nonzero_counter_makes_stats_non_empty():
    for name in COUNTERS:
        stats = AioConnectorStats()
        stats.add(**{name: 1})
        assert not stats.is_empty(), name


def test_reset_zeroes_every_counter():
    stats = AioConnectorStats()
    stats.add(hit_tokens=5, save_failures=1)
    stats.reset()
    assert stats.data == {name: 0 for name in COUNTERS}
    assert stats.is_empty()


def test_aggregate_sums_counters_into_self_and_returns_self():
    a, b = AioConnectorStats(), AioConnectorStats()
    a.add(hit_tokens=10, load_bytes=100)
    b.add(hit_tokens=5, miss_tokens=7)
    result = a.aggregate(b)
    assert result is a
    assert (a.data["hit_tokens"], a.data["miss_tokens"], a.data["load_bytes"]) == (15, 7, 100)
    assert b.data["hit_tokens"] == 5  # the other is left as it was


def test_aggregate_treats_counters_missing_from_the_other_as_zero():
    a = AioConnectorStats()
    a.add(save_blocks=2)
    a.aggregate(KVConnectorStats(data={"save_blocks": 3}))
    assert a.data["save_blocks"] == 5
    assert a.data["load_blocks"] == 0


def test_reduce_of_empty_stats_reports_zero_rates():
    assert AioConnectorStats().reduce() == {
        "pool_hit_rate": 0.0,
        "hit_tokens": 0,
        "failed_hit_tokens": 0,
        "loaded_MiB": 0.0,
        "load_batch_GBps": 0.0,
        "saved_MiB": 0.0,
        "save_batch_GBps": 0.0,
        "load_failures": 0,
        "save_failures": 0,
        "save_dropped": 0,
        "loaded_MB": 0.0,
        "load_GBps": 0.0,
        "saved_MB": 0.0,
        "save_GBps": 0.0,
    }


def test_reduce_hit_rate_is_hit_over_looked_up_tokens_rounded_to_three_places():
    stats = AioConnectorStats()
    stats.add(hit_tokens=1, miss_tokens=2)
    assert stats.reduce()["pool_hit_rate"] == 0.333


def test_reduce_hit_rate_is_one_when_every_token_hits():
    stats = AioConnectorStats()
    stats.add(hit_tokens=64)
    assert stats.reduce()["pool_hit_rate"] == 1.0


def test_reduce_reports_mebibytes_and_bytes_over_the_batches_summed_seconds():
    stats = AioConnectorStats()
    stats.add(load_bytes=3 * 2**20, load_seconds=0.5, save_bytes=2**19, save_seconds=0.25)
    reduced = stats.reduce()
    assert reduced["loaded_MiB"] == 3.0
    assert reduced["load_batch_GBps"] == round(3 * 2**20 / 0.5 / 1e9, 2)
    assert reduced["saved_MiB"] == 0.5
    assert reduced["save_batch_GBps"] == round(2**19 / 0.25 / 1e9, 2)


def test_reduce_still_reports_the_former_names_with_the_same_figures():
    stats = AioConnectorStats()
    stats.add(load_bytes=3 * 2**20, load_seconds=0.5, save_bytes=2**19, save_seconds=0.25)
    reduced = stats.reduce()
    former = {"loaded_MB": "loaded_MiB", "load_GBps": "load_batch_GBps", "saved_MB": "saved_MiB",
              "save_GBps": "save_batch_GBps"}
    assert {old: reduced[old] for old in former} == {old: reduced[new] for old, new in former.items()}


def test_reduce_rate_is_zero_when_no_time_was_spent():
    stats = AioConnectorStats()
    stats.add(load_bytes=2**30, save_bytes=2**30)
    reduced = stats.reduce()
    assert (reduced["load_batch_GBps"], reduced["save_batch_GBps"]) == (0.0, 0.0)


def test_reduce_passes_failure_counts_through():
    stats = AioConnectorStats()
    stats.add(load_failures=2, save_failures=3, failed_hit_tokens=64)
    reduced = stats.reduce()
    assert (reduced["load_failures"], reduced["save_failures"], reduced["failed_hit_tokens"]) == (2, 3, 64)


def test_reduce_after_aggregating_two_workers_uses_the_sums():
    a, b = AioConnectorStats(), AioConnectorStats()
    a.add(hit_tokens=30, miss_tokens=10)
    b.add(hit_tokens=10, miss_tokens=50)
    assert a.aggregate(b).reduce()["pool_hit_rate"] == 0.4


def test_build_kv_connector_stats_round_trips_the_serialised_dict():
    stats = AioConnectorStats()
    stats.add(hit_tokens=7, load_blocks=3, load_seconds=0.125)
    rebuilt = AioConnector.build_kv_connector_stats(stats.to_dict())
    assert isinstance(rebuilt, AioConnectorStats)
    assert rebuilt.data == stats.data
    assert rebuilt.reduce() == stats.reduce()


def test_build_kv_connector_stats_copies_the_dict():
    data = AioConnectorStats().to_dict()
    rebuilt = AioConnector.build_kv_connector_stats(data)
    rebuilt.add(save_blocks=1)
    assert data["save_blocks"] == 0


def test_build_kv_connector_stats_without_data_is_empty():
    for data in (None, {}):
        rebuilt = AioConnector.build_kv_connector_stats(data)
        assert isinstance(rebuilt, AioConnectorStats)
        assert rebuilt.data == {name: 0 for name in COUNTERS}
        assert rebuilt.is_empty()


def test_build_kv_connector_stats_fills_counters_missing_from_the_dict():
    rebuilt = AioConnector.build_kv_connector_stats({"hit_tokens": 4})
    assert set(rebuilt.data) == set(COUNTERS)
    assert rebuilt.data["hit_tokens"] == 4
    rebuilt.add(miss_tokens=1)  # every counter can be added to


# ---- the pool's readings (Backend.gauges) ------------------------------------


def test_readings_are_carried_and_replaced_not_summed():
    stats = AioConnectorStats()
    stats.set_gauges(READINGS)
    stats.set_gauges({"pool_used_bytes": 1})
    assert stats.data["pool_used_bytes"] == 1
    assert stats.data["pool_stored_values"] == 12


def test_an_unknown_reading_raises():
    with pytest.raises(KeyError, match="pool_temperature"):
        AioConnectorStats().set_gauges({"pool_temperature": 40})


def test_readings_alone_leave_the_stats_empty():
    stats = AioConnectorStats()
    stats.set_gauges(READINGS)
    assert stats.is_empty()


def test_aggregate_keeps_the_other_readings_not_their_sum():
    # Another rank of the same pool, or a later step: its reading is the pool's now.
    a, b = AioConnectorStats(), AioConnectorStats()
    a.set_gauges(READINGS)
    b.set_gauges({**READINGS, "pool_used_bytes": 4 << 20})
    a.aggregate(b)
    assert {name: a.data[name] for name in GAUGES} == {**READINGS, "pool_used_bytes": 4 << 20}


def test_aggregate_with_the_other_reading_nothing_keeps_ours():
    a = AioConnectorStats()
    a.set_gauges(READINGS)
    a.aggregate(AioConnectorStats())
    assert {name: a.data[name] for name in GAUGES} == READINGS


def test_reset_drops_the_readings():
    stats = AioConnectorStats()
    stats.set_gauges(READINGS)
    stats.reset()
    assert stats.data == {name: 0 for name in COUNTERS}


# ---- Prometheus -------------------------------------------------------------------


@pytest.fixture
def prometheus():
    """AioPromMetrics on a registry of its own, and a reader of its samples (engine 0)."""
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    metrics = AioPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    return metrics, lambda name: registry.get_sample_value(name, {"engine": "0"}), registry


def test_prometheus_counts_blocks_already_stored_under_the_new_and_the_former_name(prometheus):
    metrics, sample, _ = prometheus
    metrics.observe({"save_already_stored": 3})
    metrics.observe({"save_already_stored": 2})
    assert sample("vllm:aio_save_already_stored_total") == 5
    assert sample("vllm:aio_save_skipped_total") == 5


def test_prometheus_former_name_is_documented_as_deprecated(prometheus):
    metrics, _, registry = prometheus
    docs = {family.name: family.documentation for family in registry.collect()}
    assert docs["vllm:aio_save_skipped"].startswith("vllm_aio connector: deprecated")
    assert "vllm:aio_save_already_stored_total" in docs["vllm:aio_save_skipped"]
    assert "deprecated" not in docs["vllm:aio_save_already_stored"]


def test_prometheus_gauges_take_the_latest_reading(prometheus):
    metrics, sample, _ = prometheus
    metrics.observe(AioConnectorStats().data | READINGS)
    metrics.observe({"pool_used_bytes": 1 << 20})
    assert sample("vllm:aio_pool_used_bytes") == 1 << 20
    assert {name: sample(f"vllm:aio_{name}") for name in GAUGES if name != "pool_used_bytes"} == {
        name: value for name, value in READINGS.items() if name != "pool_used_bytes"}
