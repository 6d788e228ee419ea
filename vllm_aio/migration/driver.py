"""The caller's side of a migration, given two instances by URL: ``move_kv`` moves one token
sequence's KV in the protocol's order (flush, session, extra_size, allocate, transfer, commit;
a failure raises ``MigrationError`` and leaves the request on the source), and
``generate_migrating`` streams a request, moves it at a block boundary and resumes it on the target.
The order and what continues exactly: ``docs/migration.md``, "The driver".
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import requests

from vllm_aio.migration.margin import top_two_gap


class MigrationError(RuntimeError):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Instance:
    """A vLLM OpenAI server running the connector with ``"migration": true``."""

    url: str  # e.g. http://10.0.0.7:8000
    api_key: str | None = None
    timeout: float = 300.0

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def call(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            reply = requests.post(f"{self.url}/v1/kv_migration/{op}", json=body, headers=self.headers(),
                                  timeout=self.timeout)
        except requests.RequestException as exc:
            raise MigrationError(f"{self.url} {op}: {exc}") from exc
        try:
            data = reply.json()
        except ValueError:
            data = {"error": reply.text[:200]}
        if reply.status_code != 200:
            message = data.get("error") or data.get("message") or data
            raise MigrationError(f"{self.url} {op} ({reply.status_code}): {message}", reply.status_code)
        return data

    def model(self) -> str:
        reply = requests.get(f"{self.url}/v1/models", headers=self.headers(), timeout=self.timeout)
        reply.raise_for_status()
        return reply.json()["data"][0]["id"]


@dataclass
class MoveReport:
    mode: str  # "copy" (peer to peer), "shared" (one store: no bytes moved), "none" (the target had it all)
    migration_id: str | None
    full_blocks: int
    moved_blocks: int  # blocks copied into the target's pool (0 through a shared store)
    bytes: int
    matched_tokens: int  # tokens the target's pool holds for the sequence after the commit
    seconds: dict[str, float] = field(default_factory=dict)  # per phase, and "total"

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds["total"] / 1e9 if self.seconds.get("total") else 0.0


def move_kv(source: Instance, target: Instance, token_ids: list[int], flush_timeout: float = 30.0) -> MoveReport:
    """Have the target's pool hold every full block of ``token_ids`` that the source computed."""
    clock = _Phases()
    source.call("flush", {"token_ids": token_ids, "timeout_s": flush_timeout})
    clock.lap("flush")
    src = source.call("session", {})
    dst = target.call("session", {})
    _check_compatible(src, dst)
    clock.lap("session")
    extra = target.call("extra_size", {"token_ids": token_ids})
    if extra["lacking_blocks"] == 0:  # one shared store: the flush put them where the target looks
        shared = src["shared_store"] is not None and src["shared_store"] == dst["shared_store"]
        return MoveReport("shared" if shared else "none", None, extra["full_blocks"], 0, 0,
                          extra["matched_tokens"], clock.done())
    allocation = target.call("allocate", {
        "token_ids": token_ids, "namespace": src["namespace"], "hash_seed": src["hash_seed"],
        "shared_store": src["shared_store"], "migration_id": uuid.uuid4().hex,
    })
    clock.lap("allocate")
    migration_id, sent = allocation["migration_id"], 0
    try:
        if not allocation["shared"]:
            sent = source.call("transfer", {
                "token_ids": token_ids, "first_block": allocation["first_block"], "slots": allocation["slots"],
                "target": dst, "deadline_s": allocation["deadline_s"],
            })["bytes"]
            clock.lap("transfer")
        answer = target.call("commit", {"migration_id": migration_id, "token_ids": token_ids})
    except MigrationError:
        if not allocation["shared"]:
            _abort_quietly(target, migration_id)
        raise
    clock.lap("commit")
    if answer.get("problem"):
        raise MigrationError(f"{target.url} commit: {answer['problem']}")
    mode = "shared" if allocation["shared"] else "copy"
    return MoveReport(mode, migration_id, extra["full_blocks"], answer["matched_blocks"] - extra["matched_blocks"],
                      sent, answer["matched_tokens"], clock.done())


def _check_compatible(src: dict, dst: dict) -> None:
    for key, why in (("namespace", "model, dtypes, block size, parallel shape, salt and weight version"),
                     ("hash_seed", "PYTHONHASHSEED and prefix_caching_hash_algo")):
        if src[key] != dst[key]:
            raise MigrationError(f"source and target differ in {key} ({src[key]} vs {dst[key]}): {why} must be "
                                 f"equal (weight versions: {src['weight_version']!r} vs {dst['weight_version']!r})",
                                 409)
    if src["shared_store"] is None and "session_id" not in src:
        raise MigrationError("the source's store can neither be shared nor written peer to peer", 409)


def _abort_quietly(target: Instance, migration_id: str) -> None:
    try:
        target.call("abort", {"migration_id": migration_id})
    except MigrationError:
        pass  # the target's watchdog frees the reservation anyway


class _Phases:
    def __init__(self) -> None:
        self._start = self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._last
        self._last = now

    def done(self) -> dict[str, float]:
        self.seconds["total"] = time.perf_counter() - self._start
        return self.seconds


# ---- one request, moved mid-generation -------------------------------------------
@dataclass
class Generation:
    token_ids: list[int]  # generated tokens: on the source, then on the target
    logprobs: list[float]
    margins: list[float]  # each token's top-two logprob gap: where two generations may part (migration/margin.py)
    text: str
    moved_after: int | None  # tokens generated on the source before the move; None: not moved
    report: MoveReport | None = None
    cached_tokens: int = 0  # the target's prefix hit when it resumed (pool included)
    error: str | None = None  # why a move was given up (the source finished the request)


def generate_migrating(source: Instance, target: Instance, prompt_token_ids: list[int], max_tokens: int,
                       migrate_after: int, sampling: dict[str, Any] | None = None,
                       on_token: Callable[[int, str], None] | None = None) -> Generation:
    """Generate ``max_tokens`` tokens, moving the request from ``source`` to ``target`` once it has
    generated at least ``migrate_after`` and reached a block boundary (see the module docstring)."""
    out = Generation([], [], [], "", None)
    block_size = source.call("session", {})["block_size"]
    stream = _Completion(source, prompt_token_ids, max_tokens, sampling)
    try:
        for step in stream:
            _add(out, step, on_token)
            at_boundary = (len(prompt_token_ids) + len(out.token_ids)) % block_size == 1
            if len(out.token_ids) >= migrate_after and at_boundary and not stream.finished:
                break
        if stream.finished:
            return out
        try:
            out.report = move_kv(source, target, prompt_token_ids + out.token_ids)
        except MigrationError as exc:
            out.error = str(exc)  # the source keeps serving: read it to the end
            for step in stream:
                _add(out, step, on_token)
            return out
    finally:
        stream.close()  # closing the stream aborts the request on the source
    out.moved_after = len(out.token_ids)
    rest = _Completion(target, prompt_token_ids + out.token_ids, max_tokens - out.moved_after, sampling)
    try:
        for step in rest:
            _add(out, step, on_token)
    finally:
        rest.close()
    out.cached_tokens = rest.cached_tokens
    return out


@dataclass(frozen=True)
class _Step:
    token: int
    logprob: float
    margin: float
    text: str


def _add(out: Generation, step: _Step, on_token) -> None:
    out.token_ids.append(step.token)
    out.logprobs.append(step.logprob)
    out.margins.append(step.margin)
    out.text += step.text
    if on_token is not None:
        on_token(step.token, step.text)


class _Completion:
    """A streamed ``/v1/completions`` request of token ids, token by token."""

    def __init__(self, instance: Instance, prompt: list[int], max_tokens: int, sampling: dict[str, Any] | None):
        body = {"model": instance.model(), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "return_token_ids": True, "logprobs": 2,
                "stream_options": {"include_usage": True}, **(sampling or {})}
        self._response = requests.post(f"{instance.url}/v1/completions", json=body, headers=instance.headers(),
                                       stream=True, timeout=instance.timeout)
        if self._response.status_code != 200:
            raise MigrationError(f"{instance.url} completions ({self._response.status_code}): "
                                 f"{self._response.text[:300]}", self._response.status_code)
        self._events = self._response.iter_lines()
        self.finished = False
        self.cached_tokens = 0

    def __iter__(self) -> Iterator[_Step]:
        for line in self._events:
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                self.finished = True
                return
            chunk = json.loads(data)
            if chunk.get("usage"):
                details = chunk["usage"].get("prompt_tokens_details") or {}
                self.cached_tokens = details.get("cached_tokens") or 0
            for choice in chunk.get("choices", []):
                tokens = choice.get("token_ids") or []
                found = choice.get("logprobs") or {}
                logprobs = found.get("token_logprobs") or [0.0] * len(tokens)
                tops = found.get("top_logprobs") or [{}] * len(tokens)
                texts = found.get("tokens") or [""] * len(tokens)
                for token, logprob, top, text in zip(tokens, logprobs, tops, texts):
                    yield _Step(token, logprob, top_two_gap((top or {}).values()), text)
                if choice.get("finish_reason"):
                    self.finished = True

    def close(self) -> None:
        self._response.close()
