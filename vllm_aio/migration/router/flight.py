"""What the router knows of a request in flight, and of each move it made."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_aio.migration.driver import Instance
from vllm_aio.migration.policy import Candidate


@dataclass
class MoveRecord:
    """One move the router made (``GET /router/status``)."""

    request_id: str
    priority: int
    source: str
    target: str
    after_tokens: int  # generated on the source before the move
    stalled: bool  # moved at once (waiting or preempted), not at a block boundary
    mode: str | None  # move_kv's: "copy", "shared", "none"; None: no KV moved (the target recomputes)
    seconds: float
    error: str | None = None  # why the KV did not move


@dataclass
class Flight:
    """A request in flight through the router."""

    request_id: str
    priority: int
    prompt: list[int]
    body: dict[str, Any]  # the client's fields, prompt excluded
    instance: Instance
    arrival: float = field(default_factory=time.monotonic)
    generated: list[int] = field(default_factory=list)
    order: Instance | None = None  # where the policy wants it
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def candidate(self) -> Candidate:
        return Candidate(self.request_id, self.instance.url, self.priority, self.arrival,
                         len(self.prompt) + len(self.generated), started=bool(self.generated))
