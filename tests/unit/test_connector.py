"""``AioConnector``'s answers to vLLM that need no engine."""

from __future__ import annotations

import logging

from conftest import require


def test_sleep_mode_is_refused_with_the_reason_logged(caplog):
    require("vllm")
    from vllm_aio.connector.connector import AioConnector

    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert AioConnector.supports_sleep_mode(None) is False
    assert "does not support vLLM's sleep mode" in caplog.text and "enable_sleep_mode" in caplog.text
