"""Embedded pool bandwidth: ``LocalBackend.batch_put`` / ``batch_get`` next to memcpy and torch ``copy_``.

Values are made like real KV blocks: one segment per layer, each segment one
block of a per-layer region of a torch uint8 "KV cache" tensor laid out as
vLLM's CPU cache is (``[num_layers][num_blocks][segment]``), on a few hundred
blocks picked at random (a prompt's blocks are scattered over the cache).

Baselines on the same total bytes, in the same run, interleaved per repetition:

* ``memcpy``: ONE single-threaded ``ctypes.memmove`` of the whole total between
  two contiguous, pre-faulted buffers (the ceiling of a copying pool);
* ``torch copy_``: ``dst.copy_(src)`` of the same bytes (may use several threads);
* ``memcpy/seg``: one ``ctypes.memmove`` per segment, gathering the same KV
  segments into a contiguous buffer: the pool's copies without the pool (no
  index, no lock), so ``put/seg`` isolates the pool's own overhead;
* ``copy_rows``: the copy kernel alone (``host_copy.copy_rows``, one call per
  layer) between the KV planes and the stored keys' pool slots, both ways, as
  a slot path that copies straight between cache and pool does on the CPU.

Note that glibc's ``memmove`` switches to non-temporal stores above
``x86_non_temporal_threshold`` (derived from the L3 size; a large L3 puts it at
tens or hundreds of MiB): a single huge memmove can get them, a per-block copy
never does. ``--nt-threshold BYTES`` re-runs every case in a child process with
``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=BYTES`` to show the effect.

The process's first copy compiles (or loads from numba's cache) the copy
loops: it runs untimed before every case, and its time is printed.

The pool is pre-faulted (its pages touched once, untimed) and every timed put
uses fresh keys (a re-put of a stored key returns EXISTS without copying);
every get reads keys stored by the first put. Medians of ``--repeats``.

Two extra columns show what a FRESH engine sees: ``put 1st`` writes into pool
pages never touched (the kernel allocates and zeroes them), ``get fresh map``
reads stored keys through a second, brand-new mapping of the pool (as a new
engine's worker does on its first load: every 4 KiB page faults once).

    .venv/bin/python -m benchmarks.pool_bandwidth
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks._pool import expect
from benchmarks._report import arguments, plot, plot_argument, print_markdown, progress, write_results

KiB, MiB = 1 << 10, 1 << 20
# name, segments per value (layers), segment bytes, blocks
CASES = [
    ("tiny KV (4 x 16 KiB)", 4, 16 * KiB, 512),
    ("medium KV (16 x 64 KiB)", 16, 64 * KiB, 256),
    ("1 MiB segments (2 x 1 MiB)", 2, 1 * MiB, 128),
]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def first_copy_seconds() -> float:
    """Time of this process's first host copy: numba compiles its loops, or loads them from its cache."""
    import numpy as np

    from vllm_aio.device.host_copy import copy_many, copy_rows

    buf = np.zeros(128, np.uint8)
    addr = np.array([buf.ctypes.data])
    start = time.perf_counter()
    copy_many(addr + 64, addr, np.array([64]))
    copy_rows(buf.ctypes.data + 64, 64, np.array([0]), buf.ctypes.data, 64, np.array([0]), 64)
    return time.perf_counter() - start


def run_case(name: str, num_segs: int, seg: int, blocks: int, repeats: int, seed: int) -> dict:
    import numpy as np
    import torch

    from vllm_aio.backends import Status
    from vllm_aio.backends.local import LocalBackend
    from vllm_aio.device.host_copy import copy_rows

    value = num_segs * seg
    total = value * blocks
    cache_blocks = blocks + blocks // 4
    # A KV cache as vLLM's CPU backend lays it out: per layer, [num_blocks, block bytes].
    kv = torch.randint(0, 256, (num_segs, cache_blocks, seg), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    block_ids = torch.randperm(cache_blocks, generator=gen)[:blocks].tolist()
    base, layer_stride = kv.data_ptr(), cache_blocks * seg
    segments = [[(base + layer * layer_stride + b * seg, seg) for layer in range(num_segs)] for b in block_ids]
    # Contiguous pre-faulted buffers of the same total for the baselines.
    src = torch.randint(0, 256, (total,), dtype=torch.uint8)
    dst = torch.zeros(total, dtype=torch.uint8)
    tag = uuid.uuid4().hex[:8]

    def keys(rep: int) -> list[str]:
        return [f"bench:{tag}:{rep}:{i}" for i in range(blocks)]

    # ---- a fresh engine's view: first-touch put, then get through a new mapping
    first_name = f"bench-bw-first-{tag}"
    writer = LocalBackend(first_name, value * blocks, value, seal=False)
    try:
        first_keys = keys(-1)
        put_first = timed(lambda: expect(writer.batch_put(first_keys, segments), Status.OK, "first put"))
        reader = LocalBackend(first_name, value * blocks, value, seal=False)  # a second mmap
        try:
            get_fresh = timed(lambda: expect(reader.batch_get(first_keys, segments), Status.OK, "get, fresh map"))
            get_mapped = timed(lambda: expect(reader.batch_get(first_keys, segments), Status.OK, "get"))
        finally:
            reader.close()
    finally:
        writer.close()

    # ---- steady state: a pre-faulted pool, fresh keys per put
    pool_name = f"bench-bw-{tag}"
    backend = LocalBackend(pool_name, value * blocks * (repeats + 1), value, seal=True)
    times: dict[str, list[float]] = {"put": [], "get": [], "memcpy": [], "torch": [], "memcpy_seg": [],
                                     "rows_put": [], "rows_get": [], "exists": []}
    gather, off = [], dst.data_ptr()
    for segs in segments:
        for addr, size in segs:
            gather.append((off, addr, size))
            off += size

    def memcpy_seg() -> None:
        move = ctypes.memmove
        for d, a, n in gather:
            move(d, a, n)

    try:
        backend.pool._data[:] = 0  # pre-fault every page of the pool (internal view; untimed)
        stored = keys(0)
        expect(backend.batch_put(stored, segments), Status.OK, "put")  # untimed: the keys gets read
        src_addr, dst_addr = src.data_ptr(), dst.data_ptr()
        # The stored keys' slots: copy_rows rewrites them (and the KV blocks) with the bytes they hold.
        slots = np.array([slot for slot, _ in backend.slots().pin_for_read(stored)])
        slot_base, slot_size, ids = backend.pool.slot_address(0), backend.pool.slot_size, np.array(block_ids)

        def rows_put() -> None:
            for layer in range(num_segs):
                copy_rows(slot_base + layer * seg, slot_size, slots, base + layer * layer_stride, seg, ids, seg)

        def rows_get() -> None:
            for layer in range(num_segs):
                copy_rows(base + layer * layer_stride, seg, ids, slot_base + layer * seg, slot_size, slots, seg)

        ops = {
            "put": lambda r: expect(backend.batch_put(keys(r + 1), segments), Status.OK, "put"),
            "get": lambda r: expect(backend.batch_get(stored, segments), Status.OK, "get"),
            "memcpy": lambda r: ctypes.memmove(dst_addr, src_addr, total),
            "torch": lambda r: dst.copy_(src),
            "memcpy_seg": lambda r: memcpy_seg(),
            "rows_put": lambda r: rows_put(),
            "rows_get": lambda r: rows_get(),
            "exists": lambda r: backend.batch_exists(stored),
        }
        names = list(ops)
        for r in range(repeats):
            order = names[r % len(names):] + names[: r % len(names)]  # rotate: no fixed position
            for op in order:
                times[op].append(timed(lambda: ops[op](r)))
    finally:
        backend.close()
    med = {op: statistics.median(ts) for op, ts in times.items()}
    return {
        "case": name, "segments": num_segs, "segment_bytes": seg, "blocks": blocks, "total_bytes": total,
        "put_GBps": gbps(total, med["put"]), "get_GBps": gbps(total, med["get"]),
        "memcpy_GBps": gbps(total, med["memcpy"]), "torch_copy_GBps": gbps(total, med["torch"]),
        "memcpy_seg_GBps": gbps(total, med["memcpy_seg"]),
        "rows_put_GBps": gbps(total, med["rows_put"]), "rows_get_GBps": gbps(total, med["rows_get"]),
        "rows_put_over_memcpy": med["memcpy"] / med["rows_put"],
        "rows_get_over_memcpy": med["memcpy"] / med["rows_get"],
        "put_over_memcpy": med["memcpy"] / med["put"], "get_over_memcpy": med["memcpy"] / med["get"],
        "put_over_memcpy_seg": med["memcpy_seg"] / med["put"], "get_over_memcpy_seg": med["memcpy_seg"] / med["get"],
        "exists_us_per_key": med["exists"] / blocks * 1e6,
        "put_first_touch_GBps": gbps(total, put_first), "get_fresh_map_GBps": gbps(total, get_fresh),
        "get_same_map_again_GBps": gbps(total, get_mapped),
        "samples_s": times,
    }


def print_table(rows: list[dict], title: str) -> None:
    head = ("case", "MiB", "put GB/s", "get GB/s", "memcpy GB/s", "torch copy_ GB/s", "memcpy/seg GB/s",
            "copy_rows put GB/s", "copy_rows get GB/s", "put/memcpy", "get/memcpy", "rows put/memcpy",
            "rows get/memcpy", "put/seg", "get/seg", "exists us/key", "put 1st GB/s", "get fresh map GB/s")
    goal = ("", "", "", "", "", "", "", "", "", "(>= 0.8)", "(>= 0.8)", "", "", "", "", "", "", "")
    print_markdown(head, [goal] + [(
        r["case"], f"{r['total_bytes'] / MiB:.0f}", f"{r['put_GBps']:.2f}", f"{r['get_GBps']:.2f}",
        f"{r['memcpy_GBps']:.2f}", f"{r['torch_copy_GBps']:.2f}", f"{r['memcpy_seg_GBps']:.2f}",
        f"{r['rows_put_GBps']:.2f}", f"{r['rows_get_GBps']:.2f}",
        f"{r['put_over_memcpy']:.2f}", f"{r['get_over_memcpy']:.2f}",
        f"{r['rows_put_over_memcpy']:.2f}", f"{r['rows_get_over_memcpy']:.2f}",
        f"{r['put_over_memcpy_seg']:.2f}", f"{r['get_over_memcpy_seg']:.2f}", f"{r['exists_us_per_key']:.1f}",
        f"{r['put_first_touch_GBps']:.2f}", f"{r['get_fresh_map_GBps']:.2f}",
    ) for r in rows], left=1, title=title)


def plot_bandwidth(rows: list[dict], path: Path) -> None:
    """put and get GB/s against the value size, under one memcpy of the same bytes (the ceiling)."""
    rows = sorted(rows, key=lambda r: r["segments"] * r["segment_bytes"])
    sizes = [r["segments"] * r["segment_bytes"] / KiB for r in rows]
    plot(path, "Embedded pool put/get vs memcpy", ("value KiB (one KV block of one rank)", "GB/s"),
         {op: (sizes, [r[f"{op}_GBps"] for r in rows]) for op in ("put", "get")},
         {"memcpy (ceiling)": (sizes, [r["memcpy_GBps"] for r in rows])}, log="x")


def main() -> int:
    parser = arguments(__doc__, "pool_bandwidth")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--blocks-scale", type=float, default=1.0, help="multiply every case's block count")
    parser.add_argument("--nt-threshold", type=int, default=None, metavar="BYTES",
                        help="also run every case with glibc's non-temporal threshold set to BYTES")
    parser.add_argument("--rows-json", type=Path, help=argparse.SUPPRESS)  # child mode
    plot_argument(parser)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.blocks_scale = min(args.repeats, 2), min(args.blocks_scale, 0.05)
    import torch

    started = time.perf_counter()
    first_copy = first_copy_seconds()
    print(f"  first copy in this process (numba compiles or loads the copy loops): {first_copy * 1e3:.0f} ms",
          flush=True)
    rows = []
    for i, (name, num_segs, seg, blocks) in progress(enumerate(CASES), len(CASES), "cases", args.quick):
        rows.append(run_case(name, num_segs, seg, max(1, int(blocks * args.blocks_scale)), args.repeats, i))
        print(f"  {name}: done", flush=True)
    if args.rows_json:  # child: hand the rows back, print nothing else
        args.rows_json.write_text(json.dumps(rows))
        return 0
    nt_rows = None
    if args.nt_threshold:
        with tempfile.TemporaryDirectory() as tmp:
            rows_path = Path(tmp) / "rows.json"
            env = {**os.environ, "GLIBC_TUNABLES": f"glibc.cpu.x86_non_temporal_threshold={args.nt_threshold}"}
            print(f"  again with {env['GLIBC_TUNABLES']} (child process)", flush=True)
            subprocess.run([sys.executable, "-m", "benchmarks.pool_bandwidth", "--repeats", str(args.repeats),
                            "--blocks-scale", str(args.blocks_scale), "--rows-json", str(rows_path)],
                           env=env, check=True)
            nt_rows = json.loads(rows_path.read_text())
    print_table(rows, f"Embedded pool (LocalBackend) vs memcpy, median of {args.repeats}; "
                      f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs")
    if args.plot:
        plot_bandwidth(rows, args.plot)
    if nt_rows:
        print_table(nt_rows, f"Same, GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold={args.nt_threshold}")
    write_results(args.json, "pool_bandwidth", started, torch_threads=torch.get_num_threads(), rows=rows,
                  nt_threshold=args.nt_threshold, nt_rows=nt_rows, first_copy_s=first_copy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
