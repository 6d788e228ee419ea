"""Unit tests of ``vllm_aio.connector.worker.transfer.TransferThread``."""

from __future__ import annotations

import threading

import pytest

from vllm_aio.connector.worker.transfer import TransferThread


def test_jobs_run_in_submission_order_on_the_named_thread():
    thread = TransferThread("vllm_aio-test")
    ran = []
    futures = [thread.submit(lambda i=i: ran.append((i, threading.current_thread().name))) for i in range(5)]
    thread.drain()
    assert all(f.done() for f in futures)
    assert ran == [(i, "vllm_aio-test") for i in range(5)]
    thread.close()


def test_an_exception_reaches_the_waiter_and_the_thread_goes_on():
    thread = TransferThread("vllm_aio-test")

    def boom():
        raise ConnectionError("pool gone")

    with pytest.raises(ConnectionError, match="pool gone"):
        thread.submit(boom).result(timeout=5)
    assert thread.submit(lambda: 42).result(timeout=5) == 42
    thread.close()


def test_close_runs_queued_jobs_then_refuses_new_ones():
    thread = TransferThread("vllm_aio-test")
    gate = threading.Event()
    thread.submit(gate.wait)
    late = thread.submit(lambda: "done")
    gate.set()
    thread.close()
    assert late.result(timeout=0) == "done"
    with pytest.raises(RuntimeError, match="closed"):
        thread.submit(lambda: None)
