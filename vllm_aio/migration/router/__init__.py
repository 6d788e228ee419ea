"""A priority-aware router in front of several vLLM instances (``vllm-aio router --policy
priority``): it relays every completion as a stream with token ids, so it can move a pressured
instance's most important request to the instance with the most free KV and resume it there in the
client's one stream. Modules: ``app.py``, ``monitor.py``, ``metrics_text.py``, ``flight.py``,
``relay.py``, ``upstream.py``, ``replies.py``. How a move runs: ``docs/migration.md``, "The router".
"""

from vllm_aio.migration.router.app import Router, serve

__all__ = ["Router", "serve"]
