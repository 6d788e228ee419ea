"""``FlushRequests``: migrations' requests to have a running request's blocks stored.

A migration moves every full block of a request, generated ones included, but
a deployment stores only the prompt's blocks unless ``save_decode_cache`` is
on. The migration control (its own thread) asks here (``ask``); the scheduler
half drains the queue at every step (``match``), against its running requests,
and saves the named blocks from vLLM's cache like any save. Block hashes are
chained, so one hash names a whole prefix.

Whether a flush found its request is counted in steps, not seconds: a loaded
machine makes steps slow, not rare.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence


class FlushRequests:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked: dict[bytes, tuple[int, int]] = {}  # last block hash -> (blocks, step when asked)
        self._matched: set[bytes] = set()  # those matched to a running request
        self._unmatched: set[bytes] = set()  # those no running request held for two steps
        self._steps = 0  # match calls so far

    # ---- the migration control's side --------------------------------------
    def ask(self, last_hash: bytes, num_blocks: int) -> None:
        """Store the first ``num_blocks`` full blocks of the running request whose
        ``num_blocks``-th block hash is ``last_hash``."""
        with self._lock:
            blocks, _ = self._asked.get(last_hash, (0, 0))
            self._asked[last_hash] = (max(num_blocks, blocks), self._steps)

    def state(self, last_hash: bytes) -> bool | None:
        """True: a step found the running request a flush names; False: two steps
        ran without it (it finished, or never ran here); None: not known yet."""
        with self._lock:
            if last_hash in self._matched:
                return True
            return False if last_hash in self._unmatched else None

    def forget(self, last_hash: bytes) -> None:
        with self._lock:
            self._asked.pop(last_hash, None)
            self._matched.discard(last_hash)
            self._unmatched.discard(last_hash)

    # ---- the scheduler's side ------------------------------------------------
    def match(self, running: Iterable[tuple[str, Sequence[bytes]]]) -> dict[str, int]:
        """One step: of the running requests (id, block hashes), those a flush names,
        with the most blocks any flush asks of each. ``running`` is read only when a flush waits."""
        with self._lock:
            self._steps += 1
            if not self._asked:
                return {}
            wanted = dict(self._asked)
        found: dict[str, int] = {}
        matched = set()
        for req_id, hashes in running:
            for last_hash, (count, _) in wanted.items():
                if len(hashes) >= count and hashes[count - 1] == last_hash:
                    found[req_id] = max(found.get(req_id, 0), count)
                    matched.add(last_hash)
        with self._lock:
            self._matched |= matched & set(self._asked)
            self._unmatched |= {h for h, (_, asked) in self._asked.items()
                                if h not in self._matched and self._steps - asked >= 2}
        return found
