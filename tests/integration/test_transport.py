"""PeerLink against a real TransferEngine in a second process, on loopback tcp.

The far end is ``devtools.transfer_peer``: a PeerLink in a process of its own
over a ``/dev/shm`` mapping this process maps too, so every test reads what
arrived without asking the peer. Timings asserted are what Mooncake 0.3.13
does here (see ``vllm_aio.migration.transport``): failures come back fast, a
stalled peer within the transfer timeout. Under ``CI`` a missing mooncake
fails these tests instead of skipping them (``conftest.require``).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator

import numpy as np
import pytest

from harness.prerequisites import ROOT, require
from vllm_aio.devtools.mooncake_pool import free_port
from vllm_aio.devtools.transfer_peer import LOOPBACK, TransferPeer
from vllm_aio.migration import transport
from vllm_aio.migration.transport import (
    MAX_BATCH_DESCRIPTORS, TRANSFER_TIMEOUT_S, LinkUnavailableError, PeerLink, TransferError, coalesce,
    plan_batches,
)

REGION = 32 << 20
SLOT = 8 << 10
FILL = 0xAB  # what the peer's region holds where nothing was written


@pytest.fixture(scope="module")
def source() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, REGION, dtype=np.uint8)


@pytest.fixture(scope="module")
def link(source: np.ndarray) -> Iterator[PeerLink]:
    require("mooncake.engine")
    with pytest.MonkeyPatch.context() as mp:  # the transfer timeout is ours, whatever the environment says
        mp.delenv("MC_TRANSFER_TIMEOUT", raising=False)
        peer_link = PeerLink(LOOPBACK, (source.ctypes.data, source.nbytes))
    yield peer_link
    peer_link.close()


@pytest.fixture(scope="module")
def shared_peer(link: PeerLink) -> Iterator[TransferPeer]:
    with TransferPeer(REGION) as peer:
        yield peer


@pytest.fixture
def peer(shared_peer: TransferPeer) -> TransferPeer:
    """The module's peer with its region refilled with FILL."""
    shared_peer.view[:] = FILL
    return shared_peer


def slots(base: int, indices: np.ndarray, size: int = SLOT) -> np.ndarray:
    return base + np.asarray(indices, dtype=np.int64) * size


def landed(peer: TransferPeer, indices: np.ndarray, size: int = SLOT) -> np.ndarray:
    return peer.view.reshape(-1, size)[indices]


def sent(source: np.ndarray, indices: np.ndarray, size: int = SLOT) -> np.ndarray:
    return source.reshape(-1, size)[indices]


def later(seconds: float = 30.0) -> float:
    return time.monotonic() + seconds


# -- planning (no engine) ---------------------------------------------------


def test_spans_contiguous_on_both_sides_merge_into_one_descriptor() -> None:
    local = [0, 10, 20, 100, 110, 200]
    remote = [1000, 1010, 1020, 5000, 7000, 7010]  # 110 continues locally only
    loc, rem, size = coalesce(local, remote, [10] * 6)
    assert loc.tolist() == [0, 100, 110, 200]
    assert rem.tolist() == [1000, 5000, 7000, 7010]
    assert size.tolist() == [30, 10, 10, 10]


def byte_pairs(local, remote, lengths) -> list[tuple[int, int]]:
    """Every (local byte, remote byte) the spans move, sorted."""
    return sorted((int(a) + k, int(b) + k) for a, b, n in zip(local, remote, lengths) for k in range(int(n)))


def test_batches_stay_within_bounds_and_cover_every_byte_once() -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 40, 400)  # some longer than a batch
    local = np.cumsum(lengths + np.where(rng.random(400) < 0.5, 0, 3)) - lengths  # half continue the previous
    remote = 10_000 + np.cumsum(lengths + np.where(rng.random(400) < 0.7, 0, 5)) - lengths

    batches = plan_batches(local, remote, lengths, max_descriptors=7, max_bytes=16)

    assert all(len(size) <= 7 and int(size.sum()) <= 16 for _, _, size in batches)
    assert byte_pairs(*map(np.concatenate, zip(*batches))) == byte_pairs(local, remote, lengths)


def test_a_value_longer_than_a_batch_is_cut_to_fit() -> None:
    batches = plan_batches([0], [0], [40], max_descriptors=4, max_bytes=16)
    assert [size.tolist() for _, _, size in batches] == [[16], [16], [8]]
    assert [loc.tolist() for loc, _, _ in batches] == [[0], [16], [32]]


def test_spans_with_a_nonpositive_length_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        coalesce([0, 8], [0, 8], [8, 0])


def test_without_mooncake_the_error_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import fails as if not installed
    with pytest.raises(LinkUnavailableError, match="pip install mooncake-transfer-engine"):
        PeerLink(LOOPBACK, (0, 0))


def test_the_module_imports_without_mooncake() -> None:
    code = "import sys, vllm_aio.migration.transport; assert not any(m.startswith('mooncake') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={"PYTHONPATH": str(ROOT)})


# -- writes to a real peer --------------------------------------------------


def test_bytes_land_exactly_in_merged_runs_and_scattered_slots(
    link: PeerLink, peer: TransferPeer, source: np.ndarray
) -> None:
    rng = np.random.default_rng(2)
    run_src, run_dst = np.arange(0, 16), np.arange(100, 116)  # back to back on both sides: one descriptor
    local_run_src, local_run_dst = np.arange(40, 48), rng.permutation(np.arange(300, 400))[:8]  # local run only
    scattered_src = rng.choice(np.arange(500, 4096), 200, replace=False)
    scattered_dst = rng.choice(np.arange(1000, 4096), 200, replace=False)
    src = np.concatenate([run_src, local_run_src, scattered_src])
    dst = np.concatenate([run_dst, local_run_dst, scattered_dst])

    written = link.write(peer.session_id, slots(source.ctypes.data, src), slots(peer.address, dst),
                         np.full(len(src), SLOT), later())

    assert written == len(src) * SLOT
    np.testing.assert_array_equal(landed(peer, dst), sent(source, src))
    untouched = np.setdiff1d(np.arange(REGION // SLOT), dst)
    assert (landed(peer, untouched) == FILL).all()


def test_more_spans_than_a_batch_holds_all_land(link: PeerLink, peer: TransferPeer, source: np.ndarray) -> None:
    # 5,000 scattered 1 KiB spans: five batches; one batch of them all would break the link to the peer.
    size, count = 1 << 10, 5000
    rng = np.random.default_rng(3)
    src, dst = rng.permutation(count), rng.permutation(REGION // size)[:count]

    written = link.write(peer.session_id, slots(source.ctypes.data, src, size), slots(peer.address, dst, size),
                         np.full(count, size), later())

    assert written == count * size
    np.testing.assert_array_equal(landed(peer, dst, size), sent(source, src, size))


def test_concurrent_writes_to_one_peer_take_turns(link: PeerLink, peer: TransferPeer, source: np.ndarray) -> None:
    # Three writes of 1,100 spans at once would overflow the peer's queue (about 2,048) if their batches overlapped.
    size, count, writers = 2 << 10, 1100, 3
    results: list[int | BaseException] = []

    def write(first: int) -> None:
        src = np.arange(first, first + count) * 2  # every other slot: nothing merges
        try:
            results.append(link.write(peer.session_id, slots(source.ctypes.data, src, size),
                                      slots(peer.address, src, size), np.full(count, size), later()))
        except BaseException as e:  # reported by the assertion below
            results.append(e)

    threads = [threading.Thread(target=write, args=(first,)) for first in range(0, writers * count, count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert results == [count * size] * writers
    every = np.arange(writers * count) * 2
    np.testing.assert_array_equal(landed(peer, every, size), sent(source, every, size))


def test_a_write_past_its_deadline_raises_before_writing(
    link: PeerLink, peer: TransferPeer, source: np.ndarray
) -> None:
    with pytest.raises(TransferError, match="deadline"):
        link.write(peer.session_id, [source.ctypes.data], [peer.address], [SLOT], time.monotonic() - 1)
    assert (peer.view == FILL).all()


def test_a_deadline_passing_between_batches_stops_the_write(
    link: PeerLink, peer: TransferPeer, source: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = MAX_BATCH_DESCRIPTORS + 100  # two batches
    src = np.arange(count) * 2
    checks = iter([0.0, 2.0])  # the clock before the first batch, then before the second
    monkeypatch.setattr(transport, "time", types.SimpleNamespace(monotonic=lambda: next(checks)))

    with pytest.raises(TransferError, match="deadline before batch 2 of 2"):
        link.write(peer.session_id, slots(source.ctypes.data, src), slots(peer.address, src),
                   np.full(count, SLOT), deadline=1.0)

    first = src[:MAX_BATCH_DESCRIPTORS]
    np.testing.assert_array_equal(landed(peer, first), sent(source, first))
    assert (landed(peer, src[MAX_BATCH_DESCRIPTORS:]) == FILL).all()


def test_a_write_outside_the_peers_region_fails_and_leaves_the_link_usable(
    link: PeerLink, peer: TransferPeer, source: np.ndarray
) -> None:
    with pytest.raises(TransferError, match=f"write to {peer.session_id} failed"):
        link.write(peer.session_id, [source.ctypes.data], [peer.address + REGION], [SLOT], later())
    assert link.write(peer.session_id, [source.ctypes.data], [peer.address], [SLOT], later()) == SLOT


def test_spans_outside_the_local_region_are_refused(link: PeerLink, peer: TransferPeer, source: np.ndarray) -> None:
    with pytest.raises(ValueError, match="outside the registered region"):
        link.write(peer.session_id, [source.ctypes.data + REGION - SLOT // 2], [peer.address], [SLOT], later())


def test_a_write_to_an_unknown_session_fails_fast(link: PeerLink, source: np.ndarray) -> None:
    start = time.monotonic()
    with pytest.raises(TransferError, match="rc="):
        link.write(f"127.0.0.1:{free_port()}", [source.ctypes.data], [1 << 30], [SLOT], later())
    assert time.monotonic() - start < 3


def test_a_write_to_a_peer_that_exited_fails_fast(link: PeerLink, source: np.ndarray) -> None:
    with TransferPeer(1 << 20) as peer:
        assert link.write(peer.session_id, [source.ctypes.data], [peer.address], [SLOT], later()) == SLOT
        peer.kill()
        start = time.monotonic()
        with pytest.raises(TransferError, match="rc="):
            link.write(peer.session_id, [source.ctypes.data], [peer.address], [SLOT], later())
        assert time.monotonic() - start < 3


def test_a_write_to_a_stalled_peer_fails_within_the_transfer_timeout(link: PeerLink, source: np.ndarray) -> None:
    # More than loopback's socket buffers can take from a peer that reads nothing (here
    # net.ipv4.tcp_rmem allows 32 MiB, tcp_wmem 4 MiB): 8 MiB sometimes fit, and the write
    # then succeeded.
    with TransferPeer(2 * REGION) as peer:
        assert link.write(peer.session_id, [source.ctypes.data], [peer.address], [SLOT], later()) == SLOT
        peer.stop()
        start = time.monotonic()
        with pytest.raises(TransferError, match="rc="):
            link.write(peer.session_id, [source.ctypes.data] * 2, [peer.address, peer.address + REGION],
                       [REGION, REGION], later())
        assert time.monotonic() - start < TRANSFER_TIMEOUT_S + 3
        peer.kill()  # a stopped peer would not end when asked


def test_close_is_idempotent_and_later_writes_raise(source: np.ndarray) -> None:
    require("mooncake.engine")
    own = PeerLink(LOOPBACK, (source.ctypes.data, source.nbytes))
    session = own.session_id
    own.close()
    own.close()
    with pytest.raises(TransferError, match="closed"):
        own.write(session, [source.ctypes.data], [source.ctypes.data], [SLOT], later())
