"""A KV-event subscriber for the engine tests: vLLM's event batches (``kv_events_config``, publisher
``zmq``) received on a loopback SUB socket and decoded as a router would, with msgspec."""

from __future__ import annotations

import threading
import time

from harness.prerequisites import require


class Subscriber:
    """Collects the events of every batch published to its loopback SUB socket."""

    def __init__(self) -> None:
        zmq = require("zmq")
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.endpoint = f"tcp://127.0.0.1:{self._sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._decode = Decoder(type=KVEventBatch).decode
        self._zmq = zmq
        self.events: list = []
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while self._running:
            if self._sock.poll(100):
                _topic, _seq, payload = self._sock.recv_multipart()
                with self._lock:
                    self.events.extend(self._decode(payload).events)

    def wait_for(self, condition, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if condition(list(self.events)):
                    return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self._running = False
        self._thread.join()
        self._sock.close(linger=0)


def ours(events, kind: str) -> list:
    return [e for e in events if type(e).__name__ == kind and e.medium == "LOCAL_POOL"]


def stored_hashes(events) -> list:
    return [h for e in ours(events, "BlockStored") for h in e.block_hashes]


def removed_hashes(events) -> set:
    return {h for e in ours(events, "BlockRemoved") for h in e.block_hashes}
