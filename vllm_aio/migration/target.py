"""The target side of a migration: pool slots reserved for a peer to write into, then committed or reclaimed.

``allocate`` reserves a slot for every part of every block the target lacks.
Reserved slots are WRITING slots of the embedded pool (``pool/host_pool.py``):
invisible to lookups and never evicted, so the peer's bytes can land in them
while the instance goes on serving. ``commit`` checks what landed, value by
value, against the header this instance would have written itself for that
key (namespace, hence weight version; shard; layer; block size; payload size;
block hash): only then are the blocks published, in prefix order, in one pool
operation. A block with a part that did not land ends the prefix, and what
follows it is not published.

The watchdog: a reservation not committed ``timeout`` seconds after its
allocation expires; a commit after that is rejected. Unpublished slots go
back to the pool only ``grace`` seconds after that moment, whether the
migration expired, was aborted or partly committed: the source starts no
write after half the timeout (``deadline_s`` of the allocation), but a batch
already sent can still land up to the transfer timeout later (even one that
failed, once a stalled peer resumes), and TransferEngine only checks that a
write lands in registered memory, not whose slot it is: a slot handed to
another key while a late write could still arrive would be silently
overwritten. Answers stay known for a while after (a repeated commit gets the
same answer), then the id is forgotten.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_aio.backends.base import KeyedSlotStore
from vllm_aio.log import get_logger

logger = get_logger(__name__)

# At most this share of the pool's slots is reserved by migrations at once: a
# burst of incoming migrations must not evict everything the instance serves from.
MAX_RESERVED_SHARE = 0.5
# Answers are remembered for this many timeouts after the allocation, and for
# one timeout more after an expired reservation's slots are back in the pool: a
# source asking until then is told the migration expired (410), not that it is unknown.
_REMEMBER_TIMEOUTS = 3


class MigrationRefused(Exception):
    """A call the target cannot honour; ``status`` is the HTTP status the control answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Reservation:
    migration_id: str
    first_block: int  # index of the first lacking block in the sequence
    slots: list[list[int]]  # per lacking block, per part: the slot, or -1 (part already stored)
    headers: list[list[bytes]]  # per block, per part: what its value must start with
    created: float
    expires: float
    state: str = "reserved"  # -> committed | aborted | expired
    answer: dict = field(default_factory=dict)  # commit's reply, repeated on a repeated commit

    def reserved(self) -> list[int]:
        return [s for block in self.slots for s in block if s >= 0]


class MigrationTarget:
    """Reservations of one instance's pool, by migration id, with their watchdog thread."""

    def __init__(self, store: KeyedSlotStore, timeout: float, grace: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self.timeout = timeout
        self._grace = grace
        self._clock = clock
        self._lock = threading.Lock()
        self._table: dict[str, _Reservation] = {}
        self._held: list[tuple[float, list[int]]] = []  # (release time, slots) not to reuse before then
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="vllm_aio-migration-watchdog", daemon=True)
        self._thread.start()

    # ---- protocol ----------------------------------------------------------
    def allocate(
        self, migration_id: str | None, first_block: int, keys: Sequence[Sequence[str]], headers: Sequence[Sequence[bytes]]
    ) -> _Reservation:
        """Reserve a slot for each part in ``keys`` (per lacking block) that the pool does not hold.

        Idempotent per id: a repeated allocate gets the same reservation.
        Nothing stays reserved when it fails.
        """
        with self._lock:
            if migration_id is not None and migration_id in self._table:
                return self._live(migration_id)
            wanted = sum(len(k) for k in keys)
            limit = int(self._num_slots() * MAX_RESERVED_SHARE) - self._reserved_count()
            if wanted > limit:
                raise MigrationRefused(
                    507, f"migration needs {wanted} pool slots but only {max(limit, 0)} may be reserved now "
                    f"(at most {MAX_RESERVED_SHARE:.0%} of the pool's {self._num_slots()}); "
                    "enlarge local_pool_size or migrate a shorter request"
                )
            flat = [k for block in keys for k in block]
            got = self._store.reserve(flat) if flat else []
            if any(s is not None and s < 0 for s in got):
                self._store.abandon([s for s in got if s is not None and s >= 0])
                raise MigrationRefused(507, f"the pool has no room for {wanted} values now (every slot is in use)")
            slots, at = [], 0
            for block in keys:
                slots.append([-1 if s is None else s for s in got[at : at + len(block)]])
                at += len(block)
            now = self._clock()
            res = _Reservation(migration_id or uuid.uuid4().hex, first_block, slots,
                               [list(h) for h in headers], now, now + self.timeout)
            self._table[res.migration_id] = res
            return res

    def commit(self, migration_id: str, header_bytes: int) -> dict:
        """Publish the leading blocks whose every reserved slot holds the expected header."""
        with self._lock:
            res = self._live(migration_id)
            if res.state == "committed":
                return res.answer
            if res.state != "reserved":
                raise MigrationRefused(409, f"migration {migration_id} was {res.state}")
            good, problem = self._landed(res, header_bytes)
            publish = [s for block in res.slots[:good] for s in block if s >= 0]
            stored = self._store.commit(publish) if publish else []
            rest = [s for block in res.slots[good:] for s in block if s >= 0]
            if rest:
                self._held.append((res.expires + self._grace, rest))
            res.state = "committed"
            res.answer = {
                "migration_id": migration_id,
                "first_block": res.first_block,
                "committed_blocks": good,
                "lacking_blocks": len(res.slots),
                "values": sum(stored),  # parts another writer stored meanwhile count as present, not here
                "problem": problem,
            }
            return res.answer

    def abort(self, migration_id: str) -> dict:
        """Give up a reservation (its slots come back when the watchdog would have freed them)."""
        with self._lock:
            res = self._live(migration_id)
            if res.state == "reserved":
                res.state = "aborted"
                self._held.append((res.expires + self._grace, res.reserved()))
            return {"migration_id": migration_id, "state": res.state}

    def reservation(self, migration_id: str) -> _Reservation:
        with self._lock:
            return self._live(migration_id)

    def status(self) -> dict:
        with self._lock:
            return {
                "reserved_slots": self._reserved_count(),
                "migrations": {m: r.state for m, r in self._table.items()},
            }

    # ---- internals -----------------------------------------------------------
    def _live(self, migration_id: str) -> _Reservation:
        res = self._table.get(migration_id)
        if res is None:
            raise MigrationRefused(404, f"unknown migration id {migration_id!r} (never allocated here, or forgotten)")
        if res.state == "reserved" and self._clock() >= res.expires:
            self._expire(res)
        if res.state == "expired":
            raise MigrationRefused(
                410, f"migration {migration_id} expired: not committed within {self.timeout:g} s "
                "(migration_watchdog_timeout); its slots are being freed"
            )
        return res

    def _landed(self, res: _Reservation, header_bytes: int) -> tuple[int, str | None]:
        """How many leading blocks have every reserved part holding its expected header."""
        for i, (block, expected) in enumerate(zip(res.slots, res.headers)):
            mine = [(s, h) for s, h in zip(block, expected) if s >= 0]
            found = self._store.read_headers([s for s, _ in mine], header_bytes)
            for (slot, want), got in zip(mine, found):
                if got != want:
                    return i, f"block {res.first_block + i}: slot {slot} does not hold the expected value (not written, or written for other keys)"
        return len(res.slots), None

    def _expire(self, res: _Reservation) -> None:
        res.state = "expired"
        slots = res.reserved()
        self._held.append((res.expires + self._grace, slots))
        logger.warning("vllm_aio: migration %s not committed within %g s (migration_watchdog_timeout): "
                       "its %d slots return to the pool in %g s", res.migration_id, self.timeout, len(slots),
                       self._grace)

    def _reserved_count(self) -> int:
        live = sum(len(r.reserved()) for r in self._table.values() if r.state == "reserved")
        return live + sum(len(slots) for _, slots in self._held)

    def _num_slots(self) -> int:
        return self._store.region()[1] // self._store.slot_size

    def sweep(self) -> None:
        """Expire overdue reservations, free held slots whose time has come, forget old answers."""
        now = self._clock()
        with self._lock:
            for res in list(self._table.values()):
                if res.state == "reserved" and now >= res.expires:
                    self._expire(res)
                if now >= max(res.created + _REMEMBER_TIMEOUTS * self.timeout,
                              res.expires + self._grace + self.timeout):
                    del self._table[res.migration_id]
            due = [slots for at, slots in self._held if now >= at]
            self._held = [(at, slots) for at, slots in self._held if now < at]
            for slots in due:
                self._store.abandon(slots)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - the watchdog must outlive one bad sweep
                logger.exception("vllm_aio: migration watchdog sweep failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
