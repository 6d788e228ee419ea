"""Unit tests of ``vllm_aio.connector.stats.AioConnectorStats`` (no engine started)."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from vllm_aio.connector.connector import AioConnector
from vllm_aio.connector.stats import COUNTERS, AioConnectorStats


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
        "loaded_MB": 0.0,
        "load_GBps": 0.0,
        "saved_MB": 0.0,
        "save_GBps": 0.0,
        "load_failures": 0,
        "save_failures": 0,
    }


def test_reduce_hit_rate_is_hit_over_looked_up_tokens_rounded_to_three_places():
    stats = AioConnectorStats()
    stats.add(hit_tokens=1, miss_tokens=2)
    assert stats.reduce()["pool_hit_rate"] == 0.333


def test_reduce_hit_rate_is_one_when_every_token_hits():
    stats = AioConnectorStats()
    stats.add(hit_tokens=64)
    assert stats.reduce()["pool_hit_rate"] == 1.0


def test_reduce_reports_megabytes_and_gigabytes_per_second():
    stats = AioConnectorStats()
    stats.add(load_bytes=3 * 2**20, load_seconds=0.5, save_bytes=2**19, save_seconds=0.25)
    reduced = stats.reduce()
    assert reduced["loaded_MB"] == 3.0
    assert reduced["load_GBps"] == round(3 * 2**20 / 0.5 / 1e9, 2)
    assert reduced["saved_MB"] == 0.5
    assert reduced["save_GBps"] == round(2**19 / 0.25 / 1e9, 2)


def test_reduce_rate_is_zero_when_no_time_was_spent():
    stats = AioConnectorStats()
    stats.add(load_bytes=2**30, save_bytes=2**30)
    reduced = stats.reduce()
    assert (reduced["load_GBps"], reduced["save_GBps"]) == (0.0, 0.0)


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
