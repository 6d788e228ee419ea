"""``vllm_aio.migration.control``: the migration protocol's operations and the checks of their bodies.

Driven with fakes of what the control talks to: the pool's block lookups and shared-store name
(``Pool``), vLLM's block hashes (``Hasher``) and the TransferEngine (``Link``, in place of
``PeerLink``); reservations and pins go to a real embedded pool's slots in /dev/shm. The
protocol between two real servers: ``tests/e2e/test_e2e_migration.py``.
"""

from __future__ import annotations

import hashlib
import uuid

import pytest

from vllm_aio.backends.local import PoolSlots
from vllm_aio.config import AioConfig
from vllm_aio.migration import control
from vllm_aio.migration.control import MigrationControl
from vllm_aio.migration.flushes import FlushRequests
from vllm_aio.migration.transport import LinkUnavailableError, TransferError
from vllm_aio.pool.host_pool import SharedHostPool
from vllm_aio.pool.keys import Namespace
from vllm_aio.pool.shm_file import SHM_DIR
from vllm_aio.shared.deployment import Deployment
from vllm_aio.shared.keying import PoolKeying

BS, VALUE, SLOTS = 4, 256, 64
TOKENS = list(range(18))  # 4 full blocks and 2 tokens


class Hasher:
    """vLLM's chained block hashes, as ``PrefixHasher`` computes them, under a seed of its own."""

    def __init__(self, seed: str = "seed-a") -> None:
        self.seed = seed

    def hashes(self, token_ids):
        out, parent = [], self.seed.encode()
        for start in range(0, len(token_ids) - BS + 1, BS):
            parent = hashlib.sha256(parent + repr(token_ids[start:start + BS]).encode()).digest()
            out.append(parent)
        return out

    def fingerprint(self) -> str:
        return self.seed


class Pool:
    """The backend as the control asks it: which leading blocks are complete, which store it shares."""

    def __init__(self, slots: PoolSlots | None = None, shared: str | None = None) -> None:
        self.present: set[bytes] = set()
        self._slots = slots
        self._shared = shared

    def slots(self):
        return self._slots

    def shared_store(self):
        return self._shared

    def count_complete_blocks(self, parts, hashes):
        n = 0
        while n < len(hashes) and hashes[n] in self.present:
            n += 1
        return n


class Link:
    """The TransferEngine: records what it was asked to write."""

    session_id = "127.0.0.1:4242"

    def __init__(self, settings, region) -> None:
        self.region = region
        self.writes: list[tuple[str, list[int], list[int], list[int]]] = []
        self.fail = False

    def write(self, session_id, local, remote, lengths, deadline):
        if self.fail:
            raise TransferError("peer gone")
        self.writes.append((session_id, list(local), list(remote), list(lengths)))
        return sum(lengths)

    def close(self) -> None:
        pass


def deployment(save: bool = True) -> Deployment:
    ns = Namespace("m", "bf16", "auto", BS, "LBHNC", "amx", 1, 1, 1, 1, 0, "")
    return Deployment(
        namespace=ns, block_size=BS, layer_names=("l0", "l1"), value_bytes=VALUE, load_enabled=True,
        save_enabled=save, save_decode_cache=False, pool_name="p", num_kv_heads=8, use_mla=False,
    )


@pytest.fixture
def slots():
    name = f"test-{uuid.uuid4().hex[:16]}"
    pool = SharedHostPool(name, VALUE, SLOTS)
    yield PoolSlots(pool)
    pool.close()
    for path in SHM_DIR.glob(f"vllm_aio*{name}*"):
        path.unlink(missing_ok=True)


@pytest.fixture
def make_control(monkeypatch):
    made = []
    links: list[Link] = []

    def link(settings, region):
        links.append(Link(settings, region))
        return links[-1]

    monkeypatch.setattr(control, "PeerLink", link)

    def make(pool: Pool | None = None, save: bool = True, hasher: Hasher | None = None):
        pool = pool or Pool()
        made.append(MigrationControl(PoolKeying(deployment(save)), FlushRequests(), pool, deployment(save),
                                     AioConfig(), hasher or Hasher(), "kv_both"))
        return made[-1], pool

    make.links = links
    yield make
    for c in made:
        c.close()


def refused(answer: tuple[int, dict], status: int, *words: str) -> None:
    code, body = answer
    assert code == status, body
    for word in words:
        assert word in body["error"]


def peer(c: MigrationControl, **changes) -> dict:
    """What a source sends with an allocate: its session's namespace, hash seed and store."""
    session = c.handle("session", {})[1]
    return {"namespace": session["namespace"], "hash_seed": session["hash_seed"],
            "shared_store": session["shared_store"], **changes}


def test_an_unknown_operation_is_a_404_naming_the_operations(make_control):
    c, _ = make_control()
    refused(c.handle("move", {}), 404, "'move'", "session", "commit")


def test_a_body_with_missing_or_unknown_fields_is_a_400_naming_them(make_control):
    c, _ = make_control()
    refused(c.handle("extra_size", {"tokens": [1]}), 400, "missing token_ids", "unknown tokens")
    refused(c.handle("status", {"verbose": True}), 400, "unknown verbose", "an empty object")


@pytest.mark.parametrize("tokens,status", [([], 400), ([1, "2"], 400), ([-1], 400), ([1 << 31], 400),
                                           ("1 2 3", 400), (list(range(5)), 413)])
def test_token_ids_other_than_a_bounded_list_of_ids_are_refused(make_control, monkeypatch, tokens, status):
    monkeypatch.setattr(control, "MAX_TOKENS", 4)
    c, _ = make_control()
    refused(c.handle("extra_size", {"token_ids": tokens}), status, "token_ids")


def test_extra_size_counts_the_full_blocks_the_pool_holds_and_lacks(make_control):
    c, pool = make_control()
    pool.present.update(Hasher().hashes(TOKENS)[:2])
    assert c.handle("extra_size", {"token_ids": TOKENS}) == (200, {
        "total_tokens": 18, "full_blocks": 4, "matched_blocks": 2, "lacking_blocks": 2,
        "matched_tokens": 8, "extra_tokens": 10,
    })


def test_an_instance_whose_store_has_no_slots_opens_no_transfer_session_and_holds_no_reservations(make_control):
    c, _ = make_control(Pool(shared="mooncake://m:50051"))
    code, session = c.handle("session", {})
    assert code == 200 and "session_id" not in session and make_control.links == []
    assert (session["block_size"], session["value_bytes"], session["parts"]) == (BS, VALUE, 1)
    assert c.handle("status", {}) == (200, {"namespace": session["namespace"]})
    refused(c.handle("abort", {"migration_id": "m1"}), 404, "no reservations")
    refused(c.handle("transfer", {"token_ids": TOKENS, "first_block": 0, "slots": [], "target": {},
                                  "deadline_s": 5}), 409, "no slots to send from")


def test_a_peer_that_keys_blocks_otherwise_is_refused(make_control):
    c, _ = make_control()
    refused(c.handle("allocate", {"token_ids": TOKENS, **peer(c, namespace="other")}), 409,
            "namespace mismatch", "other")
    refused(c.handle("allocate", {"token_ids": TOKENS, **peer(c, hash_seed="seed-b")}), 409, "PYTHONHASHSEED")


def test_a_source_sharing_the_store_needs_no_reservation(make_control):
    c, pool = make_control(Pool(shared="mooncake://m:50051"))
    pool.present.update(Hasher().hashes(TOKENS)[:3])
    code, answer = c.handle("allocate", {"token_ids": TOKENS, **peer(c)})
    assert code == 200 and (answer["shared"], answer["slots"], answer["first_block"]) == (True, [], 3)
    pool.present.update(Hasher().hashes(TOKENS))  # the source's flush stored the rest
    code, answer = c.handle("commit", {"migration_id": answer["migration_id"], "token_ids": TOKENS})
    assert code == 200 and (answer["matched_blocks"], answer["matched_tokens"]) == (4, 16)


def test_a_store_that_takes_no_peer_writes_refuses_a_source_that_does_not_share_it(make_control):
    c, _ = make_control(Pool(shared="mooncake://here:50051"))
    refused(c.handle("allocate", {"token_ids": TOKENS, **peer(c, shared_store="mooncake://there:50051")}), 409,
            "takes no peer writes", "there")


def test_flush_is_refused_where_the_instance_stores_nothing(make_control):
    c, _ = make_control(save=False)
    refused(c.handle("flush", {"token_ids": TOKENS}), 409, "cannot be a source")


def test_flush_of_blocks_the_pool_holds_answers_at_once(make_control):
    c, pool = make_control()
    pool.present.update(Hasher().hashes(TOKENS))
    assert c.handle("flush", {"token_ids": TOKENS, "timeout_s": 5}) == (200, {"blocks": 4})
    refused(c.handle("flush", {"token_ids": TOKENS, "timeout_s": 0}), 400, "timeout_s")


def test_a_weight_version_change_rekeys_the_namespace_and_long_versions_are_refused(make_control):
    c, _ = make_control()
    before = c.handle("status", {})[1]["namespace"]
    code, answer = c.handle("weight_version", {"weight_version": "step-2"})
    assert code == 200 and answer["weight_version"] == "step-2" and answer["namespace"] != before
    assert c.handle("session", {})[1]["namespace"] == answer["namespace"]
    refused(c.handle("weight_version", {"weight_version": "v" * 129}), 400, "at most 128")


def test_allocate_reserves_a_slot_per_lacking_block_until_aborted(make_control, slots):
    c, pool = make_control(Pool(slots))
    pool.present.add(Hasher().hashes(TOKENS)[0])
    code, answer = c.handle("allocate", {"token_ids": TOKENS, "migration_id": "m1", **peer(c)})
    assert code == 200 and (answer["migration_id"], answer["first_block"], answer["shared"]) == ("m1", 1, False)
    assert len(answer["slots"]) == 3 and all(len(b) == 1 and b[0] >= 0 for b in answer["slots"])
    assert c.handle("status", {})[1]["reserved_slots"] == 3
    assert c.handle("abort", {"migration_id": "m1"}) == (200, {"migration_id": "m1", "state": "aborted"})
    assert c.handle("status", {})[1]["migrations"] == {"m1": "aborted"}


def _keys(hashes: list[bytes]) -> list[str]:
    """The keys of every part of ``hashes``, as the control names them."""
    parts = PoolKeying(deployment()).parts
    return [k for h in hashes for k in parts.keys(h)]


def test_transfer_writes_each_part_the_target_reserved_into_its_slot(make_control, slots):
    c, _ = make_control(Pool(slots))
    hashes = Hasher().hashes(TOKENS)
    slots.commit(slots.reserve(_keys(hashes)))  # the source's flush stored them
    session = c.handle("session", {})[1]
    target = {**session, "slot_base": 1 << 20}
    body = {"token_ids": TOKENS, "first_block": 1, "slots": [[7], [-1], [9]], "target": target, "deadline_s": 5}
    code, answer = c.handle("transfer", body)
    assert code == 200 and (answer["bytes"], answer["values"]) == (2 * VALUE, 2)
    ((session_id, local, remote, lengths),) = make_control.links[0].writes
    assert session_id == target["session_id"] and lengths == [VALUE, VALUE]
    assert remote == [(1 << 20) + 7 * VALUE, (1 << 20) + 9 * VALUE]
    base, size = slots.region()
    assert all(base <= a < base + size for a in local)


def test_a_transfer_the_link_fails_or_to_a_peer_of_other_slots_is_refused(make_control, slots):
    c, _ = make_control(Pool(slots))
    hashes = Hasher().hashes(TOKENS)
    slots.commit(slots.reserve(_keys(hashes)))  # the source's flush stored them
    target = {**c.handle("session", {})[1], "slot_base": 0}
    body = {"token_ids": TOKENS, "first_block": 3, "slots": [[5]], "target": target, "deadline_s": 5}
    refused(c.handle("transfer", {**body, "target": {**target, "slot_size": 2 * VALUE}}), 409, "slot size mismatch")
    refused(c.handle("transfer", {**body, "slots": [[5, 6]]}), 400, "slots: expected 1 lists of 1")
    make_control.links[0].fail = True
    refused(c.handle("transfer", body), 502, "peer gone")


def test_a_transfer_of_values_the_source_no_longer_holds_is_refused(make_control, slots):
    c, _ = make_control(Pool(slots))
    target = {**c.handle("session", {})[1], "slot_base": 0}
    body = {"token_ids": TOKENS, "first_block": 0, "slots": [[1], [2], [3], [4]], "target": target, "deadline_s": 5}
    refused(c.handle("transfer", body), 409, "lost 4 values")


def test_an_instance_that_cannot_open_its_transfer_engine_answers_503(make_control, slots, monkeypatch):
    def unavailable(settings, region):
        raise LinkUnavailableError("no mooncake")

    monkeypatch.setattr(control, "PeerLink", unavailable)
    c, _ = make_control(Pool(slots))
    refused(c.handle("session", {}), 503, "no mooncake")
