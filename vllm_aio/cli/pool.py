"""``vllm-aio pool``: list, inspect or clear the embedded host pools of this host (``vllm_aio.pool.inspect``)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_aio.pool.inspect import PoolInfo


def add_parser(commands: argparse._SubParsersAction) -> None:
    pool = commands.add_parser("pool", help="the embedded pools on this host (/dev/shm): list, inspect, clear",
                               description="Inspect or clear the embedded host pools on this host. Listing "
                               "and stats take no lock and change nothing.")
    actions = pool.add_subparsers(dest="action", required=True)
    actions.add_parser("ls", help="every pool: size, entries, fill, hits, evictions, attached pids, stale files")
    stats = actions.add_parser("stats", help="one pool in detail, with its stored values per key namespace")
    stats.add_argument("name")
    clear = actions.add_parser("clear", help="evict a pool's stored values (values being written stay); "
                               "a pool no live process uses is removed")
    clear.add_argument("name")
    clear.add_argument("--namespace", help="only values of this key namespace (16 hex digits, see stats)")
    pool.set_defaults(run=run)


def _bytes(n: float) -> str:
    unit, larger = "B", ["KiB", "MiB", "GiB"]
    while n >= 1024 and larger:
        n, unit = n / 1024, larger.pop(0)
    return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"


def _pool_row(info: PoolInfo) -> list[str]:
    snap = info.snapshot
    if snap is None:
        return [info.name, "-", "-", "-", "-", "-", "-", f"unreadable: {info.problem}"]
    usage = snap.usage
    pids = ",".join(map(str, snap.pids)) or "-"
    state = "stale (no live process)" if info.stale else "in use"
    if snap.dead_pids:
        state += f", {snap.dead_pids} dead pid(s)"
    return [info.name, _bytes(snap.file_bytes), str(usage.num_ready), f"{usage.num_ready / usage.num_slots:.1%}",
            f"{usage.hits}/{usage.lookups}", str(usage.evictions), pids, state]


def _print_table(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def run(args: argparse.Namespace) -> int:
    from vllm_aio.pool import inspect

    try:
        if args.action == "ls":
            infos, orphan_locks = inspect.list_pools()
            _print_table(["NAME", "SIZE", "ENTRIES", "FILL", "HITS/LOOKUPS", "EVICTIONS", "PIDS", "STATE"],
                         [_pool_row(i) for i in infos])
            for name in orphan_locks:
                print(f"lock file without a pool (left over, or a pool being created): {name}")
        elif args.action == "stats":
            _print_stats(inspect.read_pool(args.name))
        else:
            done = inspect.clear(args.name, args.namespace)
            which = f"values of namespace {args.namespace}" if args.namespace else "values"
            print(f"evicted {done.evicted} {which} from pool {args.name!r}"
                  + ("; no live process used it: removed" if done.removed else ""))
    except (LookupError, RuntimeError, ValueError, OSError) as exc:
        print(f"vllm-aio pool {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


def _print_stats(info: PoolInfo) -> None:
    from vllm_aio.pool.inspect import namespaces

    snap = info.snapshot
    if snap is None:
        raise RuntimeError(info.problem)
    usage = snap.usage
    hit_rate = f" ({usage.hits / usage.lookups:.1%})" if usage.lookups else ""
    fields = {
        "pool": f"{info.name} ({'stale: no live process attached' if info.stale else 'in use'})",
        "file": f"{_bytes(snap.file_bytes)}",
        "slots": f"{usage.num_slots} of {_bytes(usage.slot_size)}",
        "entries": f"{usage.num_ready} ({usage.num_ready / usage.num_slots:.1%} full, {_bytes(usage.bytes_used)})",
        "being written": str(snap.writing),
        "hits/lookups": f"{usage.hits}/{usage.lookups}{hit_rate}",
        "evictions": str(usage.evictions),
        "attached pids": (",".join(map(str, snap.pids)) or "-")
        + (f" ({snap.dead_pids} dead)" if snap.dead_pids else ""),
    }
    for key, value in fields.items():
        print(f"{key + ':':15}{value}")
    counts = namespaces(snap)
    if counts:
        print()
        _print_table(["NAMESPACE", "ENTRIES"], [[ns, str(n)] for ns, n in counts.most_common()])
