"""Runtime KV migration: move a running request, with the KV it computed, between live instances.

The protocol (target side: session info, extra size, allocate, commit,
watchdog; source side: flush and transfer) runs in the engine-core process of
each instance, next to the scheduler half and the pool (``control.py``). The
instance's OpenAI server exposes it under ``/v1/kv_migration/`` (``endpoints.py``)
and forwards each call over a unix socket (``channel.py``). Bytes move peer to
peer with Mooncake's TransferEngine between embedded pools (``transport.py``),
or not at all through a shared store. ``driver.py`` is the caller's side: it
drives one migration between two instances given by URL. ``router/`` is a
caller in front of several instances that moves requests by ``policy.py``'s
decisions: the most important requests of a pressured instance.
"""
