"""The worker half (each worker process): moves KV bytes between vLLM's KV cache and the pool on
its transfer threads, through ``block_io/``. It imports nothing of ``connector/scheduler/``."""
