"""How much MooncakeBackend costs over the raw Mooncake client, on loopback.

One run starts a pool (master + memory owner, ``vllm_aio.devtools``), then for
each case times, on the same client, the same registered memory and the same
sizes:

- ``raw``: ``batch_put_from`` / ``batch_get_into``, one contiguous value per key
  (what Mooncake reaches with no scatter at all: the ceiling for us);
- ``ours 1 seg``: ``MooncakeBackend.batch_put/get`` with one segment per key
  (our Python layer alone);
- the same bytes scattered over N segments per key, as a KV block spread over
  layers is: ``multi N seg`` forced through ``batch_*_multi_buffers``,
  ``staged N seg`` forced through the staging buffer (gather, then one raw
  batch), and ``ours N seg`` as the backend chooses (staged below a mean
  segment of ``STAGE_BELOW`` on tcp).

Each repetition runs the variants back to back, in a rotating order (so
machine noise and first-touch costs hit them alike), each with fresh keys (a put of an existing key is a no-op in
Mooncake), gets each variant's keys back, checks the bytes and removes the keys.
A plain memcpy of the same bytes, measured in the same run, is the host-memory
ceiling. Reported: median GB/s (1e9 B/s) of ``--reps`` repetitions after one
warm-up repetition.

    .venv/bin/python -m benchmarks.mooncake_backend
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_aio import backends
from vllm_aio.backends import Backend, Status
from vllm_aio.config import parse_extra_config
from vllm_aio.device.segment import Segment
from vllm_aio.devtools.mooncake_pool import MooncakePool
from benchmarks._report import arguments, print_markdown, write_results


@dataclass(frozen=True)
class Case:
    keys: int
    value: int  # bytes per key
    parts: int  # segments per key in the scattered variant

    @property
    def total(self) -> int:
        return self.keys * self.value

    def __str__(self) -> str:
        return f"{self.keys} x {_human(self.value)}"


def _human(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def segments(base: int, case: Case, parts: int) -> list[list[Segment]]:
    """Key i's value as ``parts`` pieces, piece j in the j-th region of the tensor."""
    piece = case.value // parts
    return [[(base + (j * case.keys + i) * piece, piece) for j in range(parts)] for i in range(case.keys)]


def fresh_keys(n: int) -> list[str]:
    prefix = uuid.uuid4().hex
    return [f"{prefix}-{i}" for i in range(n)]


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Bench:
    """The variants of one case, interleaved within each repetition (fair under noise)."""

    def __init__(self, backend: Backend, case: Case) -> None:
        self.backend, self.store, self.case = backend, backend._store, case
        self.src = torch.randint(0, 256, (case.total,), dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        for t in (self.src, self.dst):
            backend.register_memory(t.data_ptr(), t.numel())
        self.variants: dict[str, tuple[Callable[[list[str]], None], Callable[[list[str]], None]]] = {
            "raw": (self._raw_put, self._raw_get),
            "ours 1 seg": self._ours(1),
            "multi N seg": self._ours(case.parts, stage_below=0),
            "staged N seg": self._ours(case.parts, stage_below=1 << 62),
            "ours N seg": self._ours(case.parts),
        }

    def run(self, reps: int) -> dict[str, tuple[float, float]]:
        """Median (put GB/s, get GB/s) per variant; the first repetition is a warm-up."""
        times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in self.variants}
        names = list(self.variants)
        for rep in range(reps + 1):
            order = names[rep % len(names):] + names[:rep % len(names)]  # no variant always goes first
            keys = {name: fresh_keys(self.case.keys) for name in names}
            for name in order:
                put = self.variants[name][0]
                t = timed(lambda: put(keys[name]))
                if rep:
                    times[name][0].append(t)
            for name in order:
                get = self.variants[name][1]
                self.dst.zero_()
                t = timed(lambda: get(keys[name]))
                assert torch.equal(self.src, self.dst), f"{name}: round trip changed the bytes"
                if rep:
                    times[name][1].append(t)
            for used in keys.values():
                self.store.batch_remove(used, True)  # room for the next repetition
        gbps = lambda ts: self.case.total / statistics.median(ts) / 1e9  # noqa: E731
        return {name: (gbps(p), gbps(g)) for name, (p, g) in times.items()}

    def memcpy(self, reps: int) -> float:
        ts = [timed(lambda: self.dst.copy_(self.src)) for _ in range(reps + 1)][1:]
        return self.case.total / statistics.median(ts) / 1e9

    def _raw_put(self, keys: list[str]) -> None:
        step, base = self.case.value, self.src.data_ptr()
        codes = self.store.batch_put_from(keys, [base + i * step for i in range(len(keys))], [step] * len(keys))
        assert all(c == 0 for c in codes), codes

    def _raw_get(self, keys: list[str]) -> None:
        step, base = self.case.value, self.dst.data_ptr()
        codes = self.store.batch_get_into(keys, [base + i * step for i in range(len(keys))], [step] * len(keys))
        assert all(c == step for c in codes), codes

    def _ours(
        self, parts: int, stage_below: int | None = None
    ) -> tuple[Callable[[list[str]], None], Callable[[list[str]], None]]:
        """Our batch calls; ``stage_below`` forces the path (0: multi-buffer, huge: staged) by setting
        the backend's private ``_stage_below`` around the call: MooncakeBackend takes no such parameter."""
        src = segments(self.src.data_ptr(), self.case, parts)
        dst = segments(self.dst.data_ptr(), self.case, parts)
        policy = self.backend._stage_below

        def call(op: Callable[..., list[Status]], keys: list[str], segs: list[list[Segment]]) -> None:
            self.backend._stage_below = policy if stage_below is None else stage_below
            try:
                assert set(op(keys, segs)) == {Status.OK}
            finally:
                self.backend._stage_below = policy

        return (lambda keys: call(self.backend.batch_put, keys, src),
                lambda keys: call(self.backend.batch_get, keys, dst))


def open_backend(pool: MooncakePool, engine_segment: str, value_bytes: int) -> Backend:
    """A MooncakeBackend for values of ``value_bytes``, opened on ``pool`` as the connector's worker opens it."""
    extra = {"backend": "mooncake", **pool.config, "global_segment_size": engine_segment}
    return backends.open_backend(parse_extra_config(extra, environ={}).backend_settings, "bench", value_bytes,
                                 for_scheduler=False)


def main() -> int:
    parser = arguments(__doc__, "mooncake_backend")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--pool-size", default="2GB", help="memory of the standalone owner")
    parser.add_argument("--engine-segment", default="0",
                        help="memory this process contributes too (default 0: all values cross to the owner)")
    args = parser.parse_args()
    cases = [Case(32, 1 << 20, 8), Case(256, 64 << 10, 8)]
    if args.quick:
        args.reps, args.pool_size = min(args.reps, 1), "256MB"
        cases = [Case(8, 1 << 20, 8), Case(32, 64 << 10, 8)]
    started = time.perf_counter()
    rows: list[dict] = []
    with MooncakePool(args.pool_size) as pool:
        for case in cases:
            backend = open_backend(pool, args.engine_segment, case.value)
            try:
                bench = Bench(backend, case)
                rows.append({"case": f"{case}, N={case.parts}", "GBps": bench.run(args.reps),
                             "memcpy_GBps": bench.memcpy(args.reps)})
            finally:
                backend.close()
    names = list(rows[0]["GBps"])
    body = []
    for r in rows:
        for op, i in (("put", 0), ("get", 1)):
            values = [r["GBps"][name][i] for name in names]
            body.append([r["case"], op, *(f"{v:.2f}" for v in values), f"{values[-1] / values[0]:.0%}"])
        body.append([r["case"], "memcpy", f"{r['memcpy_GBps']:.2f}", *["" for _ in names]])
    print_markdown(["case", "op", *names, "ours N/raw"], body, left=2,
                   title=f"Mooncake loopback, tcp, engine segment {args.engine_segment} + standalone owner "
                         f"{args.pool_size}; median of {args.reps}, GB/s")
    write_results(args.json, "mooncake_backend", started, args=vars(args), rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
