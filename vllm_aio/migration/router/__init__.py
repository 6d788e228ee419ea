"""A priority-aware router in front of several vLLM instances: ``vllm-aio router --policy priority``.

Why a router: a migration re-issues the rest of a request on the target
(``driver.py``), so whoever moves a request must own the client's stream and
know the request's tokens so far. The router forwards ``POST /v1/completions``
(streamed or not, vLLM's ``priority`` field passed through) to an instance,
always streaming from it with token ids, so it knows every in-flight request's
instance, priority, prompt and generated tokens. It polls each instance's
``/metrics`` and, with the ``priority`` policy (``policy.py``), moves the most
important request of a pressured instance to the one with the most free KV.

A move, in the request's relay (``relay.py``):
- decoding: at the next block boundary, ``move_kv`` (flush, allocate,
  transfer, commit), then the source's stream is closed (vLLM aborts the
  request) and the rest is requested from the target as prompt + generated
  tokens; the target computes one token, as the source would have. A failed
  move leaves the request decoding on the source;
- stalled (no token for ``stall_s`` after the order: waiting for KV, or
  preempted): at once. Its full blocks move if the source's pool has them
  (the connector copies a preempted request's blocks out); otherwise the target
  recomputes them, which still beats waiting on the pressured instance.
The client sees one stream: one id, the tokens in order, usage counting the
original prompt and every generated token.

Requests the router cannot resume elsewhere (several prompts, ``n`` or
``best_of`` > 1, ``echo``) are forwarded unchanged and never moved. New
requests go to the instance named by the ``X-Instance`` header (URL or index),
else to the one with the most free KV blocks.

The rooms: ``app.py`` (routes, startup and shutdown), ``monitor.py`` (polls,
pressure, placement, move orders), ``metrics_text.py`` (vLLM's Prometheus
text), ``flight.py`` (what the router knows of a request in flight),
``relay.py`` (one movable request's chunks, moves included), ``upstream.py``
(one completion on one instance), ``replies.py`` (what the client receives).
"""

from vllm_aio.migration.router.app import Router, serve

__all__ = ["Router", "serve"]
