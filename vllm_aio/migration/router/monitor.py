"""The router's watch over its instances: polls their ``/metrics``, sees pressure, places new
requests and orders the moves ``policy.pick_moves`` decides."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import aiohttp

from vllm_aio.log import get_logger
from vllm_aio.migration.driver import Instance, MigrationError
from vllm_aio.migration.policy import Load, Move, pick_moves, pressured, waiting_blocks
from vllm_aio.migration.router.flight import Flight, MoveRecord
from vllm_aio.migration.router.metrics_text import parse_load

logger = get_logger(__name__)

MOVES_KEPT = 1000  # the latest moves, for /router/status


class Monitor:
    """Each instance's load at the last poll, the moves in flight and done; ``policy`` None places
    requests but moves none."""

    def __init__(self, instances: list[Instance], flights: Mapping[str, Flight], policy: str | None,
                 interval_s: float) -> None:
        self.instances = instances
        self.flights = flights  # the router's, read here
        self.policy = policy
        self.interval_s = interval_s
        self.loads: dict[str, Load] = {}
        self.moves: deque[MoveRecord] = deque(maxlen=MOVES_KEPT)
        self.block_size: int | None = None
        self._before: dict[str, Load] = {}
        self._busy: set[str] = set()  # instances a move is in flight from or to
        self._pressured: set[str] = set()  # at the last poll (/router/status); logged when it becomes so

    async def run(self, http: aiohttp.ClientSession) -> None:
        while True:
            try:
                await self._poll(http)
            except Exception:  # a monitor that dies would silently stop every move
                logger.exception("vllm_aio router: poll failed")
            await asyncio.sleep(self.interval_s)

    def place(self, named: str | None) -> Instance | None:
        """The instance a new request goes to: the one ``named`` (URL or index), else the one with the
        most free KV blocks, then the fewest requests in flight; None: ``named`` names none."""
        if named is not None:
            if named.isdigit():
                return self.instances[int(named)] if int(named) < len(self.instances) else None
            return next((i for i in self.instances if i.url == named.rstrip("/")), None)
        in_flight = {i.url: 0 for i in self.instances}
        for flight in self.flights.values():
            in_flight[flight.instance.url] += 1
        free = {url: load.free_blocks for url, load in self.loads.items()}
        return max(self.instances, key=lambda i: (free.get(i.url, 0), -in_flight[i.url]))

    def release(self, flight: Flight) -> None:
        """``flight``'s move order is over: moved, failed, or finished before it could move."""
        if flight.order is None:
            return
        self._busy.discard(flight.instance.url)
        self._busy.discard(flight.order.url)
        flight.order = None
        flight.wake.clear()

    def status(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "instances": [{"url": i.url, "load": asdict(self.loads[i.url]) if i.url in self.loads else None,
                           "pressured": i.url in self._pressured}
                          for i in self.instances],
            "flights": [{"request_id": f.request_id, "priority": f.priority, "instance": f.instance.url,
                         "prompt_tokens": len(f.prompt), "generated": len(f.generated)}
                        for f in self.flights.values()],
            "moves": [asdict(m) for m in self.moves],
        }

    async def _poll(self, http: aiohttp.ClientSession) -> None:
        loads = await asyncio.gather(*(self._load(http, i) for i in self.instances))
        # Each instance's last load seen: a poll that failed (a busy server's /metrics past its timeout)
        # breaks no comparison.
        self._before = {**self._before, **self.loads}
        self.loads = {i.url: load for i, load in zip(self.instances, loads) if load}
        self._log_pressure()
        if self.policy is None or await self._block() is None:
            return
        candidates = [f.candidate() for f in self.flights.values() if f.order is None]
        for move in pick_moves(self._before, self.loads, candidates, self.block_size, self._busy):
            self._order(move)

    def _log_pressure(self) -> None:
        now = self._pressured_now()
        for url in now - self._pressured:
            load = self.loads[url]
            logger.info("vllm_aio router: %s pressured (%d waiting, %.0f preemptions, %d of %d KV blocks free)",
                        url, load.waiting, load.preemptions, load.free_blocks, load.kv_blocks)
        self._pressured = now

    def _pressured_now(self) -> set[str]:
        needs = {}
        if self.block_size is not None:
            needs = waiting_blocks([f.candidate() for f in self.flights.values()], self.block_size)
        return {url for url, load in self.loads.items() if pressured(self._before.get(url), load, needs.get(url))}

    async def _load(self, http: aiohttp.ClientSession, instance: Instance) -> Load | None:
        try:
            async with http.get(f"{instance.url}/metrics", headers=instance.headers(),
                                timeout=aiohttp.ClientTimeout(total=5)) as reply:
                return parse_load(await reply.text()) if reply.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None  # unreachable: neither a source nor a target this poll

    async def _block(self) -> int | None:
        """The instances' block size (the protocol requires them equal), once one answers."""
        if self.block_size is None:
            try:
                session = await asyncio.to_thread(self.instances[0].call, "session", {})
                self.block_size = session["block_size"]
            except MigrationError as exc:
                logger.warning("vllm_aio router: no migration session yet: %s", exc)
        return self.block_size

    def _order(self, move: Move) -> None:
        flight = self.flights.get(move.request_id)
        if flight is None:  # finished since the candidates were listed
            return
        flight.order = next(i for i in self.instances if i.url == move.target)
        self._busy.update((move.source, move.target))
        flight.wake.set()
        logger.info("vllm_aio router: moving %s (priority %d) from %s to %s", flight.request_id, flight.priority,
                    move.source, move.target)
