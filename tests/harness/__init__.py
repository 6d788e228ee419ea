"""The test suite's harness: what tests share beyond pytest's fixtures.

Engines and servers in processes of their own (``engines``, ``servers``, with the scripts
``engine_runner.py`` and ``engine_zygote.py`` they run), the prompts and assertions the
end-to-end tests compare with (``prompts``, ``assertions``), stand-ins for what a unit or
integration test cannot run for real (``memory_backend``, ``memcache_fake``, ``scheduler_fakes``,
``worker_fakes``, the connectors real vLLM loads: ``faulty_connector``, ``recording_connector``),
and the rules on prerequisites (``prerequisites``). ``tests/`` is on ``sys.path`` (``pytest.ini``),
so tests import ``harness.<module>``; ``conftest.py`` holds only fixtures and pytest hooks.
"""
