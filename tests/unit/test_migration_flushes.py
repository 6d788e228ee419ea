"""``FlushRequests``: the queue through which a migration has a running request's blocks stored."""

from __future__ import annotations

from vllm_aio.migration.flushes import FlushRequests

RUNNING = [("a", [b"a0", b"a1", b"a2"]), ("b", [b"b0", b"b1"])]


def test_a_flush_names_the_running_request_whose_prefix_ends_in_its_hash():
    flushes = FlushRequests()
    flushes.ask(b"a1", 2)
    assert flushes.state(b"a1") is None  # no step yet
    assert flushes.match(iter(RUNNING)) == {"a": 2}
    assert flushes.state(b"a1") is True


def test_a_request_asked_twice_stores_the_longer_prefix():
    flushes = FlushRequests()
    flushes.ask(b"a1", 2)
    flushes.ask(b"a2", 3)
    assert flushes.match(iter(RUNNING)) == {"a": 3}


def test_a_flush_no_running_request_holds_is_known_unmatched_after_two_steps():
    flushes = FlushRequests()
    flushes.ask(b"gone", 1)
    flushes.match(iter(RUNNING))
    assert flushes.state(b"gone") is None  # one step: not known yet
    flushes.match(iter(RUNNING))
    assert flushes.state(b"gone") is False


def test_a_forgotten_flush_is_neither_matched_nor_known():
    flushes = FlushRequests()
    flushes.ask(b"a1", 2)
    flushes.match(iter(RUNNING))
    flushes.forget(b"a1")
    assert flushes.state(b"a1") is None
    assert flushes.match(iter(RUNNING)) == {}


def test_without_a_flush_the_running_requests_are_not_read():
    def running():
        raise AssertionError("read")
        yield

    assert FlushRequests().match(running()) == {}
