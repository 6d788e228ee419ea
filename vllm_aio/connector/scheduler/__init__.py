"""The scheduler half (vLLM's engine-core process): which blocks each step loads from and saves to
the pool. It never touches KV bytes and imports no torch, nor anything of ``connector/worker/``."""
