"""Migration transport bandwidth: ``PeerLink.write`` into another process's region on loopback, next to memcpy.

The far end is ``vllm_aio.devtools.transfer_peer`` (a PeerLink in a process of
its own); this process writes from a registered buffer of its own. Each case
moves ``--total-mib`` of whole values of one size, in two layouts:

* ``contiguous``: value i from slot i to slot i on both sides, as the pool
  hands out a batch's slots where it can: coalescing makes long descriptors;
* ``scattered``: values from and to slots drawn at random from regions twice
  the total: one descriptor per value.

Baseline in the same run, interleaved per repetition: a plain memcpy of the
same number of bytes within this process (one numpy copy between two
contiguous buffers), the ceiling of any move on this host. Every region is
written once untimed first (page faults). Reported: median GB/s (1e9 B/s) of
``--repeats``; ``descriptors`` and ``batches`` are what ``plan_batches`` sends.

    .venv/bin/python -m benchmarks.transport
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from vllm_aio.devtools.transfer_peer import LOOPBACK, TransferPeer
from vllm_aio.migration.transport import PeerLink, plan_batches
from benchmarks._report import arguments, print_markdown, write_results

KiB, MiB = 1 << 10, 1 << 20
VALUE_SIZES = (8 * KiB, 64 * KiB, 512 * KiB, 2 * MiB)
LAYOUTS = ("contiguous", "scattered")


def human(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def slot_indices(layout: str, count: int, slots: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if layout == "contiguous":
        return np.arange(count), np.arange(count)
    return rng.choice(slots, count, replace=False), rng.choice(slots, count, replace=False)


def run_case(link: PeerLink, peer: TransferPeer, source: np.ndarray, memcpy_dst: np.ndarray,
             value: int, layout: str, total: int, repeats: int, rng: np.random.Generator) -> dict:
    count = total // value
    src, dst = slot_indices(layout, count, source.nbytes // value, rng)
    local = source.ctypes.data + src * value
    remote = peer.address + dst * value
    lengths = np.full(count, value)
    batches = plan_batches(local, remote, lengths)

    def write() -> None:
        link.write(peer.session_id, local, remote, lengths, time.monotonic() + 60)

    def memcpy() -> None:
        np.copyto(memcpy_dst, source[:total])

    write()  # untimed: the first write to a peer pays its handshake
    times: dict[str, list[float]] = {"write": [], "memcpy": []}
    for r in range(repeats):
        for name in (("write", "memcpy") if r % 2 == 0 else ("memcpy", "write")):
            start = time.perf_counter()
            (write if name == "write" else memcpy)()
            times[name].append(time.perf_counter() - start)
    if not np.array_equal(peer.view.reshape(-1, value)[dst], source.reshape(-1, value)[src]):
        raise AssertionError(f"{human(value)} {layout}: the peer holds other bytes than were written")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "value_bytes": value, "count": count, "layout": layout, "total_bytes": count * value,
        "descriptors": sum(len(size) for _, _, size in batches), "batches": len(batches),
        "write_GBps": count * value / med["write"] / 1e9, "memcpy_GBps": count * value / med["memcpy"] / 1e9,
        "write_over_memcpy": med["memcpy"] / med["write"], "samples_s": times,
    }


def main() -> int:
    parser = arguments(__doc__, "transport")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--total-mib", type=int, default=64, help="bytes moved per case, MiB")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.total_mib = min(args.repeats, 2), min(args.total_mib, 4)
    total = args.total_mib * MiB
    region = 2 * total  # room for scattered slots
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    source = rng.integers(0, 256, region, dtype=np.uint8)
    memcpy_dst = np.zeros(total, dtype=np.uint8)
    link = PeerLink(LOOPBACK, (source.ctypes.data, source.nbytes))
    rows = []
    try:
        with TransferPeer(region) as peer:
            peer.view[:] = 0  # fault the shared pages in once, untimed
            link.write(peer.session_id, [source.ctypes.data], [peer.address], [region], time.monotonic() + 60)
            for value in VALUE_SIZES:
                for layout in LAYOUTS:
                    rows.append(run_case(link, peer, source, memcpy_dst, value, layout, total, args.repeats, rng))
                    print(f"  {human(value)} {layout}: done", flush=True)
    finally:
        link.close()
    print_markdown(
        ("value", "count", "layout", "descriptors", "batches", "PeerLink.write GB/s", "memcpy GB/s",
         "write/memcpy"),
        [(human(r["value_bytes"]), str(r["count"]), r["layout"], str(r["descriptors"]), str(r["batches"]),
          f"{r['write_GBps']:.2f}", f"{r['memcpy_GBps']:.2f}", f"{r['write_over_memcpy']:.2f}") for r in rows],
        left=3,
        title=f"PeerLink.write to another process on loopback tcp vs memcpy, {human(total)} per case, "
              f"median of {args.repeats}",
    )
    write_results(args.json, "transport", started, total_bytes=total, repeats=args.repeats, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
