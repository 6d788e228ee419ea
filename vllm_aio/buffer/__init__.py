"""The dynamic device buffer: layers time-share S device KV buffers while the full KV lives in the pool."""
