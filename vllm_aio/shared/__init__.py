"""Facts that the scheduler half, the worker half, the dynamic buffer and migration derive alike.

``deployment.py`` (what both halves derive from vLLM's configs), ``graph_mode.py``
(the graph modes each transfer mode runs under), ``keying.py`` (the keys blocks
are looked up and stored under) and ``metadata.py`` (what the scheduler sends the
workers each step) live here, below all of them, so that
each of ``connector/``, ``buffer/`` and ``migration/`` can import them without
importing another. This package imports nothing of those three (checked by
``tests/unit/test_import_rules.py``) and no torch: the scheduler half imports it
in vLLM's engine-core process (``tests/unit/test_layers.py``).
"""
