"""The connector's real transfer path on the device: ``BlockIO`` over the embedded ``LocalBackend``.

``BlockIO`` is built by ``open_block_io``, as the worker builds it (layout,
one staging buffer per direction, registrations), over a fresh pool per case.

What is measured (one batch of scattered blocks per call, median of ``--repeats``
after ``--warmup``; every timing starts and ends with a device synchronize):

* ``save``: ``BlockIO.save`` = on-device gather of the blocks into a scratch,
  one device-to-host copy into page-locked staging, headers written, then
  ``LocalBackend.batch_put`` (memcpy staging -> pool in ``/dev/shm``);
* ``load``: ``BlockIO.load`` = ``LocalBackend.batch_get`` (memcpy pool ->
  page-locked staging), header check, one host-to-device copy, on-device
  scatter into the paged cache.

Those two are the *staged* path (what Mooncake and Memcache take, and the
embedded pool where the device cannot map host memory). Where it can (CUDA),
``open_block_io`` picks the *direct* path (``connector/worker/block_io/mapped_slots.py``), timed
side by side as ``direct save`` / ``direct load``: the pool's slots are mapped
into the device once, a load is one gather kernel reading the slots plus the
on-device scatter, a save the on-device gather plus one scatter kernel writing
the slots; no host memcpy, no staging. Its stage ceilings (second table):
``slot gather`` / ``slot scatter``, the kernels alone on the mapped slots.

GB/s everywhere is payload bytes (the KV bytes of the batch, headers excluded)
over wall time. The KV cache is Llama-3-8B's per rank at TP=1: 32 layers, each
``[2, num_blocks, 16, 8, 128]`` bf16 (FlashAttention's layout: a K and a V
plane of 32 KiB per block per layer). Two value units, as the connector stores
them: whole blocks (``Unit(all 32 layers)``: 2 MiB + a 64-byte header per
value) and one layer (layerwise, ``Unit((l,), l)``: 64 KiB + header per value),
at batches of 64 and 256 blocks picked at random from the cache.

Ceilings, measured in the same run on the same bytes (n values, headers
included), interleaved with the path in each repetition:

* ``pinned H2D`` / ``D2H``: one copy of the batch between a pinned host buffer
  and the device (CUDA events);
* ``host memcpy``: torch ``copy_`` between two pinned host buffers (may use
  several threads); ``1-thread memmove`` (second table): one ``ctypes.memmove``,
  the primitive the pool copies with;
* ``pool get`` / ``pool put``: ``LocalBackend.batch_get`` / ``batch_put`` alone,
  into / from a pinned buffer laid out as the staging is (one value per row):
  the pool's share of the path;
* (second table) ``scatter`` / ``gather``: ``BlockLayout.scatter`` /
  ``gather`` alone on the device (CUDA events): the path's on-device share.

BlockIO overlaps its stages chunk by chunk (the batch_get of one chunk while
the previous one crosses the link and is scattered; a save's pool put of one
chunk while the next is copied into staging), so the path takes at least its
largest stage and at most their sum: the stage table gives both next to the
measured path, and the conclusion the share of pinned the largest stage leaves.

The pool is sized for every timed put to use fresh keys (a put of a stored key
returns EXISTS without copying), capped by ``--pool-gib`` and the free space
of ``/dev/shm``; when capped, it is filled to the brim before timing so that
every timed put evicts (the steady state of a full pool), and the keys loaded
are refreshed before each repetition's puts so LRU never evicts them. The pool
is pre-faulted (filled once, untimed). Each case checks once that loaded
blocks equal the saved ones byte for byte.

Run locally (CPU, tiny sizes: a smoke test of the code paths, timings meaningless):

    .venv/bin/python -m benchmarks.block_io_device --device cpu --quick

On the GPU machine, through the device tool (python3 there holds torch):

    python3 -m benchmarks.block_io_device --json $OUT/block_io_device.json

Results JSON goes to ``benchmarks/results/block_io_device.json`` unless ``--json``.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vllm_aio.backends import Status
from vllm_aio.backends.local import LocalBackend
from vllm_aio.connector.worker.block_io import (
    BlockIO, BlockRef, CopyHandoff, InPlacePath, StagedPath, ValueLabels, open_block_io,
)
from vllm_aio.device.block_layout import BlockLayout
from vllm_aio.device.staging import StagingBuffer
from vllm_aio.device.accelerator import Device
from vllm_aio.pool import shm_file
from vllm_aio.pool.entry import HEADER_BYTES
from vllm_aio.pool.keys import Unit
from benchmarks._accel import Accel, timed, wall
from benchmarks._model import DTYPE, LLAMA3_8B, TINY, Model
from benchmarks._pool import expect, free_bytes, header, use_pool_dir
from benchmarks._report import arguments, plot, plot_argument, print_markdown, write_results

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def load_and_wait(io: BlockIO, blocks: list[BlockRef], unit: Unit) -> list[Status]:
    """BlockIO.load as the worker uses it: the current stream waits for the copies."""
    loaded = io.load(blocks, unit)
    io.device.wait(loaded.copied)
    return loaded.settle()


# ---------------------------------------------------------------- one case

@dataclass(frozen=True)
class Case:
    unit_name: str  # "whole block" or "one layer"
    blocks: int


class Bench:
    """The cache and the ceilings' buffers shared by every case; each case opens its own pool and BlockIO."""

    def __init__(self, acc: Accel, m: Model, max_blocks: int, args) -> None:
        self.acc, self.m, self.args = acc, m, args
        dev = acc.device
        self.num_blocks = 2 * max_blocks + 64  # saved and loaded block ids never overlap
        on_dev = torch.Generator(device=dev).manual_seed(0)
        shape = (2, self.num_blocks, m.block_size, m.kv_heads, m.head_dim)
        self.names = [f"layers.{i}.attn" for i in range(m.layers)]
        self.caches = {  # random bits (compared as int16: bf16 NaNs are never equal), made on the device
            n: torch.randint(-32768, 32767, shape, generator=on_dev, dtype=torch.int16, device=dev).view(DTYPE)
            for n in self.names
        }
        self.layout = BlockLayout(self.caches, self.names, self.num_blocks)  # the on-device ceilings
        self.max_bytes = max_blocks * (HEADER_BYTES + self.layout.payload_bytes(range(m.layers)))
        self.host_a = acc.pinned(self.max_bytes)  # ceilings: pinned on an accelerator
        self.host_b = acc.pinned(self.max_bytes)
        self.host_a.fill_(1)
        self.host_b.fill_(2)
        self.dev_buf = torch.empty(self.max_bytes, dtype=torch.uint8, device=dev) if acc.is_async else None
        self.gen = torch.Generator().manual_seed(0)

    def unit(self, name: str) -> Unit:
        if name == "whole block":
            return Unit(tuple(range(self.m.layers)), None)
        return Unit((self.args.layer,), self.args.layer)

    def run(self, case: Case) -> dict:
        args, acc, n = self.args, self.acc, case.blocks
        dev = acc.device
        unit = self.unit(case.unit_name)
        payload = self.layout.payload_bytes(unit.layers)
        value = HEADER_BYTES + payload
        batch = n * value  # bytes that cross each stage
        reps = args.warmup + args.repeats
        want_slots = n * (1 + 2 * reps)  # the loaded keys + fresh keys for each save and pool put
        shm_free = free_bytes()
        cap = min(int(args.pool_gib * GiB), int(shm_free * 0.8))
        slots = min(want_slots, cap // value)
        row: dict = {"case": case.unit_name, "blocks": n, "value_bytes": value, "payload_bytes": n * payload,
                     "pool_slots": slots, "pool_GiB": slots * value / GiB, "shm_free_GiB": shm_free / GiB}
        if slots < 3 * n:
            row["skipped"] = (f"pool of {slots} slots < 3 x {n} (--pool-gib {args.pool_gib}, "
                              f"{shm_free / GiB:.1f} GiB free in {shm_file.SHM_DIR})")
            print(f"  {case.unit_name} x {n}: SKIPPED, {row['skipped']}", flush=True)
            return row
        full = slots < want_slots
        perm = torch.randperm(self.num_blocks, generator=self.gen)
        src_ids, dst_ids = perm[:n].tolist(), perm[n:2 * n].tolist()
        tag = uuid.uuid4().hex[:8]
        mapped = None
        backend = LocalBackend(f"bench-bio-{tag}", slots * value, value, seal=True)
        try:
            direct = open_block_io(self.caches, self.names, self.num_blocks, backend, header(self.m.block_size),
                                   self.max_bytes, 30.0)
            device = Device(dev)
            staged = InPlacePath if device.is_host else StagedPath  # the path without slots, forced
            io = staged(ValueLabels(header(self.m.block_size), self.layout), device, self.layout, backend,
                        StagingBuffer(device, self.max_bytes), StagingBuffer(device, self.max_bytes), 30.0)
            pool = backend.pool
            pool._data[:] = 0  # pre-fault every page of the pool (internal view; untimed)
            host_rows = [[(self.host_a.data_ptr() + i * value, value)] for i in range(n)]
            if full:  # fill to the brim: every timed put then evicts, as in a full pool's steady state
                for start in range(0, slots, n):
                    k = min(n, slots - start)
                    expect(backend.batch_put([f"fill:{start + i}" for i in range(k)], host_rows[:k]),
                           Status.OK, "fill")
            loaded = [BlockRef(b, f"{tag}:load:{i}".encode()) for i, b in enumerate(src_ids)]
            expect(io.save(loaded, unit, io.device.record(), CopyHandoff()), Status.OK, "save of the loaded set")
            into = [BlockRef(b, r.block_hash) for b, r in zip(dst_ids, loaded)]
            load_keys = io.keys(loaded, unit)
            ids_dev = torch.tensor(dst_ids, dtype=torch.int64, device=dev)
            ids_src_dev = torch.tensor(src_ids, dtype=torch.int64, device=dev)
            dev_rows = (self.dev_buf[:batch].view(n, value) if self.dev_buf is not None
                        else torch.empty(n, value, dtype=torch.uint8))
            a, b = self.host_a[:batch], self.host_b[:batch]
            a_addr, b_addr = a.data_ptr(), b.data_ptr()
            counter = iter(range(1 << 30))

            def fresh(kind: str) -> list[BlockRef]:
                r = next(counter)
                return [BlockRef(bid, f"{tag}:{kind}:{r}:{i}".encode()) for i, bid in enumerate(src_ids)]

            def do_save(io: BlockIO = io) -> None:
                refs, handoff = fresh("save"), CopyHandoff()
                expect(io.save(refs, unit, io.device.record(), handoff), Status.OK, "BlockIO.save")

            def do_put() -> None:
                keys = io.keys(fresh("put"), unit)
                expect(backend.batch_put(keys, host_rows), Status.OK, "pool put")

            def events(fn) -> float:  # seconds of the device work fn enqueues (CUDA events; wall time on CPU)
                return timed(acc, lambda _start: fn()) * 1e-3

            reads = {
                "load": lambda: wall(acc, lambda: expect(load_and_wait(io, into, unit), Status.OK, "BlockIO.load")),
                "pool_get": lambda: wall(acc, lambda: expect(backend.batch_get(load_keys, host_rows), Status.OK,
                                                             "pool get")),
                "host_memcpy": lambda: wall(acc, lambda: b.copy_(a)),
                "memmove_1t": lambda: wall(acc, lambda: ctypes.memmove(b_addr, a_addr, batch)),
            }
            writes = {
                "save": lambda: wall(acc, do_save),
                "pool_put": lambda: wall(acc, do_put),
            }
            if acc.is_async:
                reads["h2d"] = lambda: events(lambda: dev_rows.copy_(a.view(n, value), non_blocking=True))
                writes["d2h"] = lambda: events(lambda: a.view(n, value).copy_(dev_rows, non_blocking=True))
                reads["scatter"] = lambda: events(
                    lambda: self.layout.scatter(dev_rows[:, HEADER_BYTES:], ids_dev, unit.layers))
                writes["gather"] = lambda: events(
                    lambda: self.layout.gather(ids_src_dev, unit.layers, dev_rows[:, HEADER_BYTES:]))
            if direct.direct:
                reads["direct_load"] = lambda: wall(acc, lambda: expect(load_and_wait(direct, into, unit), Status.OK,
                                                                        "direct BlockIO.load"))
                writes["direct_save"] = lambda: wall(acc, lambda: do_save(direct))
            mapped = device.map_host(*pool.region()) if direct.direct and acc.is_async else None
            if mapped is not None:  # the direct path's kernels alone
                slots = torch.tensor([p[0] for p in backend.slots().pin_for_read(load_keys)], dtype=torch.int64,
                                     device=dev)
                rows = mapped.tensor.view(torch.int64).view(-1, value // 8)
                words = dev_rows.view(torch.int64)
                reads["slot_gather"] = lambda: events(lambda: torch.index_select(rows, 0, slots, out=words))
                writes["slot_scatter"] = lambda: events(
                    lambda: rows[:, HEADER_BYTES // 8:].index_copy_(0, slots, words[:, HEADER_BYTES // 8:]))
            samples: dict[str, list[float]] = {k: [] for k in (*reads, *writes)}
            evictions0 = None
            for rep in range(reps):
                if rep == args.warmup:
                    evictions0 = pool.usage().evictions
                # reads first: the loaded keys are then the most recently used and never evicted by the puts
                for group in (reads, writes):
                    names = list(group)
                    k = rep % len(names)
                    for op in names[k:] + names[:k]:  # rotate: no op always first
                        t = group[op]()
                        if rep >= args.warmup:
                            samples[op].append(t)
                        if op in ("load", "direct_load") and rep == 0:  # before the scatter ceiling writes them
                            row["check" if op == "load" else "direct_check"] = self._check(unit, src_ids, dst_ids)
            row["evictions_timed"] = pool.usage().evictions - (evictions0 or 0)
            row["pool_full"] = full
        finally:
            if mapped is not None:
                mapped.release()
            direct.close()
            backend.close()
        med = {k: statistics.median(v) for k, v in samples.items()}
        gbps = lambda nbytes, s: nbytes / s / 1e9  # noqa: E731
        row.update({
            "median_s": med, "samples_s": samples,
            "save_GBps": gbps(n * payload, med["save"]), "load_GBps": gbps(n * payload, med["load"]),
            "pool_get_GBps": gbps(batch, med["pool_get"]), "pool_put_GBps": gbps(batch, med["pool_put"]),
            "host_memcpy_GBps": gbps(batch, med["host_memcpy"]), "memmove_1t_GBps": gbps(batch, med["memmove_1t"]),
        })
        if "direct_load" in med:
            row.update({
                "direct_load_GBps": gbps(n * payload, med["direct_load"]),
                "direct_save_GBps": gbps(n * payload, med["direct_save"]),
            })
        if "slot_gather" in med:
            row.update({
                "slot_gather_GBps": gbps(batch, med["slot_gather"]),
                "slot_scatter_GBps": gbps(batch, med["slot_scatter"]),
                "direct_load_stage_sum_s": med["slot_gather"] + med["scatter"],
                "direct_save_stage_sum_s": med["gather"] + med["slot_scatter"],
            })
        if acc.is_async:
            row.update({
                "h2d_GBps": gbps(batch, med["h2d"]), "d2h_GBps": gbps(batch, med["d2h"]),
                "scatter_GBps": gbps(n * payload, med["scatter"]), "gather_GBps": gbps(n * payload, med["gather"]),
                "load_stage_sum_s": med["pool_get"] + med["h2d"] + med["scatter"],
                "save_stage_sum_s": med["gather"] + med["d2h"] + med["pool_put"],
            })
            row["load_over_h2d"] = row["load_GBps"] / row["h2d_GBps"]
            row["save_over_d2h"] = row["save_GBps"] / row["d2h_GBps"]
            if "direct_load_GBps" in row:
                row["direct_load_over_h2d"] = row["direct_load_GBps"] / row["h2d_GBps"]
                row["direct_save_over_d2h"] = row["direct_save_GBps"] / row["d2h_GBps"]
        print(f"  {case.unit_name} x {n}: direct load {fmt(row, 'direct_load_GBps')} GB/s, direct save "
              f"{fmt(row, 'direct_save_GBps')} GB/s; staged load {row['load_GBps']:.2f} GB/s, "
              f"save {row['save_GBps']:.2f} GB/s, check {row.get('check')}, "
              f"direct check {row.get('direct_check', 'n/a')}, evictions {row['evictions_timed']}", flush=True)
        return row

    def _check(self, unit: Unit, src: list[int], dst: list[int]) -> str:
        """The first (warm-up) load put the saved blocks' bytes into the other block ids."""
        s, d = torch.tensor(src, device=self.acc.device), torch.tensor(dst, device=self.acc.device)
        for i in unit.layers:
            t = self.caches[self.names[i]]
            if not torch.equal(t.index_select(1, s).view(torch.int16), t.index_select(1, d).view(torch.int16)):
                return f"FAILED at layer {i}"
        return "ok"


# ---------------------------------------------------------------- output

def fmt(row: dict, key: str, spec: str = ".2f") -> str:
    v = row.get(key)
    return "n/a" if v is None else format(v, spec)


def print_tables(rows: list[dict]) -> None:
    done = [r for r in rows if "skipped" not in r]

    def ms(r: dict, k: str) -> str:
        return "n/a" if k not in r["median_s"] else f"{r['median_s'][k] * 1e3:.2f}"

    def sum_ms(r: dict, k: str) -> str:
        return "n/a" if k not in r else f"{r[k] * 1e3:.2f}"

    print_markdown(
        ["case", "blocks", "MiB", "direct load GB/s", "direct save GB/s", "pinned H2D GB/s", "pinned D2H GB/s",
         "direct load/H2D", "direct save/D2H", "staged load GB/s", "staged save GB/s", "staged load/H2D",
         "pool-only get GB/s", "pool-only put GB/s", "host memcpy GB/s"],
        [[r["case"], str(r["blocks"]), f"{r['payload_bytes'] / MiB:g}", fmt(r, "direct_load_GBps"),
          fmt(r, "direct_save_GBps"), fmt(r, "h2d_GBps"), fmt(r, "d2h_GBps"), fmt(r, "direct_load_over_h2d"),
          fmt(r, "direct_save_over_d2h"), fmt(r, "load_GBps"), fmt(r, "save_GBps"), fmt(r, "load_over_h2d"),
          fmt(r, "pool_get_GBps"), fmt(r, "pool_put_GBps"), fmt(r, "host_memcpy_GBps")] for r in done])
    print_markdown(
        ["case", "blocks", "direct load ms", "slot gather", "scatter", "sum", "direct save ms", "gather",
         "slot scatter", "sum", "slot gather GB/s", "slot scatter GB/s", "check"],
        [[r["case"], str(r["blocks"]), ms(r, "direct_load"), ms(r, "slot_gather"), ms(r, "scatter"),
          sum_ms(r, "direct_load_stage_sum_s"), ms(r, "direct_save"), ms(r, "gather"), ms(r, "slot_scatter"),
          sum_ms(r, "direct_save_stage_sum_s"), fmt(r, "slot_gather_GBps"), fmt(r, "slot_scatter_GBps"),
          r.get("direct_check", "n/a")]
         for r in done if "direct_load" in r["median_s"]],
        title="Direct path stages (median ms; kernels only, no host memcpy: load = slot gather + scatter, "
              "save = gather + slot scatter)")
    def ms(r: dict, k: str) -> str:
        return "n/a" if k not in r["median_s"] else f"{r['median_s'][k] * 1e3:.2f}"

    def sum_ms(r: dict, k: str) -> str:
        return "n/a" if k not in r else f"{r[k] * 1e3:.2f}"

    print_markdown(
        ["case", "blocks", "load ms", "pool get", "H2D", "scatter", "sum", "save ms", "gather", "D2H", "pool put",
         "sum", "1-thread memmove GB/s", "scatter GB/s", "gather GB/s", "pool full", "check"],
        [[r["case"], str(r["blocks"]), ms(r, "load"), ms(r, "pool_get"), ms(r, "h2d"), ms(r, "scatter"),
          sum_ms(r, "load_stage_sum_s"),
          ms(r, "save"), ms(r, "gather"), ms(r, "d2h"), ms(r, "pool_put"),
          sum_ms(r, "save_stage_sum_s"),
          fmt(r, "memmove_1t_GBps"), fmt(r, "scatter_GBps"), fmt(r, "gather_GBps"),
          "yes" if r["pool_full"] else "no", r["check"]] for r in done],
        title="Staged path stages (median ms; load = pool get + H2D + scatter, save = gather + D2H + pool put, "
              "overlapped chunk by chunk inside BlockIO: between the largest stage and the sum)")
    for r in rows:
        if "skipped" in r:
            print(f"\nskipped: {r['case']} x {r['blocks']}: {r['skipped']}")


def conclusion(rows: list[dict]) -> str:
    done = [r for r in rows if "skipped" not in r and "h2d_GBps" in r]
    if not done:
        return "No accelerator: the H2D/D2H ceilings (and so the bound) were not measured."
    big = max((r for r in done if r["case"] == "whole block"), key=lambda r: r["blocks"], default=done[-1])
    med = big["median_s"]

    def bound(stages: dict[str, float], link_GBps: float) -> str:
        """The largest stage, and the share of the link it leaves the path however well the rest overlaps."""
        name = max(stages, key=stages.get)
        total = sum(stages.values())
        most = big["payload_bytes"] / stages[name] / 1e9 / link_GBps
        return f"{name} ({stages[name] * 1e3:.1f} of {total * 1e3:.1f} ms of its stages: at most {most:.0%} of pinned)"

    load_b = bound({"pool memcpy": med["pool_get"], "PCIe H2D": med["h2d"], "device scatter": med["scatter"]},
                   big["h2d_GBps"])
    save_b = bound({"pool memcpy": med["pool_put"], "PCIe D2H": med["d2h"], "device gather": med["gather"]},
                   big["d2h_GBps"])
    direct = " ".join(
        f"Direct path, {r['case']} x {r['blocks']}: load {r['direct_load_over_h2d']:.0%} of pinned H2D, save "
        f"{r['direct_save_over_d2h']:.0%} of pinned D2H." for r in done if "direct_load_over_h2d" in r)
    return direct + " " + (f"Staged path bound ({big['case']} x {big['blocks']}): load by {load_b}, "
                           f"save by {save_b}; with the "
            f"stages overlapped, load reaches {big['load_over_h2d']:.0%} of pinned H2D ({big['load_GBps']:.1f} of "
            f"{big['h2d_GBps']:.1f} GB/s), save {big['save_over_d2h']:.0%} of pinned D2H "
            f"({big['save_GBps']:.1f} of {big['d2h_GBps']:.1f} GB/s).")


def plot_loads(rows: list[dict], path: Path) -> None:
    """Load GB/s of both paths against the bytes a call moves, under one pinned H2D copy of them (the link)."""
    done = [r for r in rows if "skipped" not in r and "h2d_GBps" in r]
    series, ceiling = {}, {}
    for case in dict.fromkeys(r["case"] for r in done):
        picked = sorted((r for r in done if r["case"] == case), key=lambda r: r["payload_bytes"])
        mib = [r["payload_bytes"] / MiB for r in picked]
        series[f"staged, {case}"] = (mib, [r["load_GBps"] for r in picked])
        if all("direct_load_GBps" in r for r in picked):
            series[f"direct, {case}"] = (mib, [r["direct_load_GBps"] for r in picked])
        ceiling[f"pinned H2D, {case}"] = (mib, [r["h2d_GBps"] for r in picked])
    plot(path, "BlockIO loads vs the link", ("MiB per call", "GB/s"), series, ceiling, log="x")


def main() -> int:
    parser = arguments(__doc__, "block_io_device")
    parser.add_argument("--device", default="auto", help=Accel.HELP)
    parser.add_argument("--blocks", default="64,256", help="batch sizes (blocks per call)")
    parser.add_argument("--layer", type=int, default=0, help="the layer of the one-layer unit")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pool-gib", type=float, default=4.0, help="largest pool (in /dev/shm) per case")
    plot_argument(parser)
    parser.add_argument("--shm-dir", type=Path, default=None,
                        help=f"put the pool in this tmpfs instead of {shm_file.SHM_DIR} (where that one is small)")
    args = parser.parse_args()
    acc = Accel(args.device)
    if args.shm_dir is not None:
        use_pool_dir(args.shm_dir)
    m = TINY if args.quick else LLAMA3_8B
    if args.quick:
        args.blocks, args.repeats, args.warmup = "8,32", min(args.repeats, 3), 1
    sizes = [int(b) for b in args.blocks.split(",") if b]
    started = time.perf_counter()
    print(f"{m.name} on {acc.describe()}, torch {torch.__version__}; {shm_file.SHM_DIR} free "
          f"{free_bytes() / GiB:.1f} GiB; torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs", flush=True)
    bench = Bench(acc, m, max(sizes), args)
    rows = [bench.run(Case(u, n)) for u in ("whole block", "one layer") for n in sizes]
    print(f"\nBlockIO + LocalBackend, {m.name} ({m.layers} layers, K and V planes of {m.plane_bytes // KiB} KiB per "
          f"block per layer; one-layer unit: layer {args.layer}), {acc.describe()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; median of {args.repeats} after {args.warmup} warm-up; GB/s = 1e9 B/s; "
          "save/load on payload bytes, ceilings on the bytes they copy (payload + 64-byte headers)\n")
    print_tables(rows)
    line = conclusion(rows)
    print("\n" + line)
    if args.plot:
        if any("h2d_GBps" in r for r in rows):
            plot_loads(rows, args.plot)
        else:
            print("no plot: without an accelerator there is no link to compare with")
    write_results(args.json, "block_io_device", started, device=acc.describe(), torch=torch.__version__,
                  model=asdict(m), torch_threads=torch.get_num_threads(),
                  args={k: v for k, v in vars(args).items() if k != "json"}, rows=rows, conclusion=line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
