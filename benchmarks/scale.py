"""How the scheduler half scales: prompt length x layers x TP x transfer mode, embedded pool and Mooncake.

For every deployment shape (layers 32 and 61, TP 1 and 8 with 8 KV heads, so 1
or 8 shards; whole-block values or one value per layer) the pool first holds
every part of a 128k-token prompt (16-token blocks, 8,192 blocks); shorter
prompts are its prefixes. Then, per prompt length, through the real
``AioScheduler`` (median of ``--reps`` repetitions, each a new request id, so
nothing is remembered between them):

- ``lookup``: the first ``get_num_new_matched_tokens`` of a fully cached prompt
  (what vLLM calls on admission);
- ``before``: the lookup this replaced, one key per block x shard x unit
  (``block_key`` for each, then one ``batch_exists``), on the same pool;
- ``again``: the same request asked again while it waits (incremental: the
  embedded pool resumes after what it found; Mooncake has no presence epoch and
  asks again from the first block);
- ``step``: the scheduler's work for the step that admits the request:
  lookup, ``update_state_after_alloc`` and ``build_connector_meta`` (the load
  of every block);
- ``meta``: that step's metadata pickled as vLLM sends it to each worker, next
  to the same transfer as a list of ints and a list of hashes (``before``),
  in bytes and in pickle + unpickle time;
- ``vLLM schedule``: vLLM's own ``Scheduler.schedule()`` admitting the same
  prompt (prefix caching on, 8,192-token chunks, no connector), in the same run.

The embedded pool is filled through its index only (``reserve`` + ``commit``,
64-byte values): lookups never read values. Mooncake (a real master and memory
owner on loopback, ``vllm_aio.devtools``) holds the one probe key per block a
lookup asks (``BlockParts.probe_keys``); the master answers for the keys asked
only, so the other parts would not change the time. A second table gives the
master's cost per key of ``batch_is_exist``, a third the worker's per-step key
building (``block_key`` per block and unit, as ``BlockIO.keys`` does).

    .venv/bin/python -m benchmarks.scale [--quick]
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pickle
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from benchmarks._report import arguments, plot, plot_argument, print_markdown, progress, write_results
from vllm_aio.backends import Backend
from vllm_aio.backends.local import LocalBackend
from vllm_aio.config import TransferMode
from vllm_aio.connector.scheduler.scheduler import AioScheduler
from vllm_aio.pool.entry import HEADER_BYTES
from vllm_aio.pool.keys import BlockParts, Namespace, block_key
from vllm_aio.pool.ownership import Ownership
from vllm_aio.shared.deployment import Deployment

BS = 16
KV_HEADS = 8
LENGTHS = (4096, 16384, 32768, 65536, 131072)
SHAPES = [(layers, tp, layerwise) for layerwise in (False, True) for layers in (32, 61) for tp in (1, 8)]
FILL_BATCH = 1 << 16  # keys per reserve/commit while filling
MOONCAKE_VALUE = 64  # bytes of each probe key's value
MOONCAKE_PUT_BATCH = 1024  # keys per put: 4,096 overflow the tcp transport's queue (rc -1 for most)
MOONCAKE_POOL = "4GB"  # the master hands out space in large units: 65,536 tiny values fill 256 MB


@dataclass
class Request:
    """What the scheduler half reads of vLLM's ``Request``."""

    request_id: str
    num_prompt_tokens: int
    block_hashes: list[bytes]
    num_output_tokens: int = 0
    priority: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens


@dataclass
class _ListTransfer:
    """The per-step transfer as it was sent before: a Python object per block."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    first_index: int


@dataclass
class Row:
    pool: str
    mode: str
    layers: int
    tp: int
    tokens: int
    parts: int
    lookup_ms: float
    again_ms: float
    step_ms: float
    meta_bytes: int
    meta_before_bytes: int
    meta_ms: float
    meta_before_ms: float
    before_ms: float | None = None
    vllm_ms: float | None = None
    extra: dict = field(default_factory=dict)


def deployment(layers: int, tp: int, layerwise: bool) -> Deployment:
    ns = Namespace(f"bench-{layers}L", "bf16", "auto", BS, "LBHNC", "-", tp, 1, 1, 1, 0, "scale")
    return Deployment(
        namespace=ns, block_size=BS, layer_names=tuple(f"l{i}" for i in range(layers)),
        transfer_mode=TransferMode.LAYERWISE if layerwise else TransferMode.WHOLE_BLOCKS, value_bytes=HEADER_BYTES,
        load_enabled=True, save_enabled=True, save_decode_cache=False,
        pool_name="scale", num_kv_heads=KV_HEADS, use_mla=False,
    )


def parts_of(dep: Deployment) -> BlockParts:
    shards = tuple(Ownership(dep.topology()).all_shard_ids())
    return BlockParts(dep.namespace.digest(), shards, tuple(u.tag for u in dep.units()))


def prompt_hashes(blocks: int) -> list[bytes]:
    """Chained sha256 block hashes, as vLLM's default."""
    out, prev = [], b""
    for i in range(blocks):
        prev = hashlib.sha256(prev + i.to_bytes(8, "little")).digest()
        out.append(prev)
    return out


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def admit(sched: AioScheduler, req: Request) -> object:
    """The scheduler's part of the step that admits ``req`` with a full pool hit; returns the step's metadata."""
    hit, _ = sched.get_num_new_matched_tokens(req, 0)
    block_ids = list(range(1, len(req.block_hashes) + 2))
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (block_ids,)), hit)
    out = SimpleNamespace(
        finished_req_ids=set(),
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=(block_ids,), num_computed_tokens=hit)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()),
        num_scheduled_tokens={req.request_id: req.num_tokens - hit},
        preempted_req_ids=None,
    )
    meta = sched.build_connector_meta(out)
    sched.request_finished(req, block_ids)
    return meta


def list_transfer(req: Request) -> list[_ListTransfer]:
    blocks = len(req.block_hashes)
    return [_ListTransfer(req.request_id, list(range(1, blocks + 1)), list(req.block_hashes), 0)]


def wire(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def per_key_lookup(backend: Backend, parts: BlockParts, hashes: list[bytes]) -> int:
    """The lookup as it was: every part's key, one batch_exists, the first block missing one."""
    keys = [key for h in hashes for key in parts.keys(h)]
    present = backend.batch_exists(keys)
    for i in range(len(hashes)):
        if not all(present[i * parts.count : (i + 1) * parts.count]):
            return i
    return len(hashes)


def measure(pool: str, backend: Backend, dep: Deployment, hashes: list[bytes], lengths: list[int], reps: int,
            before_max_keys: int) -> list[Row]:
    parts = parts_of(dep)
    sched = AioScheduler(dep, backend)
    rows = []
    for tokens in lengths:
        blocks = tokens // BS
        ids = iter(range(1 << 30))

        def request() -> Request:
            return Request(f"r{next(ids)}", tokens, hashes[:blocks])

        waiting = request()
        assert sched.get_num_new_matched_tokens(waiting, 0)[0] == tokens - 1, "the prompt is not fully cached"
        row = Row(
            pool, "layerwise" if dep.transfer_mode is TransferMode.LAYERWISE else "whole blocks",
            len(dep.layer_names), dep.namespace.tp_size, tokens, parts.count,
            lookup_ms=median_ms(lambda: sched.get_num_new_matched_tokens(request(), 0), reps),
            again_ms=median_ms(lambda: sched.get_num_new_matched_tokens(waiting, 0), reps),
            step_ms=median_ms(lambda: admit(sched, request()), reps),
            meta_bytes=len(wire(meta := admit(sched, request()))),
            meta_before_bytes=len(wire(old := list_transfer(waiting))),
            meta_ms=median_ms(lambda: pickle.loads(wire(meta)), reps),
            meta_before_ms=median_ms(lambda: pickle.loads(wire(old)), reps),
        )
        if blocks * parts.count <= before_max_keys:
            assert per_key_lookup(backend, parts, hashes[:blocks]) == blocks
            row.before_ms = median_ms(lambda: per_key_lookup(backend, parts, hashes[:blocks]),
                                      reps if blocks * parts.count <= 300_000 else 1)
        sched.request_finished(waiting, [])
        rows.append(row)
    return rows


# ---- the embedded pool -------------------------------------------------------------------


def embedded_rows(shapes, lengths, reps, before_max_keys, quick: bool) -> list[Row]:
    hashes = prompt_hashes(max(lengths) // BS)
    rows = []
    for layers, tp, layerwise in progress(shapes, len(shapes), "embedded pool shapes", quick):
        dep = deployment(layers, tp, layerwise)
        parts = parts_of(dep)
        keys = [key for h in hashes for key in parts.keys(h)]
        backend = LocalBackend(f"scale-{uuid.uuid4().hex[:8]}", len(keys) * 64, 64, seal=True)
        try:
            pool = backend.pool
            started = time.perf_counter()
            for start in range(0, len(keys), FILL_BATCH):
                pool.commit(backend.slots().reserve(keys[start : start + FILL_BATCH]))
            fill_s = time.perf_counter() - started
            shape_rows = measure("embedded", backend, dep, hashes, lengths, reps, before_max_keys)
            for row in shape_rows:
                row.extra["fill_us_per_key"] = fill_s / len(keys) * 1e6
            rows += shape_rows
        finally:
            backend.close()
        print(f"  embedded {layers} layers TP={tp} {'layerwise' if layerwise else 'whole'}: "
              f"{len(keys)} values, filled at {fill_s / len(keys) * 1e6:.1f} us/value", flush=True)
    return rows


# ---- Mooncake ----------------------------------------------------------------------------


def mooncake_missing() -> str | None:
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401

        from vllm_aio.devtools.mooncake_pool import find_binary

        find_binary("mooncake_master")
        find_binary("mooncake_client")
    except Exception as exc:  # ImportError, OSError (libibverbs), PoolError
        return str(exc)
    return None


def mooncake_rows(shapes, lengths, reps) -> tuple[list[Row], list[dict]]:
    from vllm_aio.backends.mooncake import MooncakeBackend, MooncakeSettings
    from vllm_aio.devtools.mooncake_pool import MooncakePool

    hashes = prompt_hashes(max(lengths) // BS)
    rows = []
    with MooncakePool(MOONCAKE_POOL) as pool:
        backend = MooncakeBackend(MooncakeSettings.load(pool.config, environ={}))
        try:
            value = (ctypes.c_ubyte * MOONCAKE_VALUE)()
            backend.register_memory(ctypes.addressof(value), MOONCAKE_VALUE)
            segments = [[(ctypes.addressof(value), MOONCAKE_VALUE)]]
            for layers, tp, layerwise in shapes:
                dep = deployment(layers, tp, layerwise)
                keys = parts_of(dep).probe_keys(hashes)
                for start in range(0, len(keys), MOONCAKE_PUT_BATCH):
                    batch = keys[start : start + MOONCAKE_PUT_BATCH]
                    statuses = backend.batch_put(batch, segments * len(batch))
                    failed = [s for s in statuses if not s.stored]
                    if failed:
                        raise RuntimeError(f"Mooncake put: {len(failed)} of {len(batch)} keys {failed[0]}")
                rows += measure("Mooncake", backend, dep, hashes, lengths, reps, before_max_keys=0)
                print(f"  Mooncake {layers} layers TP={tp} {'layerwise' if layerwise else 'whole'}: done", flush=True)
            master = master_cost(backend, parts_of(deployment(*shapes[0])).probe_keys(hashes), reps)
        finally:
            backend.close()
    return rows, master


def master_cost(backend: Backend, present: list[str], reps: int) -> list[dict]:
    """``batch_is_exist`` round trips of n present keys (and of n absent ones): ms per call, us per key."""
    out = []
    for n in sorted({1, 256, 2048, min(8192, len(present))}):
        absent = [f"absent-{uuid.uuid4().hex}-{i}" for i in range(n)]
        for kind, keys in (("present", present[:n]), ("absent", absent)):
            ms = median_ms(lambda: backend.batch_exists(keys), reps)
            out.append({"keys": n, "kind": kind, "ms": ms, "us_per_key": ms * 1e3 / n})
    return out


# ---- vLLM's own scheduler ----------------------------------------------------------------


def vllm_schedule_ms(lengths: list[int], reps: int) -> dict[int, float]:
    """vLLM's ``Scheduler.schedule()`` admitting a prompt of each length, no connector; {} without vLLM."""
    try:
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request as VllmRequest
        from vllm.v1.structured_output import StructuredOutputManager
    except ImportError as exc:
        print(f"  vLLM not importable ({exc}): no vLLM column", flush=True)
        return {}
    from vllm_aio.devtools.tiny_model import PRESETS, ensure_model

    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # only configs are built: no positions run
    model = ensure_model(Path(__file__).resolve().parent.parent / "models" / "tiny", PRESETS["tiny"])
    max_len = max(lengths) + BS
    blocks = max_len // BS + 64
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)

    def fresh() -> Scheduler:
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(model), max_model_len=max_len, skip_tokenizer_init=True),
            cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=16, max_model_len=max_len,
                                             is_encoder_decoder=False),
        )
        vllm_config.cache_config.num_gpu_blocks = blocks
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=128, dtype=torch.bfloat16)
        kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
        return Scheduler(vllm_config, kv, StructuredOutputManager(vllm_config), block_size=BS)

    out = {}
    for tokens in lengths:
        times = []
        for rep in range(reps):
            scheduler = fresh()  # nothing in vLLM's prefix cache: it looks up every block, as we do
            scheduler.add_request(VllmRequest(f"v{rep}", prompt_token_ids=[rep % 1000 + 3] * tokens,
                                              sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                                              block_hasher=hasher))
            start = time.perf_counter()
            scheduler.schedule()
            times.append(time.perf_counter() - start)
        out[tokens] = statistics.median(times) * 1e3
    return out


# ---- the worker's keys ---------------------------------------------------------------------


def worker_key_rows(shapes, lengths, reps) -> list[dict]:
    """``block_key`` for every block of one unit (what ``BlockIO.keys`` builds per layer batch), per rank and step."""
    hashes = prompt_hashes(max(lengths) // BS)
    out = []
    for layers in sorted({s[0] for s in shapes}):
        blocks = hashes[: max(lengths) // BS]
        ms = median_ms(lambda: [block_key("0123456789abcdef", "pp0.dcp0.h0", h, 0) for h in blocks], reps)
        out.append({"layers": layers, "tokens": max(lengths), "ms_per_unit": ms, "ms_layerwise_step": ms * layers})
    return out


# ---- report --------------------------------------------------------------------------------


def fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.3f}" if ms < 10 else f"{ms:.1f}" if ms < 1000 else f"{ms:.0f}"


def print_tables(rows: list[Row], master: list[dict], worker: list[dict]) -> None:
    head = ("pool", "mode", "layers", "TP", "tokens", "parts/block", "lookup ms", "before ms", "again ms",
            "step ms", "vLLM schedule ms", "meta KiB", "before KiB", "meta wire ms", "before wire ms")
    print_markdown(head, [(
        r.pool, r.mode, str(r.layers), str(r.tp), f"{r.tokens // 1024}k", str(r.parts), fmt(r.lookup_ms),
        fmt(r.before_ms), fmt(r.again_ms), fmt(r.step_ms), fmt(r.vllm_ms), f"{r.meta_bytes / 1024:.1f}",
        f"{r.meta_before_bytes / 1024:.1f}", fmt(r.meta_ms), fmt(r.meta_before_ms),
    ) for r in rows], left=2, title="Scheduler lookups and steps of one fully cached prompt (medians; '-': not run)")
    if master:
        print_markdown(("keys", "kind", "batch_is_exist ms", "us/key"), [
            (str(m["keys"]), m["kind"], fmt(m["ms"]), f"{m['us_per_key']:.2f}") for m in master
        ], title="Mooncake master on loopback: one batch_is_exist round trip")
    print_markdown(("layers", "tokens", "keys of one unit ms", "layerwise step ms"), [
        (str(w["layers"]), f"{w['tokens'] // 1024}k", fmt(w["ms_per_unit"]), fmt(w["ms_layerwise_step"]))
        for w in worker
    ], title="Worker: building one rank's keys of a step that loads the whole prompt (BlockIO.keys per unit)")


def plot_lookups(rows: list[Row], path: Path) -> None:
    series = {}
    for key in sorted({(r.pool, r.mode, r.layers, r.tp) for r in rows}):
        picked = [r for r in rows if (r.pool, r.mode, r.layers, r.tp) == key]
        series[f"{key[0]} {key[1]} {key[2]}L TP{key[3]}"] = ([r.tokens for r in picked], [r.lookup_ms for r in picked])
    vllm = sorted({(r.tokens, r.vllm_ms) for r in rows if r.vllm_ms is not None})
    plot(path, "Lookup of a fully cached prompt", ("prompt tokens", "ms"), series,
         {"vLLM schedule()": tuple(zip(*vllm))} if vllm else None, log="xy")


def main() -> int:
    parser = arguments(__doc__, "scale")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-mooncake", action="store_true", help="the embedded pool only")
    plot_argument(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    lengths, shapes, reps, before_max_keys = list(LENGTHS), SHAPES, args.reps, 5_000_000
    if args.quick:
        lengths, reps, before_max_keys = [4096, 16384], 2, 300_000
        shapes = [s for s in SHAPES if s[0] == 32]
    rows = embedded_rows(shapes, lengths, reps, before_max_keys, args.quick)
    master: list[dict] = []
    reason = "--no-mooncake" if args.no_mooncake else mooncake_missing()
    if reason is None:
        mooncake, master = mooncake_rows(shapes, lengths, reps)
        rows += mooncake
    else:
        print(f"  no Mooncake rows: {reason}", flush=True)
    vllm = vllm_schedule_ms(lengths, reps)
    for row in rows:
        row.vllm_ms = vllm.get(row.tokens)
    worker = worker_key_rows(shapes, lengths, reps)
    print_tables(rows, master, worker)
    if args.plot:
        plot_lookups(rows, args.plot)
    write_results(args.json, "scale", started, rows=[r.__dict__ for r in rows], mooncake_master=master,
                  worker_keys=worker, vllm_schedule_ms=vllm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
