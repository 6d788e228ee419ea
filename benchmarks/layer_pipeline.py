"""Layerwise KV load (issue 5): a per-layer forward that starts as soon as ITS layer's KV is on the device.

A request with a cached prefix of P tokens runs a prefill of M new tokens. The
prefix's KV of every layer lives in PINNED host memory, one contiguous staging
region per layer, and must reach the device's paged KV cache (per layer
``[num_blocks, 2, block_size, kv_heads, head_dim]``, the prefix on scattered
block ids) before that layer's attention reads it. The load of one layer is
what the connector will do: ONE batched H2D copy of the staging region into a
device scratch, then an on-device scatter (``index_copy_`` over the block ids)
into the paged cache, both on a dedicated high-priority copy stream, followed
by one event per layer.

The forward is a synthetic Llama-3-8B layer (32 layers, hidden 4096, 32 query /
8 KV heads of 128, MLP 14336, bf16, block 16 tokens: 64 KiB per block per layer
for K+V): RMSNorm, QKV projection, attention of the M new queries over the
layer's prefix KV gathered from the paged cache by the block table (one
``index_select`` + a copy into ``[heads, P, dim]``; the 4 query heads that share
a KV head are folded into the query length, so flash attention runs without
GQA support), output projection, RMSNorm, gated MLP. M (the prefill's new
tokens) sets the compute per layer: for each target ratio ``load / compute``
the script measures the load, fits compute(M) from two sizes and picks M (at
least 16: where the forward of 16 tokens already takes longer than the target,
the measured ratio falls short of it; the table shows both). By default: a
16k-token prefix at ratios 0.25 to 4, and 4k and 64k prefixes at ratio 1.

Modes, interleaved within each repetition (median of ``--repeats`` CUDA-event
timings, after ``--warmup``; each timing ends with a device synchronize):

* ``compute``: the forward alone (the KV already in the cache).
* ``load``: the loads of all layers alone.
* ``bulk``: all loads, then (the compute stream waits on the last layer's
  event) the forward.
* ``layerwise``: all loads enqueued at once on the copy stream (or at most
  ``--window`` layers ahead of the forward); before layer i the compute stream
  waits on layer i's event (``Stream.wait_event``, no host synchronization).

Two variants of layerwise, in a second table, to see where its overhead goes:
``+sep`` copies into two alternating scratches on the copy stream and scatters
on a second stream (the copy engine never waits for a scatter kernel queued
behind the forward's kernels; ``load+sep`` is its load alone), and
``+interleave`` enqueues layer i + 2's load right before layer i's forward
(the host launches the first layer's forward after 2 loads, not after all 32).

With per-layer load l = load/L and compute c = compute/L, a pipeline of L
stages cannot hide the first layer's load nor the last layer's compute:

    ideal = max(load, compute) + min(load, compute) / L

(= l + (L-1) * max(l, c) + c). ``layerwise / ideal`` is the pipeline's own
overhead; issue 5 asks for <= 1.1. The ceilings are measured in the same run:
one large (1 GiB) pinned H2D copy per case, and, for comparison, the same
prefix loaded with one H2D copy per 64 KiB block straight into its cache slot
(no staging, no scatter: what a naive per-block connector does). The load's
effective GB/s is prefix bytes / ``load`` ms.

Before timing, each case checks the synchronization once (bulk, each layerwise):
host layer region r holds the constant r+1, the caches are zeroed, and every
layer's attention records the mean of the KV it read, which must equal its
region's constant (a missed or early wait reads zeros or another layer's KV).

The connector's real code, in the same run (third table; the ``--prefix``
sweep at ``--aio-ratios``, default 0.5, 1, 2): the prefix's blocks are first
put into an embedded pool (``LocalBackend`` in /dev/shm, sized for the
prefix's L x blocks one-layer values; ``BlockIO`` built by ``open_block_io``
as the worker builds it) with ``BlockIO.save`` of every layer
unit ``Unit((l,), l)`` (from the same device caches, after a load of the host
regions, so the check above applies). Modes, interleaved with the others:

* ``vllm_aio load``: ``BlockIO.load(blocks, Unit((l,), l))`` of every layer, on
  one ``TransferThread`` (the worker's receiving thread), the forward thread
  waiting on every future;
* ``vllm_aio bulk``: those loads, then the forward;
* ``vllm_aio layerwise``: what the worker does with ``transfer_mode: layerwise``: it
  submits 1 + ``--aio-prefetch`` (1, the config default) layer loads, and
  before layer l's compute takes layer l's future, submits the next layer's
  load (keeping the window full) and waits for the future's result (its
  ``wait_for_layer_load``: ``future.result()``).

What each real load does, per layer (``StagedPath._load_chunk``): one
page-locked staging slice for the whole layer batch (blocks x (64 KiB + a
64-byte header)); ``LocalBackend.batch_get`` memcpys the values from the pool
into it (on the transfer thread, on up to 8 copy threads); the headers are
checked; then, per 64 MiB chunk, one H2D copy into a fresh device scratch
and an on-device scatter of the payload into the paged cache, on BlockIO's
own default-priority stream; then the thread waits (host) for that stream
before releasing the slice and returning. So a layer's pool copy, its H2D
and the next layer's pool copy run one after the other; the idealised load
has no pool copy at all (a contiguous pinned region per layer) and keeps the
copy engine busy back to back. ``ideal (own load)`` is the ideal formula
with the real load in place of the idealised one. Next to it: the transfer
thread's ms in ``batch_get`` per layer and the forward thread's ms blocked on
futures per step (medians). On accelerators, one more line: ``BlockIO.load``
of the prefix's whole blocks (every layer in one value) through the default
``staging_buffer_size`` (256 MiB), which cannot hold the batch.

Run locally (CPU, synchronous, tiny sizes: a smoke test of the code paths,
timings meaningless):

    .venv/bin/python -m benchmarks.layer_pipeline --device cpu --quick

On the GPU machine, through the device tool (python3 there holds torch):

    python3 -m benchmarks.layer_pipeline --json $OUT/layer_pipeline.json

Results JSON goes to ``benchmarks/results/layer_pipeline.json`` unless ``--json``.
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from dataclasses import asdict
from functools import partial

import torch

from vllm_aio.backends import Status
from vllm_aio.backends.local import LocalBackend
from vllm_aio.connector.worker.block_io import Loaded, BlockIO, BlockRef, CopyHandoff, open_block_io
from vllm_aio.connector.worker.transfer import TransferThread
from vllm_aio.pool.entry import HEADER_BYTES
from vllm_aio.pool.keys import Unit
from benchmarks._accel import Accel, copy_bandwidth, timed
from benchmarks._model import DTYPE, LLAMA3_8B, TINY, Model, Weights, attend_grouped, finish, project, random_rows
from benchmarks._pool import header, pool_dir_for
from benchmarks._report import arguments, print_markdown, write_results

MiB, GiB = 1 << 20, 1 << 30
LAYERWISE = ("layerwise", "layerwise+sep", "layerwise+interleave")


def forward_layer(m: Model, w: Weights, x: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor,
                  check: torch.Tensor | None = None, layer: int = 0) -> torch.Tensor:
    """One layer for the M rows of ``x``; attention over the prefix blocks ``block_ids`` of ``cache``."""
    q = project(m, w, x)[0]
    kv = cache.index_select(0, block_ids)  # [blocks, 2, block_size, kv_heads, head_dim]
    if check is not None:
        check[layer] = kv.float().mean()
    kv = kv.permute(1, 3, 0, 2, 4).reshape(2, 1, m.kv_heads, -1, m.head_dim)
    return finish(m, w, x, attend_grouped(m, q, kv[0], kv[1]))


# ---------------------------------------------------------------- one prefix

class Prefix:
    """A cached prefix: its per-layer host staging regions, the device paged caches, the block table."""

    def __init__(self, acc: Accel, m: Model, tokens: int, host_pool: torch.Tensor, gen: torch.Generator) -> None:
        self.acc, self.m, self.tokens = acc, m, tokens
        self.blocks = tokens // m.block_size
        self.layer_bytes = self.blocks * m.block_bytes
        shape = (self.blocks, 2, m.block_size, m.kv_heads, m.head_dim)
        self.host_regions = min(m.layers, host_pool.numel() // self.layer_bytes)
        if self.host_regions == 0:
            raise SystemExit(f"--host-gib too small for one layer of a {tokens}-token prefix")
        regions = [host_pool[r * self.layer_bytes:(r + 1) * self.layer_bytes].view(DTYPE).view(shape)
                   for r in range(self.host_regions)]
        for r, region in enumerate(regions):  # region r holds r+1 everywhere (exact in bf16)
            region.copy_(torch.full(shape, float(r + 1), dtype=DTYPE, device=acc.device))
        self.host = [regions[layer % self.host_regions] for layer in range(m.layers)]
        num_blocks = self.blocks + self.blocks // 4 + 1
        self.block_list = torch.randperm(num_blocks, generator=gen)[: self.blocks].tolist()
        self.block_ids = torch.tensor(self.block_list, device=acc.device)
        self.caches = [torch.zeros((num_blocks,) + shape[1:], dtype=DTYPE, device=acc.device)
                       for _ in range(m.layers)]
        self.scratch = [torch.empty(shape, dtype=DTYPE, device=acc.device) for _ in range(2)]
        self.copy_stream = acc.stream(priority=-1)
        self.scatter_stream = acc.stream(priority=-1)  # "+sep" variants only

    def expected(self, layer: int) -> float:
        return float(layer % self.host_regions + 1)

    def load(self, layer: int, done, per_block: bool = False) -> None:
        """The connector's path: one H2D copy into the scratch, then the scatter, both on the copy stream."""
        acc, cache, host = self.acc, self.caches[layer], self.host[layer]
        with acc.on(self.copy_stream):
            if per_block:
                for i, b in enumerate(self.block_list):
                    cache[b].copy_(host[i], non_blocking=True)
            else:
                self.scratch[0].copy_(host, non_blocking=True)
                cache.index_copy_(0, self.block_ids, self.scratch[0])
        acc.record(done, self.copy_stream)

    def load_sep(self, layer: int, copied, done, scratch_free=None) -> None:
        """Variant: H2D into alternating scratches on the copy stream, the scatter on its own stream,
        so the copy engine never waits for a scatter kernel (which may queue behind the forward's)."""
        acc, scratch = self.acc, self.scratch[layer % 2]
        with acc.on(self.copy_stream):
            if scratch_free is not None:  # the scatter of layer - 2 has read this scratch
                acc.wait(self.copy_stream, scratch_free)
            scratch.copy_(self.host[layer], non_blocking=True)
        acc.record(copied, self.copy_stream)
        with acc.on(self.scatter_stream):
            acc.wait(self.scatter_stream, copied)
            self.caches[layer].index_copy_(0, self.block_ids, scratch)
        acc.record(done, self.scatter_stream)

    def run(self, mode: str, w: Weights, x0: torch.Tensor, window: int | None = None,
            check: torch.Tensor | None = None) -> float:
        """One timed pass of ``mode``: compute, load, load_per_block, bulk or layerwise, optionally with
        ``+sep`` (scatter on its own stream) or, for layerwise, ``+interleave`` (the host enqueues the load
        of layer i + 2 right before the forward of layer i, instead of all loads first)."""
        acc, L = self.acc, self.m.layers
        base, _, variant = mode.partition("+")
        layerwise, interleave = base == "layerwise", variant == "interleave"

        def enqueue(start) -> None:
            comp = acc.current_stream()
            copied, loaded, computed = ([acc.event() for _ in range(L)] for _ in range(3))

            def load(layer: int) -> None:
                if variant == "sep":
                    self.load_sep(layer, copied[layer], loaded[layer], loaded[layer - 2] if layer >= 2 else None)
                else:
                    self.load(layer, loaded[layer], per_block=base == "load_per_block")

            if base != "compute":
                acc.wait(self.copy_stream, start)
            ahead = L
            if layerwise and (interleave or window):
                ahead = min(2 if interleave else window, L)
            for layer in range(ahead if base != "compute" else 0):
                load(layer)
            if base in ("load", "load_per_block", "bulk"):
                acc.wait(comp, loaded[L - 1])
            if base.startswith("load"):
                return
            x = x0
            for layer in range(L):
                nxt = layer + ahead
                if interleave and nxt < L:
                    load(nxt)
                if layerwise:
                    acc.wait(comp, loaded[layer])
                x = forward_layer(self.m, w, x, self.caches[layer], self.block_ids, check, layer)
                if layerwise and not interleave and nxt < L:  # --window: at most `window` layers ahead
                    acc.record(computed[layer], comp)
                    acc.wait(self.copy_stream, computed[layer])
                    load(nxt)

        with acc.attention_backends():
            return timed(acc, enqueue)

    def check(self, w: Weights, x0: torch.Tensor, window: int | None) -> dict:
        """Zeroed caches, one pass per mode; every layer must have read its own host region."""
        want = torch.tensor([self.expected(i) for i in range(self.m.layers)])
        out = {}
        for mode in ("bulk",) + LAYERWISE:
            for cache in self.caches:
                cache.zero_()
            got = torch.full((self.m.layers,), -1.0, device=self.acc.device)
            self.run(mode, w, x0, window, check=got)
            bad = (got.cpu() != want).nonzero().flatten().tolist()
            out[mode] = "ok" if not bad else f"FAILED at layers {bad[:8]}"
        return out


class AioPath:
    """The connector's own layer loads for a prefix: LocalBackend pool -> BlockIO -> the prefix's device caches."""

    AIO_MODES = ("vllm_aio load", "vllm_aio bulk", "vllm_aio layerwise")

    def __init__(self, prefix: Prefix, w: Weights, args) -> None:
        m = prefix.m
        self.prefix, self.prefetch = prefix, args.aio_prefetch
        self.names = [f"layer.{i}" for i in range(m.layers)]
        self.units = [Unit((i,), i) for i in range(m.layers)]
        value = HEADER_BYTES + m.block_bytes  # one block of one layer
        slots = m.layers * prefix.blocks + 64  # every layer's values, never an eviction
        self.shm = pool_dir_for(slots * value)
        self.backend = TimedGets(LocalBackend(f"bench-lp-{uuid.uuid4().hex[:8]}", slots * value, value, seal=True))
        staging = max(2 * prefix.blocks * value, args.aio_staging_mib * MiB)  # one layer batch, twice over
        self.io = self._open(staging, 30.0)
        assert self.io.value_bytes(self.units[0]) == value
        self.refs = [BlockRef(b, f"p{i}".encode()) for i, b in enumerate(prefix.block_list)]
        self.recv = TransferThread("bench-recv")
        self.wait_ms = 0.0
        self.failed = 0
        self.unsettled: list[Loaded] = []
        # The pool gets every layer of the prefix: the host regions' constants, loaded, then saved per layer.
        prefix.run("load", w, None)
        t0 = time.perf_counter()
        for unit in self.units:
            statuses = self.io.save(self.refs, unit, self.io.device.record(), CopyHandoff())
            if any(st is not Status.OK for st in statuses):
                raise SystemExit(f"vllm_aio: save of layer {unit.tag} failed: {sorted(set(statuses), key=str)}")
        self.save_s = time.perf_counter() - t0
        self.staging_bytes, self.value_bytes, self.pool_bytes = staging, value, slots * value

    def _open(self, staging_bytes: int, timeout: float) -> BlockIO:
        """A BlockIO over the prefix's device caches, built as the worker builds it."""
        caches = dict(zip(self.names, self.prefix.caches))
        return open_block_io(caches, self.names, self.prefix.caches[0].shape[0], self.backend,
                             header(self.prefix.m.block_size), staging_bytes, timeout)

    def _load(self, unit: Unit) -> Loaded:
        return self.io.load(self.prepared, unit)

    def _result(self, future) -> None:
        """The worker's wait_for_layer_load: the compute stream waits for the layer's copies."""
        t0 = time.perf_counter()
        loaded = future.result(timeout=30.0)
        self.io.device.wait(loaded.copied)
        self.wait_ms += (time.perf_counter() - t0) * 1e3
        self.unsettled.append(loaded)  # settled after the pass, as the worker does at the end of a step

    def run(self, mode: str, w: Weights, x0: torch.Tensor | None, check: torch.Tensor | None = None) -> float:
        prefix, L = self.prefix, self.prefix.m.layers
        acc = prefix.acc
        self.wait_ms, self.backend.ms = 0.0, []

        def enqueue(start) -> None:
            self.prepared = self.io.prepare(self.refs)  # once per step, as the worker's layerwise loads
            if mode != "vllm_aio layerwise":  # load / bulk: every layer's load, then (bulk) the forward
                for future in [self.recv.submit(self._load, unit) for unit in self.units]:
                    self._result(future)
                if mode == "vllm_aio load":
                    return
                x = x0
                for layer in range(L):
                    x = forward_layer(prefix.m, w, x, prefix.caches[layer], prefix.block_ids, check, layer)
                return
            futures, pending = {}, iter(self.units)

            def advance() -> None:  # the worker's _advance_retrieve
                unit = next(pending, None)
                if unit is not None:
                    futures[unit.tag] = self.recv.submit(self._load, unit)

            for _ in range(1 + self.prefetch):
                advance()
            x = x0
            for layer in range(L):
                future = futures.pop(layer)  # the worker's wait_for_layer_load: take, refill the window, wait
                advance()
                self._result(future)
                x = forward_layer(prefix.m, w, x, prefix.caches[layer], prefix.block_ids, check, layer)

        with acc.attention_backends():
            ms = timed(acc, enqueue)
        for loaded in self.unsettled:
            self.failed += sum(st is not Status.OK for st in loaded.settle())
        self.unsettled = []
        return ms

    def check(self, w: Weights, x0: torch.Tensor) -> dict:
        want = torch.tensor([self.prefix.expected(i) for i in range(self.prefix.m.layers)])
        out = {}
        for mode in self.AIO_MODES[1:]:
            for cache in self.prefix.caches:
                cache.zero_()
            got = torch.full((self.prefix.m.layers,), -1.0, device=self.prefix.acc.device)
            self.failed = 0
            self.run(mode, w, x0, check=got)
            bad = (got.cpu() != want).nonzero().flatten().tolist()
            out[mode] = "ok" if not bad and not self.failed else f"FAILED at layers {bad[:8]}, {self.failed} not OK"
        return out

    def default_staging_probe(self) -> str:
        """Whole blocks (every layer in one value) of the prefix through the default 256 MiB staging."""
        if self.io.device.is_host:
            return "not run on the CPU (its loads bypass staging)"
        io = self._open(256 * MiB, 1.0)
        every = Unit(tuple(range(self.prefix.m.layers)), None)
        loaded = io.load(self.refs, every)
        statuses = loaded.settle()
        counts = {st.value: statuses.count(st) for st in set(statuses)}
        value = io.value_bytes(every)
        return f"{len(self.refs)} values of {value / MiB:.2f} MiB ({len(self.refs) * value / GiB:.2f} GiB) -> {counts}"

    def close(self) -> None:
        self.recv.close()
        self.backend.close()


class TimedGets:
    """A backend whose ``batch_get`` calls are timed (ms each, appended to ``ms``); the rest is the backend's."""

    def __init__(self, backend) -> None:
        self._backend = backend
        self.ms: list[float] = []

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def batch_get(self, keys, segments):  # on the transfer thread
        t0 = time.perf_counter()
        try:
            return self._backend.batch_get(keys, segments)
        finally:
            self.ms.append((time.perf_counter() - t0) * 1e3)


# ---------------------------------------------------------------- measuring

def median_runs(fn, warmup: int, repeats: int) -> float:
    samples = [fn() for _ in range(warmup + repeats)]
    return statistics.median(samples[warmup:])


def fit_compute(prefix: Prefix, w: Weights, sizes: tuple[int, int], gen: torch.Generator) -> tuple[float, float]:
    """compute(M) ~ a + b*M (ms), from the forward timed at two sizes of M."""
    points = []
    for rows in sizes:
        x0 = random_rows(prefix.m, rows, gen, prefix.acc.device)
        points.append(median_runs(partial(prefix.run, "compute", w, x0), 1, 3))
    b = (points[1] - points[0]) / (sizes[1] - sizes[0])
    return points[0] - b * sizes[0], max(b, 1e-9)


def pick_rows(target_ms: float, a: float, b: float, align: int, most: int | None) -> int:
    """M for a forward of ``target_ms``, a multiple of ``align``, at most ``most`` (--quick: bounded time)."""
    rows = max(align, int(round((target_ms - a) / b / align)) * align)
    return min(rows, most) if most else rows


def measure(prefix: Prefix, w: Weights, rows: int, ratio: float, args, gen: torch.Generator,
            aio: AioPath | None = None) -> dict:
    m, L = prefix.m, prefix.m.layers
    x0 = random_rows(m, rows, gen, prefix.acc.device)
    modes = ("compute", "load", "bulk") + LAYERWISE + ("load+sep",) + (AioPath.AIO_MODES if aio else ())
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    aio_stats: dict[str, list[tuple[float, float, int]]] = {mode: [] for mode in AioPath.AIO_MODES}
    for rep in range(args.warmup + args.repeats):
        for mode in modes:
            if mode.startswith("vllm_aio"):
                aio.failed = 0
                t = aio.run(mode, w, x0)
                if rep >= args.warmup:
                    aio_stats[mode].append((aio.wait_ms, sum(aio.backend.ms) / L, aio.failed))
            else:
                t = prefix.run(mode, w, x0, args.window)
            if rep >= args.warmup:
                samples[mode].append(t)
    med = {mode: statistics.median(v) for mode, v in samples.items()}
    load, comp = med["load"], med["compute"]
    ideal = max(load, comp) + min(load, comp) / L
    total = prefix.layer_bytes * L
    real = None
    if aio:
        own = med["vllm_aio load"]
        own_ideal = max(own, comp) + min(own, comp) / L
        real = {"load_ms": own, "load_GBps": total / (own * 1e-3) / 1e9, "ideal_own_load_ms": own_ideal,
                "prefetch_layers": aio.prefetch}
        for mode in AioPath.AIO_MODES:
            key = mode.split()[1]
            st = aio_stats[mode]
            real[f"{key}_ms"] = med[mode]
            real[f"{key}_over_ideal"] = med[mode] / ideal
            real[f"{key}_over_own_ideal"] = med[mode] / own_ideal
            real[f"{key}_fwd_wait_ms"] = statistics.median(x[0] for x in st)
            real[f"{key}_batch_get_ms_per_layer"] = statistics.median(x[1] for x in st)
            real[f"{key}_not_ok"] = sum(x[2] for x in st)
        real["layerwise_over_idealised_layerwise"] = med["vllm_aio layerwise"] / med["layerwise"]
        real["bulk_over_idealised_bulk"] = med["vllm_aio bulk"] / med["bulk"]
    return {
        "vllm_aio": real,
        "prefix_tokens": prefix.tokens, "kv_MiB_per_layer": prefix.layer_bytes / MiB, "new_tokens": rows,
        "ratio_target": ratio, "ratio_measured": load / comp,
        "compute_ms": comp, "load_ms": load, "bulk_ms": med["bulk"], "layerwise_ms": med["layerwise"],
        "ideal_ms": ideal, "layerwise_over_ideal": med["layerwise"] / ideal, "bulk_over_ideal": med["bulk"] / ideal,
        "load_GBps": total / (load * 1e-3) / 1e9, "host_regions": prefix.host_regions, "samples_ms": samples,
        "layerwise_sep_ms": med["layerwise+sep"], "layerwise_interleave_ms": med["layerwise+interleave"],
        "layerwise_sep_over_ideal": med["layerwise+sep"] / ideal,
        "layerwise_interleave_over_ideal": med["layerwise+interleave"] / ideal,
        "load_sep_ms": med["load+sep"], "load_sep_GBps": total / (med["load+sep"] * 1e-3) / 1e9,
    }


def run_prefix(acc: Accel, m: Model, tokens: int, ratios: list[float], host_pool: torch.Tensor, w: Weights,
               args, gen: torch.Generator, per_block: bool) -> tuple[list[dict], dict]:
    prefix = Prefix(acc, m, tokens, host_pool, gen)
    extra: dict = {"prefix_tokens": tokens}
    bw = copy_bandwidth(acc, host_pool, min(args.copy_bytes, host_pool.numel()))
    extra.update(bw)
    a, b = fit_compute(prefix, w, args.fit_rows, gen)
    load = median_runs(partial(prefix.run, "load", w, None), 1, 3)
    extra.update(fit_a_ms=a, fit_b_ms_per_row=b, load_probe_ms=load)
    x_check = random_rows(m, args.fit_rows[0], gen, acc.device)
    extra["check"] = prefix.check(w, x_check, args.window)
    print(f"  prefix {tokens}: check {extra['check']}, load {load:.2f} ms, "
          f"compute(M) = {a:.2f} + {b * 1e3:.3f}e-3*M ms", flush=True)
    aio = None
    if tokens == args.prefix and args.aio_ratios:
        aio = AioPath(prefix, w, args)
        extra["vllm_aio"] = {
            "pool_dir": str(aio.shm), "pool_GiB": aio.pool_bytes / GiB, "value_bytes": aio.value_bytes,
            "staging_MiB": aio.staging_bytes / MiB, "save_s": aio.save_s,
            "save_GBps": prefix.layer_bytes * m.layers / aio.save_s / 1e9,
            "check": aio.check(w, x_check), "default_staging_whole_blocks": aio.default_staging_probe(),
        }
        print(f"  vllm_aio: pool {aio.pool_bytes / GiB:.2f} GiB in {aio.shm}, staging {aio.staging_bytes / MiB:g} MiB; "
              f"saved {m.layers} layers in {aio.save_s:.2f} s; check {extra['vllm_aio']['check']}; whole blocks "
              f"through the default 256 MiB staging: {extra['vllm_aio']['default_staging_whole_blocks']}", flush=True)
    if per_block:
        t = median_runs(partial(prefix.run, "load_per_block", w, None), 1, 3)
        extra.update(per_block_ms=t, per_block_GBps=prefix.layer_bytes * m.layers / (t * 1e-3) / 1e9,
                     per_block_copies=prefix.blocks * m.layers)
    rows = []
    for ratio in ratios:
        row = measure(prefix, w, pick_rows(load / ratio, a, b, m.block_size, args.most_rows), ratio, args, gen,
                      aio if aio and ratio in args.aio_ratios else None)
        row["pinned_h2d_GBps"] = bw["h2d_GBps"]
        rows.append(row)
        real = row["vllm_aio"]
        print(f"    ratio {ratio}: M={row['new_tokens']} layerwise/ideal {row['layerwise_over_ideal']:.3f}"
              + (f"; vllm_aio load {real['load_ms']:.1f} bulk {real['bulk_ms']:.1f} layerwise "
                 f"{real['layerwise_ms']:.1f} ms (layerwise/ideal {real['layerwise_over_ideal']:.3f})" if real else ""),
              flush=True)
    if aio:
        aio.close()
    del aio, prefix
    if acc.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows, extra


def print_tables(rows: list[dict]) -> None:
    print_markdown(
        ["prefix tokens", "KV MiB/layer", "new tokens M", "load/compute target", "load/compute measured",
         "compute ms", "load ms", "bulk ms", "layerwise ms", "ideal ms", "layerwise/ideal", "bulk/ideal",
         "load GB/s", "pinned H2D GB/s"],
        [[str(r["prefix_tokens"]), f"{r['kv_MiB_per_layer']:g}", str(r["new_tokens"]), f"{r['ratio_target']:g}",
          f"{r['ratio_measured']:.2f}", f"{r['compute_ms']:.2f}", f"{r['load_ms']:.2f}", f"{r['bulk_ms']:.2f}",
          f"{r['layerwise_ms']:.2f}", f"{r['ideal_ms']:.2f}", f"{r['layerwise_over_ideal']:.3f}",
          f"{r['bulk_over_ideal']:.3f}", f"{r['load_GBps']:.1f}", f"{r['pinned_h2d_GBps']:.1f}"] for r in rows])
    print("\nLayerwise variants (same ideal): +sep = scatter on its own stream, two scratches; "
          "+interleave = load i+2 enqueued right before layer i's forward\n")
    print_markdown(
        ["prefix tokens", "new tokens M", "load/compute measured", "ideal ms", "layerwise ms", "+sep ms",
         "+interleave ms", "layerwise/ideal", "+sep/ideal", "+interleave/ideal", "load GB/s", "load +sep GB/s"],
        [[str(r["prefix_tokens"]), str(r["new_tokens"]), f"{r['ratio_measured']:.2f}", f"{r['ideal_ms']:.2f}",
          f"{r['layerwise_ms']:.2f}", f"{r['layerwise_sep_ms']:.2f}", f"{r['layerwise_interleave_ms']:.2f}",
          f"{r['layerwise_over_ideal']:.3f}", f"{r['layerwise_sep_over_ideal']:.3f}",
          f"{r['layerwise_interleave_over_ideal']:.3f}", f"{r['load_GBps']:.1f}", f"{r['load_sep_GBps']:.1f}"]
         for r in rows])


def print_aio_table(rows: list[dict]) -> None:
    rows = [r for r in rows if r.get("vllm_aio")]
    if not rows:
        return
    print_markdown(
        ["prefix tokens", "new tokens M", "load/compute measured", "compute ms", "load ms", "vllm_aio load ms",
         "vllm_aio load GB/s", "bulk ms", "vllm_aio bulk ms", "layerwise ms", "vllm_aio layerwise ms", "ideal ms",
         "vllm_aio layerwise/ideal", "vllm_aio bulk/ideal", "vllm_aio/idealised layerwise",
         "ideal (own load) ms", "vllm_aio layerwise/ideal (own load)", "batch_get ms/layer",
         "fwd wait ms/step (layerwise)"],
        [[str(r["prefix_tokens"]), str(r["new_tokens"]), f"{r['ratio_measured']:.2f}", f"{r['compute_ms']:.2f}",
          f"{r['load_ms']:.2f}", f"{a['load_ms']:.2f}", f"{a['load_GBps']:.1f}", f"{r['bulk_ms']:.2f}",
          f"{a['bulk_ms']:.2f}", f"{r['layerwise_ms']:.2f}", f"{a['layerwise_ms']:.2f}", f"{r['ideal_ms']:.2f}",
          f"{a['layerwise_over_ideal']:.3f}", f"{a['bulk_over_ideal']:.3f}",
          f"{a['layerwise_over_idealised_layerwise']:.2f}", f"{a['ideal_own_load_ms']:.2f}",
          f"{a['layerwise_over_own_ideal']:.3f}", f"{a['layerwise_batch_get_ms_per_layer']:.2f}",
          f"{a['layerwise_fwd_wait_ms']:.1f}"]
         for r in rows for a in [r["vllm_aio"]]])


def main() -> int:
    parser = arguments(__doc__, "layer_pipeline")
    parser.add_argument("--device", default="auto", help=Accel.HELP)
    parser.add_argument("--prefix", type=int, default=16384, help="prefix tokens of the ratio sweep")
    parser.add_argument("--ratios", default="0.25,0.5,1,2,4", help="target load/compute ratios")
    parser.add_argument("--more-prefixes", default="4096,65536", help="prefixes also run at ratio 1")
    parser.add_argument("--window", type=int, default=None, help="layerwise: load at most N layers ahead")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--host-gib", type=float, default=8.0, help="pinned host pool (layers share regions beyond it)")
    parser.add_argument("--aio-ratios", default="0.5,1,2",
                        help="ratios of the --prefix sweep that also run the connector's real path (empty: none)")
    parser.add_argument("--aio-prefetch", type=int, default=1,
                        help="vllm_aio layerwise: layerwise_prefetch_layers (loads in flight: 1 + this)")
    parser.add_argument("--aio-staging-mib", type=int, default=256,
                        help="vllm_aio: BlockIO staging per direction (raised to two layer batches if smaller)")
    args = parser.parse_args()
    acc = Accel(args.device)
    m = TINY if args.quick else LLAMA3_8B
    if args.quick:
        args.prefix, args.more_prefixes, args.host_gib = 512, "256", 1 / 16
        args.repeats, args.warmup = min(args.repeats, 3), 1
        args.aio_staging_mib = min(args.aio_staging_mib, 4)
    args.aio_ratios = [float(r) for r in args.aio_ratios.split(",") if r]
    args.copy_bytes = (8 * MiB) if args.quick else GiB
    args.fit_rows = (16, 64) if args.quick else (512, 4096)
    args.most_rows = 128 if args.quick else None  # noise must not pick a huge M on a shared CPU
    ratios = [float(r) for r in args.ratios.split(",")]
    more = [int(p) for p in args.more_prefixes.split(",") if p]
    started = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    print(f"{m.name} on {acc.describe()}, torch {torch.__version__}; pinning {args.host_gib:g} GiB", flush=True)
    host_pool = acc.pinned(int(args.host_gib * GiB))
    w = Weights(m, acc.device, gen)
    rows, extras = [], []
    for tokens, rs in [(args.prefix, ratios)] + [(p, [1.0]) for p in more]:
        r, e = run_prefix(acc, m, tokens, rs, host_pool, w, args, gen, per_block=tokens == args.prefix)
        rows += r
        extras.append(e)
    main_extra = extras[0]
    print(f"\n{m.name} ({m.layers} layers, {m.block_bytes // 1024} KiB per block per layer), {acc.describe()}, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; median of {args.repeats}, "
          f"window {args.window or 'all layers'}; ideal = max(load, compute) + min(load, compute)/{m.layers}\n")
    print_tables(rows)
    print(f"\nOne large pinned copy ({args.copy_bytes // MiB} MiB): H2D {main_extra['h2d_GBps']:.1f} GB/s, "
          f"D2H {main_extra['d2h_GBps']:.1f} GB/s. Prefix {args.prefix} loaded with one copy per block "
          f"({main_extra['per_block_copies']} copies of {m.block_bytes // 1024} KiB, no staging): "
          f"{main_extra['per_block_GBps']:.1f} GB/s vs batched staging + scatter {rows[0]['load_GBps']:.1f} GB/s.")
    print("Checks (each layer read its own KV): " + "; ".join(f"{e['prefix_tokens']}: {e['check']}" for e in extras))
    if "vllm_aio" in main_extra:
        v = main_extra["vllm_aio"]
        print(f"\nThe connector's real load path (vllm_aio: LocalBackend pool in {v['pool_dir']} -> "
              f"BlockIO.load(blocks, Unit((l,), l)) on a TransferThread, staging {v['staging_MiB']:g} MiB; "
              f"layerwise: {1 + args.aio_prefetch} layer loads in flight, future.result() before each layer) "
              f"next to the idealised modes, same run; ideal as above; ideal (own load) = the same formula with "
              f"vllm_aio load; batch_get = the pool's memcpy per layer on the transfer thread; fwd wait = the "
              f"forward thread blocked on futures per step\n")
        print_aio_table(rows)
        print(f"\nvllm_aio checks: {v['check']}; the pool filled by BlockIO.save of {m.layers} layer units in "
              f"{v['save_s']:.2f} s ({v['save_GBps']:.1f} GB/s). Whole blocks (every layer in one value) of prefix "
              f"{args.prefix} through the default staging_buffer_size (256 MiB): {v['default_staging_whole_blocks']}.")
    write_results(args.json, "layer_pipeline", started, device=acc.describe(), torch=torch.__version__,
                  model=asdict(m), args={k: v for k, v in vars(args).items() if k != "json"}, rows=rows,
                  per_prefix=extras)
    return 0


if __name__ == "__main__":
    sys.exit(main())
