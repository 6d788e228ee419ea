"""Loggers under vLLM's ``vllm`` logger, so our lines share its handlers and format."""

import logging


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"vllm.{name}")
