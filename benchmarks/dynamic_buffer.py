"""Dynamic S-layer KV buffer (issue 6): the device holds S layer buffers, the host holds every layer's KV.

For a batch, the device keeps only S per-layer KV buffers (layer l uses buffer
l % S, each ``[batch blocks, 2, block_size, kv_heads, head_dim]``, the batch's
blocks on scattered ids); the KV of all layers lives in PINNED host memory.
Each step, for every layer l:

1. load: the copy stream H2D waits on the ``released`` event of buffer l % S
   (recorded when layer l - S's write-back finished), then copies layer l's
   scheduled blocks (one batched H2D of a contiguous pinned staging region into
   a device scratch, then an ``index_copy_`` scatter into the buffer) and
   records ``loaded[l]``;
2. compute: the compute stream waits on ``loaded[l]`` and runs layer l (it
   writes the step's new K/V into the buffer, then attends over it);
3. write-back: the copy stream D2H waits on ``computed[l]``, gathers the
   step's new blocks (``index_select``) and copies them to host in one D2H
   copy, then records ``released[l]``.

All waits are ``Stream.wait_event``: no host synchronization inside a step. The
H2D and D2H streams are separate (high priority), so loads and write-backs may
use both directions of the link at once. Blocks: prefill loads the cached
prefix's blocks (none without a prefix) and writes back all new blocks;
decode loads the whole context (every block of every request, each step) and
writes back one block per request (the one holding the new token). A batch's
block ids are a random permutation, so its blocks are scattered anyway; rows
marked "every other block free" (``/frag``) spread them over twice the ids, so
no two are adjacent, as in a cache whose requests came and went.

Model: Llama-3-8B's real per-layer sizes (32 layers, 8 KV heads x 128, bf16,
block 16 tokens: 64 KiB per block per layer for K+V) in a synthetic layer:
RMSNorm, QKV projection, new K/V written into the buffer, attention over the
buffer's blocks (gathered by the block table; prefill: the new tokens over the
cached prefix plus causal over themselves, outputs summed rather than merged,
for timing; decode: one query per request over its whole context), output
projection, RMSNorm, gated MLP (14336). Decode's gather copies the context
once more than a paged attention kernel would: its compute is an upper bound.

Measured per step (median of CUDA-event timings; modes interleaved within each
repetition):

* ``resident``: the forward alone, no transfer (what an all-layers-resident
  cache costs; its KV reads hit the largest S's buffers in turn, same bytes per
  layer: where one buffer is about the L2's size, fewer buffers read faster);
* ``transfer``: all loads and all write-backs alone (no compute, no buffer
  dependency: the link's best case);
* ``S=2``, ``S=3``, ``S=4``: the pipeline above.

ideal = max(resident, transfer). The pipeline also cannot hide the first
layer's load nor the last layer's compute and write-back (about 1/32 of the
smaller of the two). Issue 6's goal: S = 2 within 1.15x of ideal.

Why S = 2 should suffice (the seed note's claim), per layer with load t,
compute c, write-back w: buffer l % S is used by load l, compute l and
write-back l in turn before load l + S, so a steady step of S layers needs
period >= (t + c + w) / S, next to period >= max(t, c, w) for each stream. With
w = 0, (t + c) / 2 <= max(t, c) always: two buffers never stall. With w > 0
(prefill writes back every new block) S = 2 stalls by up to w / 2 per layer
when t ~ c; a third buffer removes that. The table shows c, t, w per layer
(t and w from the one-copy bandwidths) so each row can be read against this.

Before timing, small batches check the synchronization for every S: host
layer regions hold constants, buffers and write-back regions are zeroed, each
layer records the mean of what it loaded and writes its constant as new KV;
every loaded mean and every written-back block must equal the layer's constant.

The connector's real code, in the same run (second table): ``vllm_aio S=<n>``
drives ``vllm_aio.buffer.layer_buffer.LayerBuffer`` around the same
synthetic layer. The device cache is S aliased layer views of one backing
tensor ``[S, blocks, 2, block_size, kv_heads, head_dim]`` (layer l is view
l % S, as ``tests/test_layer_buffer.py`` builds it and vLLM's re-planned cache
is); LayerBuffer allocates its own page-locked host copy of every layer
(L x blocks x 64 KiB) and a staging ring of ``--real-staging-mib`` (2 GiB). Per
step, exactly as the worker calls it: ``begin_step(BufferStep(resident,
written))``, then for each layer l: the layer's KV write + compute,
``layer_done(l)``, ``before_layer(l + 1)``; then ``end_step()``. The
BufferStep is what the scheduler half sends (``buffer/planner.py`` ``BufferPlanner.step``):
``resident`` = the blocks holding tokens before the step's first new token
(the same bytes as the idealised pipeline loads), ``written`` = the step's
new blocks. ``--real-resident every`` passes every block of the request
instead (prefill then also loads the blocks it overwrites; the H200 figures
in the closing note of issue 6 were taken that way). What the real
code does differently from the idealised pipeline above (see
``vllm_aio/connector/layer_buffer.py``):

* loads: runs of consecutive block ids of >= 1 MiB per plane are copied in
  place from the registered host copy; other blocks are gathered on the host
  (threaded numpy) into staging, then one H2D copy + on-device scatter; the
  idealised load reads one contiguous host region;
* one default-priority side stream carries both loads and write-backs (the
  idealised pipeline: separate high-priority H2D and D2H streams);
* write-back: device gather + D2H into staging, scattered into the host copy as
  soon as its copy has landed (``end_step`` waits for the remainder only);
* the host copy is one allocation registered with the driver
  (``Device.host_memory``), not rounded up by torch's caching host allocator.

The table also gives, per step, the forward thread's host time in the real
code (medians): gathers for loads, scatters into the host copy, waits on
events (a full staging ring waits there too).
Rows whose host copy exceeds ``--real-max-gib`` (16) are skipped for the real
code (the two large decode rows: 64 GiB); S > 2 runs only where the host copy
is at most ``--real-extra-max-gib`` (2.5). The real modes run in the first
``--real-repeats`` (3) repetitions only (to save device time). A check like the one above (host
copy at the loaded blocks = layer constant, every written block must come back
to the host copy) runs for the real code on the check batches.

High-priority requests kept resident (third table, ``--priority``): is a decode step of one
long high-priority request pinned in every layer (``LayerBuffer(resident_blocks=...)``, its reads
and writes remapped to private blocks) within 1.2x of ``resident`` while low-priority requests
stream (``vllm_aio S=2 pinned``; ``streamed``: every request streamed, no resident blocks)?

Run locally (CPU, synchronous, tiny sizes: a smoke test, timings meaningless):

    .venv/bin/python -m benchmarks.dynamic_buffer --device cpu --quick

On the GPU machine, through the device tool (python3 there holds torch):

    python3 -m benchmarks.dynamic_buffer --json $OUT/dynamic_buffer.json

Results JSON goes to ``benchmarks/results/dynamic_buffer.json`` unless ``--json``.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from vllm_aio.buffer.plan import private_blocks
from vllm_aio.buffer.layer_buffer import LayerBuffer
from vllm_aio.shared.metadata import BufferStep
from benchmarks._accel import Accel, copy_bandwidth, timed
from benchmarks._model import DTYPE, LLAMA3_8B, TINY, Model, Weights, attend_grouped, finish, project, random_rows
from benchmarks._report import arguments, print_markdown, write_results

MiB, GiB = 1 << 20, 1 << 30


@dataclass(frozen=True)
class Batch:
    phase: str  # "prefill" or "decode"
    reqs: int
    new: int  # new tokens per request (decode: 1)
    context: int  # prefill: cached prefix tokens per request; decode: context tokens, the new one included
    # Every other block id free (``/frag`` in --prefill/--decode), as in a cache
    # whose requests came and went: the batch's blocks are scattered over twice
    # as many ids, and no two are adjacent.
    fragmented: bool = False

    def label(self) -> str:
        frag = ", every other block free" if self.fragmented else ""
        if self.phase == "decode":
            return f"{self.reqs} x {self.context} ctx{frag}"
        return f"{self.reqs} x {self.new} new" + (f" after {self.context}" if self.context else "") + frag

    @property
    def id_spread(self) -> int:
        """Block ids per block of the batch."""
        return 2 if self.fragmented else 1


def bidirectional_bandwidth(acc: Accel, host: torch.Tensor, nbytes: int, streams, reps: int = 5) -> float:
    """Aggregate GB/s of one H2D and one D2H copy of ``nbytes`` each, at once on two streams."""
    if not acc.is_async:
        return float("nan")
    a = torch.empty(nbytes, dtype=torch.uint8, device=acc.device)
    b = torch.empty(nbytes, dtype=torch.uint8, device=acc.device)

    def enqueue(start) -> None:
        ends = []
        for stream, dst, src in ((streams[0], a, host[:nbytes]), (streams[1], host[nbytes:2 * nbytes], b)):
            acc.wait(stream, start)
            with acc.on(stream):
                dst.copy_(src, non_blocking=True)
            ends.append(acc.event())
            acc.record(ends[-1], stream)
        for e in ends:
            acc.wait(acc.current_stream(), e)

    t = statistics.median([timed(acc, enqueue) for _ in range(reps + 1)][1:])
    return 2 * nbytes / (t * 1e-3) / 1e9


# ---------------------------------------------------------------- the synthetic layer

def gathered(m: Model, buf: torch.Tensor, ids: torch.Tensor, groups: int) -> torch.Tensor:
    """Blocks ``ids`` (``groups`` sequences of equal length, in order) as ``[2, groups, kv_heads, tokens, dim]``."""
    kv = buf.index_select(0, ids).view(groups, -1, 2, m.block_size, m.kv_heads, m.head_dim)
    return kv.permute(2, 0, 4, 1, 3, 5).reshape(2, groups, m.kv_heads, -1, m.head_dim)


def prefill_attention(m: Model, q: torch.Tensor, kv: torch.Tensor, prefix: int) -> torch.Tensor:
    """N new queries of one request: causal over themselves plus full over the ``prefix`` (summed, for timing)."""
    n, g = q.shape[0], m.heads // m.kv_heads
    q4 = q.view(n, m.kv_heads, g, m.head_dim)
    own = kv[:, :, :, prefix:].expand(2, g, m.kv_heads, n, m.head_dim).contiguous()
    o = F.scaled_dot_product_attention(q4.permute(2, 1, 0, 3).contiguous(), own[0], own[1], is_causal=True)
    o = o.permute(2, 1, 0, 3).reshape(n, -1)
    if prefix:
        old = kv[:, :, :, :prefix].contiguous()
        o = o + attend_grouped(m, q, old[0], old[1])
    return o


# ---------------------------------------------------------------- one batch

class Step:
    """A batch's block table, its per-layer host regions, the S device buffers, and one step's modes."""

    def __init__(self, acc: Accel, m: Model, batch: Batch, host_pool: torch.Tensor, buffers: int,
                 gen: torch.Generator) -> None:
        self.acc, self.m, self.batch = acc, m, batch
        bs, R = m.block_size, batch.reqs
        if batch.phase == "decode":
            per_req, load_r, new_r = batch.context // bs, batch.context // bs, 1
        else:
            per_req, load_r, new_r = (batch.context + batch.new) // bs, batch.context // bs, batch.new // bs
        self.per_req = per_req
        ids = (torch.randperm(R * per_req, generator=gen) * batch.id_spread).view(R, per_req)
        self.req_ids = [ids[r].to(acc.device) for r in range(R)]
        self.all_ids = ids.flatten().to(acc.device)
        self.load_ids = ids[:, :load_r].flatten().to(acc.device)
        self.new_ids = ids[:, per_req - new_r:].flatten().to(acc.device)
        self.n_load, self.n_new = R * load_r, R * new_r
        self.load_bytes, self.new_bytes = self.n_load * m.block_bytes, self.n_new * m.block_bytes
        layer_bytes = self.load_bytes + self.new_bytes
        self.host_regions = min(m.layers, host_pool.numel() // layer_bytes)
        if self.host_regions == 0:
            raise SystemExit(f"--host-gib too small for one layer of {batch.label()}")
        shape = (m.block_size, m.kv_heads, m.head_dim)
        loads, news = [], []
        for r in range(self.host_regions):
            region = host_pool[r * layer_bytes:(r + 1) * layer_bytes].view(DTYPE)
            loads.append(region[: self.load_bytes // 2].view(self.n_load, 2, *shape))
            news.append(region[self.load_bytes // 2:].view(self.n_new, 2, *shape))
            loads[-1].copy_(torch.full(loads[-1].shape, self.expected(r), dtype=DTYPE, device=acc.device))
            news[-1].zero_()
        self.host_load = [loads[layer % self.host_regions] for layer in range(m.layers)]
        self.host_new = [news[layer % self.host_regions] for layer in range(m.layers)]
        self.buffers = [torch.zeros(R * per_req * batch.id_spread, 2, *shape, dtype=DTYPE, device=acc.device)
                        for _ in range(buffers)]
        self.load_scratch = torch.empty(self.n_load, 2, *shape, dtype=DTYPE, device=acc.device)
        self.new_scratch = torch.empty(self.n_new, 2, *shape, dtype=DTYPE, device=acc.device)
        self.h2d, self.d2h = acc.stream(priority=-1), acc.stream(priority=-1)

    def expected(self, layer: int) -> float:
        return float(layer % self.host_regions + 1)

    def forward_layer(self, w: Weights, x: torch.Tensor, layer: int, buf: torch.Tensor,
                      check: torch.Tensor | None) -> torch.Tensor:
        m, b = self.m, self.batch
        q, k, v = project(m, w, x)
        if check is not None:  # what this layer loaded must be its host region's constant
            if self.n_load:
                check[layer] = buf.index_select(0, self.load_ids).float().mean()
            k = v = torch.full_like(k, self.expected(layer))
        if b.phase == "decode":
            buf[self.new_ids, 0, m.block_size - 1] = k.reshape(-1, m.kv_heads, m.head_dim)
            buf[self.new_ids, 1, m.block_size - 1] = v.reshape(-1, m.kv_heads, m.head_dim)
            kv = gathered(m, buf, self.all_ids, b.reqs)
            q = q.reshape(b.reqs, m.kv_heads, -1, m.head_dim).contiguous()
            o = F.scaled_dot_product_attention(q, kv[0], kv[1])
            o = o.reshape(b.reqs, m.heads * m.head_dim)
        else:
            shape = (-1, m.block_size, m.kv_heads, m.head_dim)
            buf.index_copy_(0, self.new_ids, torch.stack((k.reshape(shape), v.reshape(shape)), dim=1))
            o = torch.cat([prefill_attention(m, q[r * b.new:(r + 1) * b.new], gathered(m, buf, ids, 1), b.context)
                           for r, ids in enumerate(self.req_ids)])
        return finish(m, w, x, o)

    def load(self, layer: int, buf: torch.Tensor, done, after=None) -> None:
        acc = self.acc
        with acc.on(self.h2d):
            if after is not None:
                acc.wait(self.h2d, after)
            if self.n_load:
                self.load_scratch.copy_(self.host_load[layer], non_blocking=True)
                buf.index_copy_(0, self.load_ids, self.load_scratch)
        acc.record(done, self.h2d)

    def write_back(self, layer: int, buf: torch.Tensor, done, after=None) -> None:
        acc = self.acc
        with acc.on(self.d2h):
            if after is not None:
                acc.wait(self.d2h, after)
            torch.index_select(buf, 0, self.new_ids, out=self.new_scratch)
            self.host_new[layer].copy_(self.new_scratch, non_blocking=True)
        acc.record(done, self.d2h)

    def run(self, mode: str, w: Weights, x0: torch.Tensor, check: torch.Tensor | None = None) -> float:
        """One timed step: ``resident``, ``transfer`` or ``S=<n>``."""
        acc, L, bufs = self.acc, self.m.layers, self.buffers

        def enqueue(start) -> None:
            comp = acc.current_stream()
            loaded = [acc.event() for _ in range(L)]
            computed = [acc.event() for _ in range(L)]
            released = [acc.event() for _ in range(L)]
            if mode == "resident":
                x = x0
                for layer in range(L):
                    x = self.forward_layer(w, x, layer, bufs[layer % len(bufs)], check)
                return
            acc.wait(self.h2d, start)
            acc.wait(self.d2h, start)
            if mode == "transfer":
                for layer in range(L):
                    self.load(layer, bufs[layer % len(bufs)], loaded[layer])
                for layer in range(L):
                    self.write_back(layer, bufs[layer % len(bufs)], released[layer])
                acc.wait(comp, loaded[L - 1])
                acc.wait(comp, released[L - 1])
                return
            s = int(mode[2:])
            for layer in range(min(s, L)):
                self.load(layer, bufs[layer % s], loaded[layer])
            x = x0
            for layer in range(L):
                buf = bufs[layer % s]
                acc.wait(comp, loaded[layer])
                x = self.forward_layer(w, x, layer, buf, check)
                acc.record(computed[layer], comp)
                self.write_back(layer, buf, released[layer], after=computed[layer])
                if layer + s < L:
                    self.load(layer + s, buf, loaded[layer + s], after=released[layer])
            acc.wait(comp, released[L - 1])

        with acc.attention_backends():
            return timed(acc, enqueue)

    def check(self, w: Weights, x0: torch.Tensor, s_values: list[int]) -> dict:
        """Per S: zeroed buffers and write-back regions, one step; loads and write-backs must match."""
        L = self.m.layers
        want = torch.tensor([self.expected(i) for i in range(L)])
        out = {}
        for s in s_values:
            for buf in self.buffers:
                buf.zero_()
            for region in self.host_new[: self.host_regions]:
                region.zero_()
            got = torch.full((L,), -1.0, device=self.acc.device)
            self.run(f"S={s}", w, x0, check=got)
            bad_load = (got.cpu() != want).nonzero().flatten().tolist() if self.n_load else []
            bad_wb = [i for i in range(self.host_regions)
                      if not bool((self.host_new[i].float() == self.expected(i)).all())]
            out[f"S={s}"] = "ok" if not bad_load and not bad_wb else \
                f"FAILED (load at layers {bad_load[:8]}, write-back at {bad_wb[:8]})"
        return out


class RealBuffer:
    """vllm_aio's own LayerBuffer for one batch and one S, driven as the worker drives it.

    The forward thread's host time inside LayerBuffer is measured by wrapping, on this instance only,
    its host layout's gather/scatter and its device's synchronize (LayerBuffer takes no timing hook)."""

    def __init__(self, step: Step, s: int, staging_bytes: int, resident: str) -> None:
        self.step, self.s = step, s
        m = step.m
        shape = step.buffers[0].shape
        self.names = [f"layer.{i}" for i in range(m.layers)]
        self.backing = torch.zeros(s, *shape, dtype=DTYPE, device=step.acc.device)
        self.views = [self.backing[i % s] for i in range(m.layers)]
        t0 = time.perf_counter()
        self.lb = LayerBuffer(dict(zip(self.names, self.views)), self.names, shape[0], s, staging_bytes)
        self.create_s = time.perf_counter() - t0
        # Page-locked bytes of the host copy: registered exactly, not rounded up.
        self.host_pinned = None if step.acc.device.type == "cpu" else self.lb.host_bytes
        ids = step.all_ids if resident == "every" else step.load_ids
        self.bstep = BufferStep(resident=ids.cpu().tolist(), written=step.new_ids.cpu().tolist())
        self.load_blocks = len(self.bstep.resident)
        self.stats: dict[str, float] = {}
        lb = self.lb
        lb._host_layout.gather_planes = self._timing("gather_ms", lb._host_layout.gather_planes)
        lb._host_layout.scatter_planes = self._timing("scatter_ms", lb._host_layout.scatter_planes)
        lb.device.synchronize = self._timing("wait_ms", lb.device.synchronize)

    def _timing(self, key: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.stats[key] += (time.perf_counter() - t0) * 1e3
        return wrapper

    @property
    def host_bytes(self) -> int:
        return self.lb.host_bytes

    def run(self, w: Weights, x0: torch.Tensor, check: torch.Tensor | None = None) -> tuple[float, dict]:
        """One timed step through LayerBuffer; returns (ms, forward-thread host stats of the step)."""
        step, lb, L = self.step, self.lb, self.step.m.layers
        self.stats = {"gather_ms": 0.0, "scatter_ms": 0.0, "wait_ms": 0.0}

        def enqueue(start) -> None:
            lb.begin_step(self.bstep)  # loads layers 0 .. S-1, then before_layer(0)
            x = x0
            for layer in range(L):
                x = step.forward_layer(w, x, layer, self.views[layer], check)  # KV write + compute
                lb.layer_done(layer)
                if layer + 1 < L:
                    lb.before_layer(layer + 1)
            lb.end_step()

        with step.acc.attention_backends():
            ms = timed(step.acc, enqueue)
        return ms, dict(self.stats)

    def check(self, w: Weights, x0: torch.Tensor) -> str:
        """Host copy = the layer's constant at the loaded blocks; loads and write-backs must match it."""
        step, L = self.step, self.step.m.layers
        load_ids, new_ids = step.load_ids.cpu(), step.new_ids.cpu()
        self.backing.zero_()
        for i, name in enumerate(self.names):
            host = self.lb.host_caches[name]
            host.zero_()
            host[load_ids] = step.expected(i)
        got = torch.full((L,), -1.0, device=step.acc.device)
        self.run(w, x0, check=got)
        want = torch.tensor([step.expected(i) for i in range(L)])
        bad_load = (got.cpu() != want).nonzero().flatten().tolist() if step.n_load else []
        bad_wb = [i for i, name in enumerate(self.names)
                  if not bool((self.lb.host_caches[name][new_ids].float() == step.expected(i)).all())]
        return "ok" if not bad_load and not bad_wb else \
            f"FAILED (load at layers {bad_load[:8]}, write-back at {bad_wb[:8]})"


# ---------------------------------------------------------------- high-priority requests kept resident

PRIORITY_BUFFERS = 2  # S of the priority section


@dataclass(frozen=True)
class PriorityBatch:
    """One high-priority request over ``hp_context`` tokens beside ``lp_reqs`` low-priority ones over
    ``lp_context`` each; every request decodes one token, the last slot of its last block (as ``Batch``)."""

    hp_context: int
    lp_reqs: int = 0
    lp_context: int = 0

    def label(self) -> str:
        if not self.lp_reqs:
            return f"1 x {self.hp_context} alone"
        return f"1 x {self.hp_context} + {self.lp_reqs} x {self.lp_context}"

    def vllm_blocks(self, block_size: int) -> int:
        """vLLM's blocks: the batch's, and the null block 0."""
        return 1 + (self.hp_context + self.lp_reqs * self.lp_context) // block_size


def priority_host_bytes(m: Model, b: PriorityBatch) -> int:
    """One LayerBuffer's host copy for ``b``: every layer's vLLM blocks."""
    return m.layers * b.vllm_blocks(m.block_size) * m.block_bytes


def decode_attention(m: Model, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """One query per request ``[reqs, heads * dim]`` over ``kv`` ``[2, reqs, kv_heads, tokens, dim]``
    (the query heads sharing a KV head folded into the query length, as the decode rows)."""
    reqs = q.shape[0]
    q = q.reshape(reqs, m.kv_heads, -1, m.head_dim).contiguous()
    return F.scaled_dot_product_attention(q, kv[0], kv[1]).reshape(reqs, m.heads * m.head_dim)


class PriorityStep:
    """A priority batch's block table and slot mapping in a fake vLLM forward context, and the synthetic
    layer reading its KV through them.

    The layer reads the block ids and slots from the device tensors each time it runs: LayerBuffer
    rewrites them in place between layers (pinned blocks to the layer's private ids), as vLLM's.
    """

    def __init__(self, acc: Accel, m: Model, batch: PriorityBatch, gen: torch.Generator) -> None:
        self.acc, self.m, self.batch = acc, m, batch
        bs, lp_reqs = m.block_size, batch.lp_reqs
        self.n_hp, self.n_lp = batch.hp_context // bs, batch.lp_context // bs
        # Scattered ids from 1: vLLM's block 0 is its null block (table padding names it).
        self.num_blocks = batch.vllm_blocks(bs)
        ids = torch.randperm(self.num_blocks - 1, generator=gen) + 1
        hp, lp = ids[: self.n_hp], ids[self.n_hp:].view(lp_reqs, self.n_lp)
        self.hp_blocks, self.lp_blocks = hp.tolist(), lp.flatten().tolist()
        new = torch.cat((hp[-1:], lp[:, -1:].flatten()))
        self.new_blocks = new.tolist()  # the blocks the new tokens land in
        table = torch.zeros(1 + lp_reqs, max(self.n_hp, self.n_lp), dtype=torch.int32)
        table[0, : self.n_hp], table[1:, : self.n_lp] = hp, lp
        self.block_table = table.to(acc.device)
        self.slot_mapping = (new * bs + bs - 1).to(acc.device)
        self.names = [f"layer.{i}" for i in range(m.layers)]
        # What LayerBuffer reads: one KV cache group, so every layer shares the two tensors.
        meta = SimpleNamespace(block_table=self.block_table, slot_mapping=self.slot_mapping)
        self.forward_context = SimpleNamespace(attn_metadata={n: meta for n in self.names},
                                               slot_mapping={n: self.slot_mapping for n in self.names})

    @property
    def context_blocks(self) -> list[int]:
        """Every block of the batch: each holds tokens from before the step (the scheduler's ``resident``)."""
        return self.hp_blocks + self.lp_blocks

    @staticmethod
    def expected(layer: int) -> float:
        return float(layer + 1)

    def forward_layer(self, w: Weights, x: torch.Tensor, layer: int, cache: torch.Tensor,
                      check: torch.Tensor | None) -> torch.Tensor:
        """``check``: ``[layers, 2]``, set to whether the high- and the low-priority requests read the
        layer's constant at their context and the new token (minus the constant, written here) last."""
        m, bs = self.m, self.m.block_size
        q, k, v = project(m, w, x)
        if check is not None:
            k = v = torch.full_like(k, -self.expected(layer))
        blocks, offsets = self.slot_mapping // bs, self.slot_mapping % bs  # vLLM's cache update
        cache[blocks, 0, offsets] = k.reshape(-1, m.kv_heads, m.head_dim)
        cache[blocks, 1, offsets] = v.reshape(-1, m.kv_heads, m.head_dim)
        hp = gathered(m, cache, self.block_table[0, : self.n_hp], 1)
        o = decode_attention(m, q[:1], hp)
        if self.batch.lp_reqs:
            lp = gathered(m, cache, self.block_table[1:, : self.n_lp].flatten(), self.batch.lp_reqs)
            o = torch.cat((o, decode_attention(m, q[1:], lp)))
        if check is not None:
            check[layer, 0] = self._reads_ok(hp, layer)
            check[layer, 1] = self._reads_ok(lp, layer) if self.batch.lp_reqs else 1.0
        return finish(m, w, x, o)

    def _reads_ok(self, kv: torch.Tensor, layer: int) -> torch.Tensor:
        e = self.expected(layer)
        return ((kv[..., :-1, :] == e).all() & (kv[..., -1, :] == -e).all()).float()

    def run_resident(self, w: Weights, x0: torch.Tensor, cache: torch.Tensor) -> float:
        """One timed forward over ``cache`` ``[layers, blocks, ...]``, every layer in memory of its own
        and nothing moved: ``resident``. (Layers sharing S buffers would read less distinct memory than
        a resident cache does: a buffer's region is about the L2's size at these contexts.)"""
        def enqueue(start) -> None:
            x = x0
            for layer in range(self.m.layers):
                x = self.forward_layer(w, x, layer, cache[layer], None)

        with self.acc.attention_backends():
            return timed(self.acc, enqueue)


class PriorityBuffer:
    """vllm_aio's LayerBuffer on S buffers for a priority batch: every request streamed, or (``pinned``)
    the high-priority request's blocks kept resident in every layer at private slots 0 .. n-1."""

    def __init__(self, step: PriorityStep, s: int, staging_bytes: int, pinned: bool) -> None:
        self.step, self.pinned = step, pinned
        m = step.m
        resident_blocks = step.n_hp if pinned else 0
        total = step.num_blocks + private_blocks(m.layers, s, resident_blocks)
        self.backing = torch.zeros(s, total, 2, m.block_size, m.kv_heads, m.head_dim, dtype=DTYPE,
                                   device=step.acc.device)
        self.views = [self.backing[i % s] for i in range(m.layers)]
        self.lb = LayerBuffer(dict(zip(step.names, self.views)), step.names, total, s, staging_bytes,
                              resident_blocks=resident_blocks, block_tokens=m.block_size)
        if pinned:
            self.bstep = BufferStep(resident=step.lp_blocks, written=step.new_blocks,
                                    pinned=list(zip(step.hp_blocks, range(step.n_hp))))
        else:
            self.bstep = BufferStep(resident=step.context_blocks, written=step.new_blocks)
        # The step that fills the private copies from the host copy (run once before the timed ones).
        self.first = replace(self.bstep, promoted=step.hp_blocks) if pinned else self.bstep

    def run(self, w: Weights, x0: torch.Tensor, bstep: BufferStep | None = None,
            check: torch.Tensor | None = None) -> float:
        """One timed step (``self.bstep`` unless ``bstep``), driven as the worker drives LayerBuffer."""
        step, lb = self.step, self.lb

        def enqueue(start) -> None:
            lb.begin_step(bstep or self.bstep, step.forward_context)  # loads layers 0 .. S-1, remaps layer 0
            x = x0
            for layer, cache in enumerate(self.views):
                x = step.forward_layer(w, x, layer, cache, check)
                lb.layer_done(layer)
                if layer + 1 < len(self.views):
                    lb.before_layer(layer + 1)
            lb.end_step()

        with step.acc.attention_backends():
            return timed(step.acc, enqueue)

    def check(self, w: Weights, x0: torch.Tensor) -> str:
        """Host copy = the layer's constant at every block, device buffers zeroed: each layer must read its
        constant (a pinned request: from its private copy, which the first step promotes) and the host copy
        must get the new tokens back. Pinned, a second step follows with the pinned blocks zeroed in the
        host copy: they must still be read, and written back, from the private copies."""
        step = self.step
        table = step.block_table.clone()
        self.backing.zero_()
        for i, name in enumerate(step.names):
            host = self.lb.host_caches[name]
            host.zero_()
            host[step.context_blocks] = step.expected(i)
        failed = self._step_fails(w, x0, self.first)
        if self.pinned and not failed:
            for name in step.names:
                self.lb.host_caches[name][step.hp_blocks] = 0
            failed = self._step_fails(w, x0, self.bstep)
        if not failed and not torch.equal(step.block_table, table):
            failed = "the block table not restored after the step"
        return f"FAILED ({failed})" if failed else "ok"

    def _step_fails(self, w: Weights, x0: torch.Tensor, bstep: BufferStep) -> str:
        """What one checked step got wrong ("" if nothing)."""
        step, bs = self.step, self.step.m.block_size
        got = torch.zeros(step.m.layers, 2, device=step.acc.device)
        self.run(w, x0, bstep, check=got)
        bad = (got.cpu() != 1).nonzero().tolist()
        bad_wb = []
        for i, name in enumerate(step.names):
            new, e = self.lb.host_caches[name][step.new_blocks].float(), step.expected(i)  # [n, K/V, tokens, ..]
            if not bool((new[:, :, : bs - 1] == e).all() & (new[:, :, bs - 1] == -e).all()):
                bad_wb.append(i)
        if not bad and not bad_wb:
            return ""
        return (f"high-priority reads at layers {[i for i, g in bad if g == 0][:8]}, low-priority at "
                f"{[i for i, g in bad if g == 1][:8]}, write-back at {bad_wb[:8]}")


def real_s_values(args, host_bytes: int) -> list[int]:
    """The S values the real code runs for a batch whose LayerBuffer host copy is ``host_bytes``."""
    if host_bytes > args.real_max_gib * GiB:
        return []
    return [s for s in args.real_s_values if s == 2 or host_bytes <= args.real_extra_max_gib * GiB]


def _pow2_layers(layer_bytes: int, layers: int) -> int:
    """Bytes torch's caching host allocator pins for ``layers`` allocations of ``layer_bytes`` (power-of-2 sizes)."""
    return layers * (1 << max(layer_bytes - 1, 0).bit_length())


def real_host_bytes(m: Model, b: Batch) -> int:
    per_req = (b.context if b.phase == "decode" else b.context + b.new) // m.block_size
    return m.layers * b.reqs * per_req * b.id_spread * m.block_bytes


# ---------------------------------------------------------------- measuring

def tokens_of(b: Batch) -> int:
    return b.reqs * b.new


def measure(acc: Accel, m: Model, b: Batch, host_pool: torch.Tensor, w: Weights, args, bw: dict,
            gen: torch.Generator) -> dict:
    step = Step(acc, m, b, host_pool, max(args.s_values), gen)
    x0 = random_rows(m, tokens_of(b), gen, acc.device)
    real_bytes = real_host_bytes(m, b)
    skip = None
    if real_bytes > args.real_max_gib * GiB:
        skip = f"host copy {real_bytes / GiB:g} GiB > --real-max-gib {args.real_max_gib:g}"
    real = {} if skip else {s: RealBuffer(step, s, args.real_staging_bytes, args.real_resident)
                            for s in real_s_values(args, real_bytes)}
    modes = ["resident", "transfer"] + [f"S={s}" for s in args.s_values] + [f"vllm_aio S={s}" for s in real]
    repeats = args.decode_repeats if b.phase == "decode" else args.repeats
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    host_stats: dict[int, list[dict]] = {s: [] for s in real}
    for rep in range(args.warmup + repeats):
        for mode in modes:
            if mode.startswith("vllm_aio"):
                if rep >= args.warmup + args.real_repeats:
                    continue
                s = int(mode.rpartition("=")[2])
                t, stats = real[s].run(w, x0)
                if rep >= args.warmup:
                    host_stats[s].append(stats)
            else:
                t = step.run(mode, w, x0)
            if rep >= args.warmup:
                samples[mode].append(t)
    med = {mode: statistics.median(v) for mode, v in samples.items()}
    L = m.layers
    ideal = max(med["resident"], med["transfer"])
    c = med["resident"] / L
    t = step.load_bytes / (bw["h2d_GBps"] * 1e9) * 1e3
    wb = step.new_bytes / (bw["d2h_GBps"] * 1e9) * 1e3
    row = {
        "phase": b.phase, "batch": b.label(), "reqs": b.reqs, "new_tokens": tokens_of(b), "context": b.context,
        "load_MiB_per_layer": step.load_bytes / MiB, "writeback_MiB_per_layer": step.new_bytes / MiB,
        "c_ms_per_layer": c, "t_ms_per_layer": t, "w_ms_per_layer": wb,
        "resident_ms": med["resident"], "transfer_ms": med["transfer"], "ideal_ms": ideal,
        "transfer_GBps": (step.load_bytes + step.new_bytes) * L / (med["transfer"] * 1e-3) / 1e9,
        "host_regions": step.host_regions, "samples_ms": samples,
    }
    for s in args.s_values:
        row[f"S{s}_ms"] = med[f"S={s}"]
        row[f"S{s}_over_ideal"] = med[f"S={s}"] / ideal
        row[f"S{s}_model_ms"] = L * max(t, c, wb, (t + c + wb) / s) + min(t, c)  # steady period + fill
    row["S2_over_resident"] = med["S=2"] / med["resident"]
    row["real"] = {
        "host_copy_GiB": real_bytes / GiB, "host_copy_pow2_GiB": _pow2_layers(real_bytes // m.layers, m.layers) / GiB,
        "staging_MiB": args.real_staging_bytes / MiB, "resident": args.real_resident,
        "skipped": skip,
    }
    for s, rb in real.items():
        ms = med[f"vllm_aio S={s}"]
        row["real"][f"S{s}"] = {
            "ms": ms, "over_ideal": ms / ideal, "over_idealised_S": ms / med[f"S={s}"] if s in args.s_values else None,
            "load_MiB_per_layer": rb.load_blocks * m.block_bytes / MiB,
            "host_pinned_GiB": None if rb.host_pinned is None else rb.host_pinned / GiB,
            "create_s": rb.create_s,
            "host_ms_per_step": {k: statistics.median(d[k] for d in host_stats[s]) for k in host_stats[s][0]},
        }
    del real, step
    if acc.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run_checks(acc: Accel, m: Model, batches: list[Batch], host_pool: torch.Tensor, w: Weights, args,
               gen: torch.Generator) -> dict:
    out = {}
    for b in batches:
        step = Step(acc, m, b, host_pool, max(args.s_values), gen)
        x0 = random_rows(m, tokens_of(b), gen, acc.device)
        out[f"{b.phase} {b.label()}"] = step.check(w, x0, args.s_values)
        for s in args.real_s_values if step.n_load or args.real_resident == "every" else []:
            real = RealBuffer(step, s, args.real_staging_bytes, args.real_resident)
            out[f"{b.phase} {b.label()}"][f"vllm_aio S={s}"] = real.check(w, x0)
            del real
        del step
    return out


def run_priority_checks(acc: Accel, m: Model, batches: list[PriorityBatch], w: Weights, args,
                        gen: torch.Generator) -> dict:
    out = {}
    for b in batches:
        step = PriorityStep(acc, m, b, gen)
        x0 = random_rows(m, 1 + b.lp_reqs, gen, acc.device)
        out[f"priority {b.label()}"] = {
            f"vllm_aio S={PRIORITY_BUFFERS} {mode}": PriorityBuffer(step, PRIORITY_BUFFERS, args.real_staging_bytes,
                                                                   mode == "pinned").check(w, x0)
            for mode in ("streamed", "pinned")
        }
    return out


def measure_priority(acc: Accel, m: Model, b: PriorityBatch, w: Weights, args, gen: torch.Generator) -> dict:
    """resident, streamed and pinned interleaved within each repetition; per-step medians."""
    step = PriorityStep(acc, m, b, gen)
    x0 = random_rows(m, 1 + b.lp_reqs, gen, acc.device)
    real = {mode: PriorityBuffer(step, PRIORITY_BUFFERS, args.real_staging_bytes, mode == "pinned")
            for mode in ("streamed", "pinned")}
    real["pinned"].run(w, x0, real["pinned"].first)  # fills the private copies, untimed
    resident = torch.zeros(m.layers, *real["streamed"].views[0].shape, dtype=DTYPE, device=acc.device)
    runs = {"resident": functools.partial(step.run_resident, w, x0, resident),
            **{mode: (lambda rb=rb: rb.run(w, x0)) for mode, rb in real.items()}}
    samples: dict[str, list[float]] = {mode: [] for mode in runs}
    for rep in range(args.warmup + args.decode_repeats):
        for mode, run in runs.items():
            t = run()
            if rep >= args.warmup:
                samples[mode].append(t)
    med = {mode: statistics.median(v) for mode, v in samples.items()}
    row = {
        "batch": b.label(), "hp_context": b.hp_context, "lp_reqs": b.lp_reqs, "lp_context": b.lp_context,
        "streamed_MiB_per_layer": len(real["streamed"].bstep.resident) * m.block_bytes / MiB,
        "pinned_streamed_MiB_per_layer": len(real["pinned"].bstep.resident) * m.block_bytes / MiB,
        "host_copy_GiB": priority_host_bytes(m, b) / GiB, "resident_blocks": step.n_hp,
        "resident_ms": med["resident"], "streamed_ms": med["streamed"], "pinned_ms": med["pinned"],
        "pinned_over_resident": med["pinned"] / med["resident"],
        "streamed_over_resident": med["streamed"] / med["resident"], "samples_ms": samples,
    }
    for rb in real.values():
        rb.lb.close()  # the page-locked host copies go now, not at the next collection
    del real, step, resident
    if acc.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def print_table(rows: list[dict], s_values: list[int]) -> None:
    head = ["phase", "batch", "load MiB/layer", "write-back MiB/layer", "c / t / w ms per layer", "resident ms",
            "transfer ms", "ideal ms"] + [f"S={s} ms" for s in s_values] + \
           [f"S={s}/ideal" for s in s_values] + ["S=2/resident", "transfer GB/s"]
    print_markdown(head, [[
        r["phase"], r["batch"], f"{r['load_MiB_per_layer']:g}", f"{r['writeback_MiB_per_layer']:g}",
        f"{r['c_ms_per_layer']:.2f} / {r['t_ms_per_layer']:.2f} / {r['w_ms_per_layer']:.2f}",
        f"{r['resident_ms']:.1f}", f"{r['transfer_ms']:.1f}", f"{r['ideal_ms']:.1f}",
    ] + [f"{r[f'S{s}_ms']:.1f}" for s in s_values] + [f"{r[f'S{s}_over_ideal']:.3f}" for s in s_values]
        + [f"{r['S2_over_resident']:.2f}", f"{r['transfer_GBps']:.1f}"] for r in rows], left=2)


def print_real_table(rows: list[dict], real_s: list[int]) -> None:
    """The connector's LayerBuffer next to the idealised pipeline (same batches, same run)."""
    others = [s for s in real_s if s != 2]
    head = ["phase", "batch", "load MiB/layer (idealised / vllm_aio)", "resident ms", "ideal ms",
            "S=2 ms (idealised)", "vllm_aio S=2 ms", "vllm_aio S=2/ideal", "vllm_aio S=2/idealised S=2"] + \
           [f"vllm_aio S={s} ms" for s in others] + \
           ["host copy GiB (pinned)", "fwd-thread host ms/step: gather / scatter / wait"]
    body = []
    for r in rows:
        real = r["real"]
        if "S2" not in real:
            body.append([r["phase"], r["batch"], f"{r['load_MiB_per_layer']:g} / -", f"{r['resident_ms']:.1f}",
                         f"{r['ideal_ms']:.1f}", f"{r['S2_ms']:.1f}", "-", "-", "-"] +
                        ["-" for _ in others] + [f"{real['host_copy_GiB']:.3g} (skipped)", "-"])
            continue
        s2 = real["S2"]
        h = s2["host_ms_per_step"]
        pinned = s2["host_pinned_GiB"] if s2["host_pinned_GiB"] is not None else real["host_copy_pow2_GiB"]
        body.append([
            r["phase"], r["batch"], f"{r['load_MiB_per_layer']:g} / {s2['load_MiB_per_layer']:g}",
            f"{r['resident_ms']:.1f}", f"{r['ideal_ms']:.1f}", f"{r['S2_ms']:.1f}", f"{s2['ms']:.1f}",
            f"{s2['over_ideal']:.3f}", f"{s2['over_idealised_S']:.2f}",
        ] + [f"{real[f'S{s}']['ms']:.1f}" if f"S{s}" in real else "-" for s in others] + [
            f"{real['host_copy_GiB']:.3g} ({pinned:.3g})",
            f"{h['gather_ms']:.1f} / {h['scatter_ms']:.1f} / {h['wait_ms']:.1f}",
        ])
    print_markdown(head, body, left=2)


def print_priority_table(rows: list[dict]) -> None:
    s = PRIORITY_BUFFERS
    head = ["batch (high + low priority, tokens of context)", "streamed MiB/layer (streamed / pinned)",
            "resident ms", f"vllm_aio S={s} streamed ms", f"vllm_aio S={s} pinned ms", "pinned/resident",
            "streamed/resident"]
    print_markdown(head, [[
        r["batch"], f"{r['streamed_MiB_per_layer']:g} / {r['pinned_streamed_MiB_per_layer']:g}",
        f"{r['resident_ms']:.2f}", f"{r['streamed_ms']:.2f}", f"{r['pinned_ms']:.2f}",
        f"{r['pinned_over_resident']:.2f}", f"{r['streamed_over_resident']:.2f}",
    ] for r in rows], left=1)


def parse_batches(text: str, phase: str) -> list[Batch]:
    """prefill: ``reqs x new [+prefix] [/frag]``; decode: ``reqs x context [/frag]``, comma-separated."""
    out = []
    for item in filter(None, text.split(",")):
        item, _, frag = item.partition("/")
        if frag not in ("", "frag"):
            raise SystemExit(f"{item}/{frag}: the only suffix is /frag")
        reqs, rest = item.split("x")
        if phase == "decode":
            out.append(Batch("decode", int(reqs), 1, int(rest), frag == "frag"))
        else:
            new, _, prefix = rest.partition("+")
            out.append(Batch("prefill", int(reqs), int(new), int(prefix or 0), frag == "frag"))
    return out


def parse_priority(text: str, m: Model) -> list[PriorityBatch]:
    """``1xHP_CONTEXT[+REQSxLP_CONTEXT]``, comma-separated; each high-priority context also alone (first)."""
    out: list[PriorityBatch] = []
    for item in filter(None, text.split(",")):
        hp, _, lp = item.partition("+")
        reqs, hp_context = (int(v) for v in hp.split("x"))
        lp_reqs, lp_context = (int(v) for v in lp.split("x")) if lp else (0, 0)
        lp_context = lp_context if lp_reqs else 0
        contexts = (hp_context, lp_context) if lp_reqs else (hp_context,)
        if reqs != 1 or lp_reqs < 0 or any(c <= 0 or c % m.block_size for c in contexts):
            raise SystemExit(f"--priority {item}: one high-priority request; contexts of whole blocks "
                             f"of {m.block_size} tokens")
        for b in (PriorityBatch(hp_context), PriorityBatch(hp_context, lp_reqs, lp_context)):
            if b not in out:
                out.append(b)
    return out


def main() -> int:
    parser = arguments(__doc__, "dynamic_buffer")
    parser.add_argument("--device", default="auto", help=Accel.HELP)
    parser.add_argument("--prefill", default="1x8192,4x8192,1x8192+32768,1x2048+32768,1x1024+16384,4x512+16384,"
                        "1x1024+16384/frag,4x512+16384/frag",
                        help="prefill batches: REQSxNEW[+CACHED_PREFIX][/frag] (/frag: every other block id free)")
    parser.add_argument("--decode", default="32x2048,256x2048,32x16384,32x2048/frag",
                        help="decode batches: REQSxCONTEXT[/frag]")
    parser.add_argument("--check", default="prefill:1x1024+2048,decode:8x1024", help="small batches to check")
    parser.add_argument("--s-values", default="2,3,4", help="buffer counts S to compare")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--host-gib", type=float, default=8.0, help="pinned host pool (layers share regions beyond it)")
    parser.add_argument("--real-s-values", default="2,3", help="S values of the connector's LayerBuffer")
    parser.add_argument("--real-max-gib", type=float, default=16.0,
                        help="skip the real LayerBuffer where its page-locked host copy (L x blocks x page) is larger")
    parser.add_argument("--real-extra-max-gib", type=float, default=2.5,
                        help="run real S other than 2 only where the host copy is at most this")
    parser.add_argument("--real-staging-mib", type=int, default=2048, help="LayerBuffer's staging_bytes")
    parser.add_argument("--real-repeats", type=int, default=3,
                        help="repetitions of the real LayerBuffer modes (the first ones of --repeats)")
    parser.add_argument("--real-resident", choices=("prefix", "every"), default="prefix",
                        help="BufferStep.resident: the blocks holding earlier tokens (what the scheduler half "
                             "sends, = the idealised load set), or every block of the request (the stress case: "
                             "prefill also loads the blocks it then overwrites)")
    parser.add_argument("--priority", default="1x16384+8x512,1x16384+32x2048,1x4096+4x256",
                        help="decode batches of one high-priority request beside low-priority ones, "
                             "1xHP_CONTEXT+REQSxLP_CONTEXT (each high-priority context also runs alone); two "
                             "LayerBuffers at once, each host copy L x blocks x page at most --real-max-gib")
    parser.add_argument("--priority-check", default="1x1024+4x512", help="priority batches to check")
    args = parser.parse_args()
    acc = Accel(args.device)
    m = TINY if args.quick else LLAMA3_8B
    if args.quick:
        args.prefill, args.decode = "1x128,2x64+256,2x64+256/frag", "4x256"
        args.check = "prefill:1x64+128/frag,decode:2x128"
        args.host_gib, args.s_values = 1 / 16, "2,3"
        args.repeats, args.decode_repeats = min(args.repeats, 2), min(args.decode_repeats, 2)
        args.real_staging_mib = min(args.real_staging_mib, 16)
        args.priority, args.priority_check = "1x256+4x128", "1x64+2x32"
    args.s_values = [int(s) for s in args.s_values.split(",")]
    args.real_s_values = [int(s) for s in args.real_s_values.split(",") if s]
    args.real_staging_bytes = args.real_staging_mib * MiB
    if 2 not in args.s_values:
        raise SystemExit("--s-values must include 2")
    batches = parse_batches(args.prefill, "prefill") + parse_batches(args.decode, "decode")
    checks = [b for item in args.check.split(",") for b in parse_batches(item.split(":")[1], item.split(":")[0])]
    priority = parse_priority(args.priority, m)
    priority_checks = parse_priority(args.priority_check, m)
    too_big = [b.label() for b in priority if priority_host_bytes(m, b) > args.real_max_gib * GiB]
    if too_big:
        raise SystemExit(f"--priority {too_big}: a LayerBuffer host copy above --real-max-gib {args.real_max_gib:g}")
    copy_bytes = (8 * MiB) if args.quick else GiB
    started = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    print(f"{m.name} on {acc.describe()}, torch {torch.__version__}; pinning {args.host_gib:g} GiB", flush=True)
    host_pool = acc.pinned(int(args.host_gib * GiB))
    w = Weights(m, acc.device, gen)
    bw = copy_bandwidth(acc, host_pool, copy_bytes)
    probe = Step(acc, m, checks[0], host_pool, 1, gen)  # only for its two streams
    bw["bidir_GBps"] = bidirectional_bandwidth(acc, host_pool, copy_bytes, (probe.h2d, probe.d2h))
    del probe
    print(f"  one {copy_bytes // MiB} MiB pinned copy: H2D {bw['h2d_GBps']:.1f} GB/s, D2H {bw['d2h_GBps']:.1f} GB/s, "
          f"both at once {bw['bidir_GBps']:.1f} GB/s in total", flush=True)
    check = run_checks(acc, m, checks, host_pool, w, args, gen)
    check.update(run_priority_checks(acc, m, priority_checks, w, args, gen))
    print(f"  checks: {check}", flush=True)
    rows = []
    for b in batches:
        rows.append(measure(acc, m, b, host_pool, w, args, bw, gen))
        r = rows[-1]
        print(f"  {b.phase} {b.label()}: resident {r['resident_ms']:.1f} transfer {r['transfer_ms']:.1f} "
              + " ".join(f"S={s} {r[f'S{s}_ms']:.1f}" for s in args.s_values)
              + "".join(f" vllm_aio S={s} {r['real'][f'S{s}']['ms']:.1f}" for s in args.real_s_values
                        if f"S{s}" in r["real"]) + " ms", flush=True)
    priority_rows = []
    for b in priority:
        priority_rows.append(measure_priority(acc, m, b, w, args, gen))
        r = priority_rows[-1]
        print(f"  priority {b.label()}: resident {r['resident_ms']:.2f} streamed {r['streamed_ms']:.2f} "
              f"pinned {r['pinned_ms']:.2f} ms", flush=True)
    print(f"\n{m.name} ({m.layers} layers, {m.kv_heads} KV heads x {m.head_dim}, bf16, block {m.block_size}: "
          f"{m.block_bytes // 1024} KiB per block per layer), {acc.describe()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; per-step medians ({args.repeats} prefill, {args.decode_repeats} decode "
          f"repetitions); ideal = max(resident, transfer); c = resident/{m.layers}, t and w = bytes at the "
          f"one-copy GB/s\n")
    print_table(rows, args.s_values)
    print(f"\nOne {copy_bytes // MiB} MiB pinned copy: H2D {bw['h2d_GBps']:.1f} GB/s, D2H {bw['d2h_GBps']:.1f} GB/s, "
          f"H2D + D2H at once {bw['bidir_GBps']:.1f} GB/s in total.")
    print(f"Checks (loads and write-backs in order, every S): {check}")
    print(f"\nThe connector's LayerBuffer (vllm_aio S=<n>, real code) next to the idealised pipeline, same run: "
          f"median of {args.real_repeats} (interleaved with the first repetitions above), "
          f"staging {args.real_staging_mib} MiB, BufferStep.resident = "
          + ("the blocks holding earlier tokens, as the scheduler sends them" if args.real_resident == "prefix"
             else "every block of the request") + "; "
          f"host copy = L x blocks x {m.block_bytes // 1024} KiB (in parentheses: page-locked bytes, "
          f"registered exactly); forward-thread host ms per step (median) inside "
          f"LayerBuffer: host gathers for loads / scatters into the host copy / waits on events\n")
    print_real_table(rows, args.real_s_values)
    print(f"\nHigh-priority requests kept resident: decode steps of one high-priority request beside "
          f"low-priority ones, every request decoding one token; per-step medians ({args.decode_repeats} "
          f"repetitions, modes interleaved). resident: the forward alone, every layer's KV in memory of "
          f"its own (as a cache without the buffer); vllm_aio S={PRIORITY_BUFFERS} "
          f"streamed: LayerBuffer, every request streamed; pinned: LayerBuffer(resident_blocks = the "
          f"high-priority request's blocks), its blocks read and written in place at the layer's private ids "
          f"(filled once before timing), the others streamed. Question: pinned/resident <= 1.2?\n")
    print_priority_table(priority_rows)
    write_results(args.json, "dynamic_buffer", started, device=acc.describe(), torch=torch.__version__,
                  model=asdict(m), bandwidth=bw, checks=check,
                  args={k: v for k, v in vars(args).items() if k != "json"}, rows=rows,
                  priority_rows=priority_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
