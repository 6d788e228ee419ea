"""Unit tests of ``vllm_aio.backends.remote``: the plumbing Mooncake and Memcache share.

The link runs on a fake clock and a fake probe; the gate on threads that
signal each other. Nothing sleeps.
"""

from __future__ import annotations

import logging
import threading

import pytest

from vllm_aio.backends.base import Memory, Status
from vllm_aio.backends.remote import (
    ABSENT, LOOKUP_BLOCKS, CallGate, MasterLink, Regions, count_by_probes, diagnose, exists_over, split_address,
)
from vllm_aio.errors import ConfigError
from vllm_aio.pool.keys import BlockParts, block_key


class Probe:
    """A service that is up or down; counts the probes."""

    def __init__(self) -> None:
        self.up = True
        self.probes = 0

    def __call__(self, address: str, timeout: float) -> bool:
        self.probes += 1
        return self.up


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def link() -> tuple[MasterLink, Probe, Clock]:
    probe, clock = Probe(), Clock()
    return MasterLink("h:1", "Store master", probe_interval=0.5, reachable=probe, clock=clock), probe, clock


def test_a_healthy_link_is_usable_without_probing():
    master, probe, _ = link()
    assert master.usable() and master.usable()
    assert probe.probes == 0


def test_a_link_found_down_answers_at_once_and_probes_once_per_interval():
    master, probe, clock = link()
    probe.up = False
    assert not master.probe(1.0)  # after a failed call
    assert probe.probes == 1
    assert not master.usable() and not master.usable()  # within the interval: no probe
    assert probe.probes == 1
    clock.now += 0.5
    assert not master.usable()  # one probe, still down
    assert not master.usable()
    assert probe.probes == 2
    probe.up = True
    clock.now += 0.5
    assert master.usable()  # the probe sees it back
    assert master.usable() and probe.probes == 3


def test_a_link_says_once_that_the_service_went_away_and_once_that_it_came_back(caplog):
    master, probe, clock = link()
    probe.up = False
    with caplog.at_level(logging.INFO, logger="vllm"):
        master.probe(1.0)
        clock.now += 0.5
        master.usable()  # still down: said already
        probe.up = True
        clock.now += 0.5
        assert master.usable() and master.usable()
        assert master.probe(1.0)  # up after up: nothing to say
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == [logging.WARNING, logging.INFO]
    assert said[0][1].startswith("vllm_aio: Store master at h:1 does not answer;") and "lookups miss" in said[0][1]
    assert said[1][1] == "vllm_aio: Store master at h:1 answers again; pool calls go to it"


def test_gate_close_waits_for_the_call_in_flight_and_refuses_new_ones():
    gate = CallGate("Store")
    entered, leave = threading.Event(), threading.Event()

    def call() -> None:
        with gate.call():
            entered.set()
            leave.wait(30)

    caller = threading.Thread(target=call)
    caller.start()
    assert entered.wait(30)
    assert gate.close(timeout=0) is False  # one call still runs
    with pytest.raises(RuntimeError, match="^Store is closed$"):
        with gate.call():
            pass
    leave.set()
    caller.join(30)
    assert gate.close(timeout=30) is True and gate.closed


def test_regions_tell_covered_overlapping_and_device_memory():
    regions = Regions()
    regions.add(1000, 100, Memory.HOST)
    regions.add(5000, 100, Memory.DEVICE)
    assert regions.covers(1010, 50) and not regions.covers(1050, 100)
    assert regions.overlapping(1050, 3000) == [(1000, 100)]
    assert regions.memory_of([(1000, 10), (9000, 10)]) is Memory.HOST  # unregistered memory is host memory
    assert regions.memory_of([(5000, 10), (5050, 50)]) is Memory.DEVICE
    assert regions.memory_of([(5000, 10), (1000, 10)]) is None  # mixed
    regions.remove((5000, 100))
    assert regions.memory_of([(5000, 10)]) is Memory.HOST and regions.spans == [(1000, 100)]


def test_exists_over_a_batched_call_answers_in_order():
    calls = []

    def run(n, native):  # a backend's runner: here, two chunks
        return native(list(range(0, n // 2))) + native(list(range(n // 2, n)))

    def exist(keys):
        calls.append(keys)
        return [1 if k in ("a", "c") else 0 for k in keys]

    assert exists_over(run, exist, ["a", "b", "c", "d"]) == [True, False, True, False]
    assert calls == [["a", "b"], ["c", "d"]]


@pytest.mark.parametrize(
    ("stored", "status"),
    [(ABSENT, Status.MISSING), (None, Status.ERROR), (4096, Status.ERROR), (100, Status.CORRUPT)],
)
def test_diagnose_a_failed_get_by_the_stored_size(stored, status):
    assert diagnose(stored, 4096) is status


def test_split_address_names_the_key():
    assert split_address("k", "[::1]:80") == ("::1", 80)
    with pytest.raises(ConfigError, match="^k: expected 'host:port'"):
        split_address("k", "host")


# ---- count_by_probes -----------------------------------------------------------------

PARTS = BlockParts("d" * 16, ("pp0.dcp0.h0", "pp0.dcp0.h1", "pp0.dcp0.h2"), (0, 1, 2, 3))


class Exists:
    """A store's exists call over a set of keys; records each call's keys."""

    def __init__(self, present: set[str]) -> None:
        self.present = present
        self.calls: list[list[str]] = []

    def __call__(self, keys: list[str]) -> list[bool]:
        self.calls.append(keys)
        return [k in self.present for k in keys]


def test_probes_ask_one_key_per_block_the_last_layer_of_a_rotating_shard():
    hashes = [bytes([i]) * 32 for i in range(4)]
    exists = Exists(set(PARTS.probe_keys(hashes)))
    assert count_by_probes(exists, PARTS, hashes) == 4
    (keys,) = exists.calls
    assert keys == [block_key("d" * 16, f"pp0.dcp0.h{i % 3}", h, 3) for i, h in enumerate(hashes)]


def test_probes_stop_at_the_first_block_whose_probe_is_missing():
    hashes = [bytes([i]) * 32 for i in range(5)]
    probes = PARTS.probe_keys(hashes)
    assert count_by_probes(Exists(set(probes) - {probes[2]}), PARTS, hashes) == 2


def test_probes_go_in_bounded_calls_and_later_calls_are_skipped_after_a_miss():
    hashes = [i.to_bytes(32, "little") for i in range(2 * LOOKUP_BLOCKS + 1)]
    probes = PARTS.probe_keys(hashes)
    exists = Exists(set(probes))
    assert count_by_probes(exists, PARTS, hashes) == len(hashes)
    assert [len(c) for c in exists.calls] == [LOOKUP_BLOCKS, LOOKUP_BLOCKS, 1]
    exists = Exists(set(probes) - {probes[5]})
    assert count_by_probes(exists, PARTS, hashes) == 5
    assert len(exists.calls) == 1
