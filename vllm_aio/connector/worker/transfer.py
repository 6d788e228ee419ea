"""The worker's transfer threads: one receiving, one sending.

Each is a named daemon thread draining one FIFO queue of jobs, so loads run
in the order the forward needs them and saves in the order layers finished.
Jobs are submitted from vLLM's forward thread (the layer hooks) and return
futures the hooks wait on with a bound; the copy work itself never runs on
the forward thread (SGLang measured ~0% overlap when it did).

Shutdown: ``close`` stops taking jobs, lets queued ones finish and joins.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_STOP = object()


class TransferThread:
    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> "Future[T]":
        if self._closed:
            raise RuntimeError(f"{self._thread.name} is closed")
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future

    def drain(self) -> None:
        """Wait until every job submitted so far has run."""
        self.submit(lambda: None).result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(_STOP)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
