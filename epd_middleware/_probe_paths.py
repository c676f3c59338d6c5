"""The equivalence probe's two paths into this server's engine: a request whose media one encoder
encodes (this middleware's own encode stage, pinned to it) and whose handles the engine is given, and
a request the engine serves alone. Both are in-process requests to the wrapped app (:mod:`._in_process`),
carrying vLLM's own key, each bounded; what an answer cost is counted. A path that gets no answer to
compare raises :class:`PathFailed`, saying why."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
from starlette.types import ASGIApp, Scope

from ._comparison import ProbeAnswer, answer_of
from ._in_process import ask_app
from ._protocol import CHAT_COMPLETIONS_PATH, DATA_PARALLEL_RANK_HEADER
from ._surfaces import ParsedRequest, Unusable, choices_aborted, openai_chat
from .errors import EPDError, UpstreamError
from .host import Host
from .transport import Transport

if TYPE_CHECKING:
    from ._pipeline import Pipeline

__all__ = ["Cost", "Engine", "PathFailed", "ask_engine", "through_encoder"]


class PathFailed(Exception):
    """One path of the probe got no answer to compare: why."""


@dataclass
class Cost:
    """What the probe has cost this process: runs, requests, tokens."""

    runs: int = 0
    skipped: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, reply: Mapping[str, Any]) -> None:
        self.requests += 1
        usage = reply.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens += _count(usage.get("prompt_tokens"))
            self.completion_tokens += _count(usage.get("completion_tokens"))


def _count(value: Any) -> int:
    """A token count as the engine wrote it, or 0 for anything that is not one."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 40 else 0


class Engine(NamedTuple):
    """The engine the probe asks: the wrapped app, the server's lifespan scope, the host, the transport
    to the encoders."""

    app: ASGIApp
    lifespan_scope: Scope
    host: Host
    transport: Transport


async def through_encoder(
    pipeline: Pipeline, engine: Engine, request: ParsedRequest, encoder: str, request_id: str, cost: Cost
) -> ProbeAnswer:
    """The answer with ``request``'s media encoded by ``encoder`` alone and the engine given the
    handles."""
    surface = openai_chat.SURFACE
    context = pipeline.context(
        request, engine.host, engine.transport, request_id, authorization=None, headers=(), surface=surface
    )
    try:
        prepared = await pipeline.probe(surface, request, context, encoder)
    except (UpstreamError, EPDError) as exc:
        raise PathFailed(f"the encoder's call failed: {exc}") from None
    except Unusable:
        raise PathFailed("the request cannot be written for the engine") from None
    rank = [(DATA_PARALLEL_RANK_HEADER, context.pin_rank)] if context.pin_rank else []
    return await ask_engine(pipeline, engine, prepared.body, request_id, cost, rank)


async def ask_engine(
    pipeline: Pipeline,
    engine: Engine,
    body: bytes,
    request_id: str,
    cost: Cost,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> ProbeAnswer:
    """The engine's answer to ``body`` (a chat completion with logprobs), read and counted."""
    keys = engine.host.vllm_api_keys
    headers = [*([(b"authorization", f"Bearer {keys[0]}".encode())] if keys else []), *(extra or [])]
    # Bounded: a request the engine never finishes (a push that never comes) must not hold every later
    # run behind it.
    limit = pipeline.config.encode_deadline
    try:
        with anyio.fail_after(limit):
            reply = await ask_app(
                engine.app, engine.lifespan_scope, CHAT_COMPLETIONS_PATH, body, request_id, headers
            )
    except TimeoutError:
        raise PathFailed(f"the engine gave no answer within {limit:g} s") from None
    try:
        decoded = json.loads(reply.body)
    except ValueError:
        decoded = None
    if reply.status != 200 or not isinstance(decoded, dict):
        said = reply.body[:300].decode("utf-8", "replace")
        raise PathFailed(f"the engine answered HTTP {reply.status}: {said}")
    if choices_aborted(decoded):
        # Not the model's answer: the engine began shutting down after the probe looked (_draining.py).
        raise PathFailed("the engine aborted the request: the server is shutting down")
    cost.add(decoded)
    try:
        return answer_of(decoded)
    except ValueError as exc:
        raise PathFailed(str(exc)) from None
