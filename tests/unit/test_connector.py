"""``AioConnector``'s answers to vLLM that need no engine."""

from __future__ import annotations

import logging

from harness.prerequisites import require


def test_sleep_mode_is_refused_with_the_reason_logged(caplog):
    require("vllm")
    from vllm_aio.connector.connector import AioConnector

    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert AioConnector.supports_sleep_mode(None) is False
    assert "does not support vLLM's sleep mode" in caplog.text and "enable_sleep_mode" in caplog.text


def test_the_connector_tells_vllm_its_saves_are_best_effort_in_every_role():
    require("vllm")
    from vllm_aio.connector.connector import AioConnector

    assert AioConnector.requires_kv_delivery.fget(None) is False  # no role or state changes the answer


_EXITS_WITHOUT_SHUTDOWN = """
from vllm_aio.connector.connector import shutdown_at_exit

class Connector:
    def shutdown(self):
        print("shut down")

kept, dropped = Connector(), Connector()
shutdown_at_exit(kept)
shutdown_at_exit(dropped)
del dropped  # held weakly: a connector gone before exit is not kept alive for it
print("exiting")
"""


def test_a_connector_vllm_never_shut_down_is_shut_down_at_interpreter_exit():
    """vLLM's in-process engine never calls ``shutdown``: a store client's threads then died with the
    process (Mooncake aborted it) and queued remote writes were lost."""
    require("vllm")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _EXITS_WITHOUT_SHUTDOWN], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["exiting", "shut", "down"]
