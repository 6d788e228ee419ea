"""The block hashes of a token sequence, as this engine's scheduler computes them.

A migration names a request by its tokens (prompt + generated so far), never
by vLLM's request id: ids differ between instances, and the target must derive
its keys itself rather than trust hashes a peer sends. vLLM chains each full
block's hash onto the previous one from ``NONE_HASH`` with the
``prefix_caching_hash_algo`` function; both are fixed per process once the
engine core starts, and equal across instances with the same hash algorithm and
``PYTHONHASHSEED`` (``fingerprint`` lets two instances compare before moving
anything). Plain token prompts only: multimodal, LoRA and cache-salted requests
add extra keys to their hashes and are not migrated.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


class PrefixHasher:
    def __init__(self, hash_algo: str, block_size: int) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name

        self._hash_fn = get_hash_fn_by_name(hash_algo)
        self.block_size = block_size

    def hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """One hash per full block of ``token_ids``."""
        from vllm.v1.core.kv_cache_utils import hash_block_tokens

        out: list[bytes] = []
        parent = None
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = hash_block_tokens(self._hash_fn, parent, token_ids[start : start + bs])
            out.append(bytes(parent))
        return out

    @staticmethod
    def fingerprint() -> str:
        """Names this process's ``NONE_HASH`` (the chain's seed) without revealing it."""
        from vllm.v1.core import kv_cache_utils

        return hashlib.sha256(bytes(kv_cache_utils.NONE_HASH)).hexdigest()[:16]
